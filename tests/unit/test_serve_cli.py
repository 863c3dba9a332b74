"""``xdplb serve`` without a kernel: what it accepts on the way in, what it says when
nothing runs, and how a server reads what the supervisor passes it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from xdplb.cli.args import EXIT_CONFIG, EXIT_NOT_RUNNING
from xdplb.cli.serve import SERVE_CONTEXT, serve_command
from xdplb.sockets import example_server
from xdplb.sockets.serve import (
    Endpoint,
    NotServing,
    ServeConfig,
    ServeError,
    Supervisor,
    parse_endpoint,
    reload,
)

pytestmark = pytest.mark.unit

# Registered as xdplb.cli.app registers it: a sub-command of a group.
app = typer.Typer(add_completion=False, rich_markup_mode=None)
app.command("serve", context_settings=SERVE_CONTEXT)(serve_command)


@app.callback()
def _group() -> None:
    """xdplb."""


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:80", Endpoint("tcp", "127.0.0.1", 80)),
        ("[::1]:443", Endpoint("tcp", "::1", 443)),
        ("0.0.0.0:0", Endpoint("tcp", "0.0.0.0", 0)),
    ],
)
def test_endpoints_read(text: str, want: Endpoint) -> None:
    assert parse_endpoint("tcp", text) == want


@pytest.mark.parametrize("text", ["80", ":80", "host:", "h:99999", "h:x"])
def test_bad_endpoints_name_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        parse_endpoint("udp", text)


def test_endpoint_prints_v6_in_brackets() -> None:
    assert str(Endpoint("udp", "::1", 53)) == "udp [::1]:53"


def test_supervisor_needs_an_address_and_a_command() -> None:
    with pytest.raises(ServeError, match="nothing to serve"):
        Supervisor(ServeConfig(name="x", command=("true",)))
    with pytest.raises(ServeError, match="no server command"):
        Supervisor(ServeConfig(name="x", command=(), tcp=Endpoint("tcp", "::1", 1)))


def test_cli_without_a_command_is_a_usage_error(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["serve", "--name", "web", "--tcp", "127.0.0.1:80"])
    assert r.exit_code == EXIT_CONFIG, r.output
    assert "no server command" in r.stderr


def test_cli_bad_address_is_a_usage_error() -> None:
    r = CliRunner().invoke(app, ["serve", "--name", "web", "--udp", "nowhere", "--", "srv"])
    assert r.exit_code == EXIT_CONFIG, r.output
    assert "'nowhere' is not HOST:PORT" in r.stderr


def test_server_options_after_its_name_are_the_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tcp`` after the command belongs to the server: the supervisor has none, so it
    refuses to start (nothing to serve) rather than taking the server's option."""
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))
    r = CliRunner().invoke(app, ["serve", "--name", "web", "--no-bpf", "srv", "--tcp", "1.2.3.4:5"])
    assert "nothing to serve" in r.stderr, r.output


def test_a_name_that_is_not_a_file_name_is_a_usage_error() -> None:
    r = CliRunner().invoke(app, ["serve", "--name", "../x", "--tcp", "127.0.0.1:80", "--", "s"])
    assert r.exit_code == EXIT_CONFIG, r.output
    assert "'../x' is not an instance name" in r.stderr


def test_reload_and_status_without_a_supervisor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))
    with pytest.raises(NotServing):
        reload("web")
    for flag in ("--reload", "--status"):
        r = CliRunner().invoke(app, ["serve", "--name", "web", flag])
        assert r.exit_code == EXIT_NOT_RUNNING, r.output
        assert "web" in r.stderr


def test_reload_ignores_a_stale_pid_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))
    (tmp_path / "serve-web.pid").write_text("999999999\n")
    with pytest.raises(NotServing, match="is running"):
        reload("web")


def test_passed_sockets_are_only_for_the_named_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    """LISTEN_FDS meant for another process (a parent's) is not taken, and not handed on."""
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "2")
    monkeypatch.setenv("LISTEN_FDNAMES", "tcp:udp")
    assert example_server.listen_fds() == []
    assert "LISTEN_FDS" not in os.environ


def test_notify_without_a_socket_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert example_server.sd_notify("READY=1") is False
