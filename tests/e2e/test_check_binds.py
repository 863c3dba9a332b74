"""``xdplb host check-binds`` in a fresh namespace: real sockets, some held by another
process (their SO_REUSEPORT read through pidfd_getfd), the pattern Facebook described
flagged with its addresses, a clean host quiet."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import typer
from typer.testing import CliRunner, Result

from xdplb.cli.host_sockets import EXIT_WARNING, register
from xdplb.lab import netns as netns_mod
from xdplb.sockets import binds

pytestmark = pytest.mark.e2e

runner = CliRunner()
host_app = typer.Typer()
register(host_app)

#: A process that binds UDP [::1]:443 with SO_REUSEADDR but without SO_REUSEPORT and
#: waits for its stdin to close: the plain socket of the pattern, in another process.
HOLDER = """
import socket, sys
s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::1", 443))
print("bound", flush=True)
sys.stdin.read()
"""


def check_binds(ns: str, *args: str) -> Result:
    """The command, run in this thread inside ``ns``."""
    with netns_mod.enter(ns):
        return runner.invoke(host_app, ["check-binds", *args])


def udp6(addr: str, port: int, reuseport: bool) -> socket.socket:
    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((addr, port))
    return s


def tcp_listener(addr: str, port: int, reuseport: bool) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((addr, port))
    s.listen(128)
    return s


@pytest.fixture
def holder(netns: str) -> Iterator[subprocess.Popen[str]]:
    """The other process holding the plain [::1]:443 socket; killed after the test."""
    proc = netns_mod.popen(
        netns, [sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "bound"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_facebook_pattern_is_flagged(netns: str, holder: subprocess.Popen[str]) -> None:
    netns_mod.run(
        netns, ["ip", "addr", "add", "::2/128", "dev", "lo", "nodad"]
    )  # no DAD: bind() refuses a tentative address
    with netns_mod.enter(netns):
        mine = [udp6("::2", 443, True), udp6("::", 443, True)]
    try:
        result = check_binds(netns)
        assert result.exit_code == EXIT_WARNING, result.output
        assert (
            "warning: udp port 443 is bound with SO_REUSEPORT on [::2]:443, [::]:443 and "
            "without it on [::1]:443" in result.output
        )
        result = check_binds(netns, "--json")
        assert result.exit_code == EXIT_WARNING, result.output
        doc = json.loads(result.stdout)
        (finding,) = doc["findings"]
        assert finding["kind"] == "mixed-reuseport"
        assert finding["with_reuseport"] == ["[::2]:443", "[::]:443"]
        assert finding["without_reuseport"] == ["[::1]:443"]
        assert doc["undetermined"] == []
        # The plain socket's option came from the other process.
        with netns_mod.enter(netns):
            (plain,) = [s for s in binds.scan() if str(s.address) == "::1"]
        assert plain.owner is not None and plain.owner[0] == holder.pid
        assert plain.reuseport is False
    finally:
        for s in mine:
            s.close()


def test_tcp_listeners_mixed_on_two_addresses(netns: str) -> None:
    with netns_mod.enter(netns):
        socks = [
            tcp_listener("127.0.0.1", 8443, False),
            tcp_listener("127.0.0.2", 8443, True),
            tcp_listener("127.0.0.2", 8443, True),
        ]
    try:
        result = check_binds(netns)
        assert result.exit_code == EXIT_WARNING, result.output
        assert (
            "tcp port 8443 is bound with SO_REUSEPORT on 127.0.0.2:8443 and without it on "
            "127.0.0.1:8443" in result.output
        )
    finally:
        for s in socks:
            s.close()


def test_clean_host_is_quiet(netns: str) -> None:
    with netns_mod.enter(netns):
        socks = [
            tcp_listener("127.0.0.1", 80, False),
            tcp_listener("::", 22, False),
            udp6("::1", 53, False),
            *(udp6("::", 443, True) for _ in range(4)),
            *(tcp_listener("0.0.0.0", 8443, True) for _ in range(2)),
        ]
    try:
        result = check_binds(netns)
        assert result.exit_code == 0, result.output
        assert "no bind problems (9 bound of 9 sockets)" in result.output
        assert "warning" not in result.output
    finally:
        for s in socks:
            s.close()


def test_a_long_bucket_is_reported(netns: str) -> None:
    """Accepted connections share their listener's bucket: 30 of them make it long."""
    with netns_mod.enter(netns):
        listener = tcp_listener("127.0.0.1", 9000, False)
        clients = [socket.create_connection(("127.0.0.1", 9000), timeout=5) for _ in range(30)]
    accepted = [listener.accept()[0] for _ in clients]
    try:
        result = check_binds(netns, "--long-bucket", "31")
        assert result.exit_code == EXIT_WARNING, result.output
        assert "tcp port 9000 has 31 sockets in one bind bucket (at least 31)" in result.output
        assert check_binds(netns, "--long-bucket", "32").exit_code == 0
    finally:
        for s in [listener, *clients, *accepted]:
            s.close()
