"""The CLI's offline commands and its documented exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from xdplb.cli.app import app
from xdplb.cli.args import EXIT_CONFIG, EXIT_NOT_RUNNING, EXIT_OK

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lb.yaml"
runner = CliRunner()


def test_validate_accepts_the_example() -> None:
    result = runner.invoke(app, ["validate", "-c", str(EXAMPLE)])
    assert result.exit_code == EXIT_OK, result.output
    assert "ok (4 VIPs, 6 backends)" in result.output


def test_validate_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("weight: 2", "weight: -2"))
    result = runner.invoke(app, ["validate", "-c", str(bad)])
    assert result.exit_code == EXIT_CONFIG
    assert "vips[0].backends[0].weight" in result.output


def test_run_refuses_an_invalid_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("vips: [{address: 198.18.100.1, port: 99999}]\n")
    result = runner.invoke(app, ["run", "-c", str(bad)])
    assert result.exit_code == EXIT_CONFIG
    assert "vips[0].port" in result.output


def test_status_and_stop_of_an_instance_that_is_not_there(tmp_path: Path) -> None:
    name = f"absent-{tmp_path.name}"
    assert runner.invoke(app, ["status", "-i", name]).exit_code == EXIT_NOT_RUNNING
    assert runner.invoke(app, ["stop", "-i", name]).exit_code == EXIT_NOT_RUNNING


def _commands(group: typer.Typer, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = [prefix]
    for cmd in group.registered_commands:
        out.append((*prefix, cmd.name or cmd.callback.__name__.replace("_", "-")))  # type: ignore[union-attr]
    for sub in group.registered_groups:
        assert sub.typer_instance is not None and sub.name is not None
        out += _commands(sub.typer_instance, (*prefix, sub.name))
    return out


COMMANDS = _commands(app)


@pytest.mark.parametrize("cmd", COMMANDS, ids=" ".join)
def test_every_help_renders(cmd: tuple[str, ...]) -> None:
    """Help text is rich markup: a stray ``[...]`` in it crashes ``--help``."""
    result = runner.invoke(app, [*cmd, "--help"])
    assert result.exit_code == EXIT_OK, result.output
    assert "Usage:" in result.output


def test_commands_found() -> None:
    assert {("backend", "drain"), ("acl", "deny"), ("run",), ("host", "attach")} <= set(COMMANDS)


@pytest.mark.parametrize("module", ["xdplb.cli", "xdplb.cli.app"])
def test_runs_as_a_module(module: str) -> None:
    """``python -m xdplb.cli``, and ``-m xdplb.cli.app`` as the lab runs it."""
    out = subprocess.run(
        [sys.executable, "-m", module, "validate", "-c", str(EXAMPLE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == EXIT_OK, out.stderr
    assert "ok (4 VIPs, 6 backends)" in out.stdout
