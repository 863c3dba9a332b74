"""How the CLI finds the daemon (issue 10, failure 1): ``--api``, else the ``api`` section
of the ``-c`` file, else the default socket, for every command; each error names the
endpoint it tried and where it came from; ``status`` reads the pins only with
``--offline``. Against the fake controller served over TCP on 127.0.0.1."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fake_controller import FakeController
from test_cli_client import VIP, serve
from typer.testing import CliRunner

from xdplb.cli.app import app
from xdplb.cli.args import EXIT_CONFIG, EXIT_NOT_RUNNING, EXIT_OK
from xdplb.cli.client import Endpoint, endpoint
from xdplb.config import parse_config
from xdplb.core.errors import ConfigError

pytestmark = pytest.mark.unit

runner = CliRunner()
TOKEN = "a-token-of-16-chars-or-more"


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("XDPLB_TOKEN", raising=False)
    monkeypatch.delenv("XDPLB_API", raising=False)


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config_file(tmp_path: Path, api: dict[str, object], instance: str = "fromfile") -> Path:
    path = tmp_path / "lb.yaml"
    path.write_text(yaml.safe_dump({"instance": instance, "api": api}))
    return path


def test_the_order_api_then_the_file_then_the_default_socket(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tcp = parse_config({"instance": "x", "api": {"listen": "127.0.0.1:9180", "token": TOKEN}})
    unix = parse_config({"instance": "x", "api": {"listen": "unix:/tmp/x.sock"}})
    bare = parse_config({"instance": "x"})
    f = Path("lb.yaml")
    # --api first, whatever the file says.
    assert endpoint("x", api="http://h:1", token="t", config=f, cfg=tcp) == Endpoint(
        url="http://h:1", token="t", origin="--api"
    )
    # Then the file's api section: the TCP address with its token, or its unix socket.
    assert endpoint("x", config=f, cfg=tcp) == Endpoint(
        url="http://127.0.0.1:9180", token=TOKEN, origin="api.listen in lb.yaml"
    )
    assert endpoint("x", token="mine", config=f, cfg=tcp).token == "mine"
    assert endpoint("x", config=f, cfg=unix) == Endpoint(
        socket=Path("/tmp/x.sock"), origin="api.listen in lb.yaml"
    )
    v6 = parse_config({"api": {"listen": "[::1]:9180"}})
    assert endpoint(config=f, cfg=v6).url == "http://[::1]:9180"
    # A file without api.listen: the default socket of the file's instance.
    assert endpoint("ignored", config=f, cfg=bare) == Endpoint(socket=run / "x.api.sock")
    # Nothing given: the default socket of the instance.
    assert endpoint("y") == Endpoint(socket=run / "y.api.sock")


def test_the_token_file_is_read_as_the_daemon_reads_it(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\nsecond line\n")
    cfg = parse_config({"api": {"listen": "127.0.0.1:9180", "token_file": str(token_file)}})
    assert endpoint(config=Path("f"), cfg=cfg).token == TOKEN
    token_file.write_text("short\n")
    with pytest.raises(ConfigError) as e:
        endpoint(config=Path("f"), cfg=cfg)
    assert e.value.field == "api.token_file"


@pytest.fixture
def daemon_on_tcp() -> Iterator[tuple[FakeController, int]]:
    fake = FakeController()
    for server in serve(fake, token=TOKEN):
        yield fake, server.servers[0].sockets[0].getsockname()[1]


def test_list_status_and_changes_go_where_the_file_says(
    tmp_path: Path, daemon_on_tcp: tuple[FakeController, int]
) -> None:
    fake, port = daemon_on_tcp
    cfg = config_file(tmp_path, {"listen": f"127.0.0.1:{port}", "token": TOKEN})
    r = runner.invoke(app, ["list", "-c", str(cfg)])
    assert r.exit_code == EXIT_OK, r.output
    assert "TCP  198.18.100.1:80 maglev" in r.stdout
    r = runner.invoke(app, ["status", "-c", str(cfg), "--json"])
    assert r.exit_code == EXIT_OK, r.output
    assert '"source": "daemon"' in r.stdout
    r = runner.invoke(app, ["backend", "weight", VIP, "198.18.0.13", "7", "-c", str(cfg)])
    assert r.exit_code == EXIT_OK, r.output
    assert fake.cfg.vips[0].backends[2].weight == 7


def test_errors_name_the_endpoint_and_its_origin(tmp_path: Path) -> None:
    port = free_port()
    cfg = config_file(tmp_path, {"listen": f"127.0.0.1:{port}"})
    r = runner.invoke(app, ["list", "-c", str(cfg)])
    assert r.exit_code == EXIT_NOT_RUNNING
    assert r.stderr == (
        f"instance fromfile is not running: no daemon at http://127.0.0.1:{port} "
        f"(from api.listen in {cfg}): connection refused\n"
    )
    # status does not fall back to the pins: the same error, and the way to read them.
    r = runner.invoke(app, ["status", "-c", str(cfg)])
    assert r.exit_code == EXIT_NOT_RUNNING
    assert r.stderr == (
        f"instance fromfile is not running: no daemon at http://127.0.0.1:{port} "
        f"(from api.listen in {cfg}): connection refused "
        "('xdplb status --offline' reads the pinned maps)\n"
    )
    r = runner.invoke(
        app, ["backend", "drain", VIP, "198.18.0.11", "--api", f"http://127.0.0.1:{port}"]
    )
    assert r.exit_code == EXIT_NOT_RUNNING
    assert r.stderr == (
        f"instance default is not running: no daemon at http://127.0.0.1:{port} "
        "(from --api): connection refused\n"
    )
    sock = tmp_path / "run" / "x.api.sock"
    r = runner.invoke(app, ["vip", "list", "-i", "x"])
    assert (r.exit_code, r.stderr) == (
        EXIT_NOT_RUNNING,
        f"instance x is not running: no daemon: {sock} does not exist\n",
    )
    unix = config_file(tmp_path, {"listen": f"unix:{tmp_path}/elsewhere.sock"})
    r = runner.invoke(app, ["acl", "list", "-c", str(unix)])
    assert r.stderr == (
        f"instance fromfile is not running: no daemon: {tmp_path}/elsewhere.sock does not "
        f"exist (from api.listen in {unix})\n"
    )


def test_an_unreadable_token_file_is_a_configuration_error(tmp_path: Path) -> None:
    cfg = config_file(
        tmp_path, {"listen": "127.0.0.1:9180", "token_file": str(tmp_path / "absent")}
    )
    r = runner.invoke(app, ["list", "-c", str(cfg)])
    assert r.exit_code == EXIT_CONFIG
    assert r.stderr.startswith(f"invalid configuration {cfg}: api.token_file: cannot read")
