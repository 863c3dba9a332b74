"""What the CLI prints (issue 10, failures 2, 9 and 11): messages carrying data print
their square brackets as written; --version; help without ``<bool>`` or RST backticks,
with examples; unknown fields get a did-you-mean; errors are not wrapped; an instance
name that would leave its directory is a usage error."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from test_cli import COMMANDS
from typer.testing import CliRunner

from xdplb.cli.app import app
from xdplb.cli.args import EXIT_CONFIG, EXIT_OK
from xdplb.cli.console import markup

pytestmark = pytest.mark.unit

runner = CliRunner()
V6 = "fd78:6470:6c62:100::1"


def test_a_vip_in_brackets_survives_validate(tmp_path: Path) -> None:
    cfg = tmp_path / "twice.yaml"
    vip = f"{{address: '{V6}', port: 80, backends: [{{address: 'fd78:6470:6c62::11'}}]}}"
    cfg.write_text(f"vips: [{vip}, {vip}]\n")
    r = runner.invoke(app, ["validate", "-c", str(cfg)])
    assert r.exit_code == EXIT_CONFIG
    assert r.stderr == f"invalid {cfg}: vips: VIP [{V6}]:80/tcp is listed twice\n"


def test_a_yaml_error_keeps_its_caret_line_and_message(tmp_path: Path) -> None:
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("vips: [a, b\ninstance: x\n")
    r = runner.invoke(app, ["validate", "-c", str(cfg)])
    assert r.exit_code == EXIT_CONFIG
    lines = r.stderr.splitlines()
    assert lines[0] == f"invalid {cfg}: {cfg} is not valid YAML:"
    assert "    vips: [a, b" in lines
    assert "          ^" in lines
    assert "expected ',' or ']', but got ':'" in lines


def test_markup_colours_only_the_fixed_words() -> None:
    text = markup("[red]invalid[/red] {}: {}", "[bold]x[/bold]", f"[{V6}]:80")
    assert text.plain == f"invalid [bold]x[/bold]: [{V6}]:80"
    assert [(s.start, s.end, str(s.style)) for s in text.spans] == [(0, 7, "red")]


def test_version() -> None:
    r = runner.invoke(app, ["--version"])
    assert (r.exit_code, r.stdout) == (EXIT_OK, f"xdplb {importlib.metadata.version('xdplb')}\n")


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_help_is_plain(cmd: tuple[str, ...]) -> None:
    out = runner.invoke(app, [*cmd, "--help"]).stdout
    assert "<bool>" not in out and "``" not in out and "`xdplb" not in out, out


def test_the_main_help_has_examples() -> None:
    out = runner.invoke(app, ["--help"]).stdout
    assert "Examples:" in out
    assert "  xdplb list -c /etc/xdplb/xdplb.yaml" in out
    assert "  xdplb status -i lb1 --offline" in out


def test_an_unknown_field_gets_a_did_you_mean(tmp_path: Path) -> None:
    cfg = tmp_path / "typo.yaml"
    cfg.write_text("interface: [eth0]\n")
    r = runner.invoke(app, ["validate", "-c", str(cfg)])
    assert r.exit_code == EXIT_CONFIG
    assert r.stderr == (
        f"invalid {cfg}: interface: unknown field 'interface': did you mean 'interfaces'?\n"
    )


def test_errors_are_not_wrapped(tmp_path: Path) -> None:
    cfg = tmp_path / ("a-long-directory-name-" * 4) / "lb.yaml"
    cfg.parent.mkdir()
    cfg.write_text("vips: [{address: 198.18.100.1, port: 99999}]\n")
    r = runner.invoke(app, ["validate", "-c", str(cfg)])
    assert r.exit_code == EXIT_CONFIG
    (line,) = r.stderr.splitlines()
    assert len(line) > 120 and line.startswith(f"invalid {cfg}: vips[0].port:")


@pytest.mark.parametrize("name", ["..", ".", ".hidden", "a/b", "../x"])
@pytest.mark.parametrize(
    "cmd", [("stop",), ("status",), ("list",), ("host", "detach", "--dev", "lo")]
)
def test_an_instance_name_that_leaves_its_directory_is_a_usage_error(
    cmd: tuple[str, ...], name: str
) -> None:
    r = runner.invoke(app, [*cmd, "-i", name])
    assert r.exit_code == EXIT_CONFIG, r.output
    assert f"{name!r} is not an instance name" in r.stderr


def test_instance_dotdot_fails_validate_naming_instance(tmp_path: Path) -> None:
    cfg = tmp_path / "dotdot.yaml"
    cfg.write_text("instance: '..'\n")
    r = runner.invoke(app, ["validate", "-c", str(cfg)])
    assert r.exit_code == EXIT_CONFIG
    assert r.stderr.startswith(f"invalid {cfg}: instance: '..' is not an instance name")
