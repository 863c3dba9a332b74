"""The real checkers against real servers that each test starts on loopback (127.0.0.1 and
::1), and in a namespace of their own for the firewall mark: a marked check must reach a
server that only marked packets are routed to.

Every check has a timeout of 200-500 ms; each test takes well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Any, cast

import pytest

from xdplb.config.health import HealthCheckConfig
from xdplb.health.checkers import SO_MARK, CheckResult, Target, open_socket, run_check, url_of
from xdplb.lab import netns
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

LOOPBACKS = ["127.0.0.1", "::1"]
TIMEOUT_MS = 300


def make_target(
    checker: dict[str, Any],
    port: int,
    address: str = "127.0.0.1",
    *,
    timeout_ms: int = TIMEOUT_MS,
    **kw: Any,
) -> Target:
    cfg = HealthCheckConfig.model_validate(
        {"checker": checker, "interval_ms": 1000, "timeout_ms": timeout_ms}
    )
    addr = ip_address(address)
    return Target(key=("vip", address), backend=addr, address=addr, port=port, check=cfg, **kw)


def check(checker: dict[str, Any], port: int, address: str = "127.0.0.1", **kw: Any) -> CheckResult:
    return asyncio.run(run_check(make_target(checker, port, address, **kw)))


def free_port(kind: socket.SocketKind = socket.SOCK_STREAM, address: str = "127.0.0.1") -> int:
    """A port nothing listens on (bound, then released)."""
    fam = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(fam, kind) as s:
        s.bind((address, 0))
        port: int = s.getsockname()[1]
        return port


# --- TCP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("address", LOOPBACKS)
def test_tcp_up(address: str) -> None:
    fam = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as srv:
        srv.bind((address, 0))
        srv.listen(8)
        r = check({"tcp": {}}, srv.getsockname()[1], address)
        conn, _ = srv.accept()  # the connection really was made
        conn.close()
    assert (r.ok, r.detail) == (True, "connected")
    assert r.latency > 0


@pytest.mark.parametrize("address", LOOPBACKS)
def test_tcp_refused(address: str) -> None:
    r = check({"tcp": {}}, free_port(address=address), address)
    assert (r.ok, r.detail) == (False, "connect refused")


def test_tcp_timeout_when_the_accept_queue_is_full() -> None:
    # A full accept queue makes Linux drop SYNs: the connect hangs until the timeout.
    with socket.socket() as srv, contextlib.ExitStack() as stack:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        filler = stack.enter_context(socket.socket())  # backlog 0: one connection fills it
        filler.settimeout(0.5)
        filler.connect(("127.0.0.1", port))
        r = check({"tcp": {}}, port, timeout_ms=200)
    assert (r.ok, r.detail) == (False, "timeout after 200 ms")
    assert r.latency >= 0.19  # it waited its timeout (how much longer: the machine's load)


def test_tcp_binds_the_source_address() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        r = check({"tcp": {}}, srv.getsockname()[1], source=IPv4Address("127.0.0.2"))
        conn, peer = srv.accept()
        conn.close()
    assert r.ok
    assert peer[0] == "127.0.0.2"


# --- HTTP --------------------------------------------------------------------------------


class HttpServer:
    """A small HTTP/1.1 server: records each request; the path picks the answer."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.sni: list[str | None] = []
        self.port = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        line, *fields = head.decode().split("\r\n")
        method, path, _ = line.split(" ")
        headers = {k.lower(): v.strip() for k, _, v in (f.partition(":") for f in fields if f)}
        self.requests.append({"method": method, "path": path, "headers": headers})
        if path == "/hang":
            await asyncio.sleep(5)  # the scenario: a server slower than any check's timeout
        status, body = {"/": (200, b"all ok"), "/down": (503, b"maintenance")}.get(
            path, (404, b"no such page")
        )
        if path == "/chunked":
            writer.write(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            )
            for part in (b"first half, ", b"then the word ", b"healthy"):
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(
                b"HTTP/1.1 %d X\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                % (status, len(body))
            )
            if method != "HEAD":
                writer.write(body)
        await writer.drain()
        writer.close()

    @contextlib.asynccontextmanager
    async def serving(
        self, address: str = "127.0.0.1", ssl_ctx: ssl.SSLContext | None = None
    ) -> AsyncIterator[HttpServer]:
        srv = await asyncio.start_server(self.handle, address, 0, ssl=ssl_ctx)
        self.port = srv.sockets[0].getsockname()[1]
        async with srv:
            yield self


def http_check(
    http: dict[str, Any], address: str = "127.0.0.1", **kw: Any
) -> tuple[CheckResult, HttpServer]:
    server = HttpServer()

    async def main() -> CheckResult:
        async with server.serving(address):
            return await run_check(make_target({"http": http}, server.port, address, **kw))

    return asyncio.run(main()), server


@pytest.mark.parametrize("address", LOOPBACKS)
def test_http_up_and_what_the_server_sees(address: str) -> None:
    r, server = http_check({"uri": "/", "body": "ok"}, address)
    assert (r.ok, r.detail) == (True, "HTTP 200")
    (req,) = server.requests
    host = f"[{address}]" if ":" in address else address
    assert req["method"] == "GET" and req["path"] == "/"
    assert req["headers"]["host"] == f"{host}:{server.port}"
    assert req["headers"]["connection"] == "close"


def test_http_url_brackets_ipv6() -> None:
    t = make_target({"http": {"uri": "/x?y=1"}}, 8080, "fd78:6470:6c62::11")
    assert url_of(t) == "http://[fd78:6470:6c62::11]:8080/x?y=1"


def test_http_host_header_and_head() -> None:
    r, server = http_check({"method": "HEAD", "host": "www.example.com"})
    assert (r.ok, r.detail) == (True, "HTTP 200")
    (req,) = server.requests
    assert req["method"] == "HEAD"
    assert req["headers"]["host"] == "www.example.com"


@pytest.mark.parametrize(
    ("http", "ok", "detail"),
    [
        ({"uri": "/down"}, False, "HTTP 503"),
        ({"uri": "/down", "codes": [200, 503]}, True, "HTTP 503"),
        ({"uri": "/nothing"}, False, "HTTP 404"),
        ({"uri": "/", "body": "healthy"}, False, "body lacks 'healthy'"),
        ({"uri": "/chunked", "body": "healthy"}, True, "HTTP 200"),
        ({"uri": "/down", "codes": [503], "body": "maint"}, True, "HTTP 503"),
    ],
    ids=["503", "503-expected", "404", "body-lacks", "chunked-body", "body-of-503"],
)
def test_http_codes_and_body(http: dict[str, Any], ok: bool, detail: str) -> None:
    r, _ = http_check(http)
    assert (r.ok, r.detail) == (ok, detail)


def test_http_timeout_when_the_server_never_answers() -> None:
    r, server = http_check({"uri": "/hang"}, timeout_ms=250)
    assert (r.ok, r.detail) == (False, "timeout after 250 ms")
    assert 0.24 <= r.latency < 5  # it waited its timeout, not the server's 5 s
    assert len(server.requests) == 1  # it connected and sent the request, then waited


@pytest.mark.parametrize("address", LOOPBACKS)
def test_http_refused(address: str) -> None:
    r = check({"http": {}}, free_port(address=address), address)
    assert (r.ok, r.detail) == (False, "connect refused")


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for www.example.com (openssl; no Python crypto needed)."""
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    argv = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    argv += ["-subj", "/CN=www.example.com", "-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        argv,
        check=True,
        capture_output=True,
        timeout=30,
    )
    return key, cert


def https_check(
    self_signed: tuple[Path, Path], http: dict[str, Any], address: str = "127.0.0.1"
) -> tuple[CheckResult, HttpServer]:
    key, cert = self_signed
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    server = HttpServer()

    def sni(sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        server.sni.append(name)

    ctx.sni_callback = sni  # type: ignore[assignment]

    async def main() -> CheckResult:
        async with server.serving(address, ctx):
            target = make_target({"http": {"scheme": "https", **http}}, server.port, address)
            return await run_check(target)

    return asyncio.run(main()), server


@pytest.mark.parametrize("address", LOOPBACKS)
def test_https_self_signed_without_verification(
    self_signed: tuple[Path, Path], address: str
) -> None:
    r, server = https_check(self_signed, {"body": "all ok"}, address)
    assert (r.ok, r.detail) == (True, "HTTP 200")
    assert len(server.requests) == 1
    assert server.sni == [None]  # no server name for an address


def test_https_sends_the_host_as_server_name(self_signed: tuple[Path, Path]) -> None:
    r, server = https_check(self_signed, {"host": "www.example.com"})
    assert r.ok
    assert server.sni == ["www.example.com"]
    assert server.requests[0]["headers"]["host"] == "www.example.com"


def test_https_verification_refuses_a_self_signed_certificate(
    self_signed: tuple[Path, Path],
) -> None:
    r, server = https_check(self_signed, {"host": "www.example.com", "verify_tls": True})
    assert not r.ok
    assert r.detail == "TLS: CERTIFICATE_VERIFY_FAILED"
    assert server.requests == []


# --- UDP ---------------------------------------------------------------------------------


class Udp(asyncio.DatagramProtocol):
    """Echoes with a prefix, or stays silent."""

    def __init__(self, silent: bool = False) -> None:
        self.silent = silent
        self.got: list[bytes] = []
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.got.append(data)
        if not self.silent and self.transport is not None:
            self.transport.sendto(b"pong:" + data, addr)


def udp_check(
    udp: dict[str, Any], address: str = "127.0.0.1", **kw: Any
) -> tuple[CheckResult, Udp]:
    proto = Udp(silent=kw.pop("silent", False))

    async def main() -> CheckResult:
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: proto, local_addr=(address, 0)
        )
        try:
            port = transport.get_extra_info("sockname")[1]
            return await run_check(make_target({"udp": udp}, port, address, **kw))
        finally:
            transport.close()

    return asyncio.run(main()), proto


@pytest.mark.parametrize("address", LOOPBACKS)
def test_udp_echo(address: str) -> None:
    r, server = udp_check({"payload": "hello", "expect": "pong:hello"}, address)
    assert (r.ok, r.detail) == (True, "reply of 10 bytes")
    assert server.got == [b"hello"]


def test_udp_any_reply_and_default_payload() -> None:
    r, server = udp_check({})
    assert r.ok
    assert server.got == [b"xdplb-health"]


def test_udp_expect_mismatch() -> None:
    r, _ = udp_check({"expect": "status=up"})
    assert (r.ok, r.detail) == (False, "reply lacks 'status=up'")


def test_udp_no_reply_times_out() -> None:
    r, server = udp_check({}, silent=True, timeout_ms=200)
    assert (r.ok, r.detail) == (False, "timeout after 200 ms")
    assert server.got == [b"xdplb-health"]
    assert r.latency >= 0.19  # it waited its timeout


@pytest.mark.parametrize("address", LOOPBACKS)
def test_udp_port_unreachable(address: str) -> None:
    r = check({"udp": {}}, free_port(socket.SOCK_DGRAM, address), address)
    assert (r.ok, r.detail) == (False, "port unreachable")


# --- command -----------------------------------------------------------------------------


def test_command_exit_0_and_its_environment(tmp_path: Path) -> None:
    out = tmp_path / "env"
    script = (
        f'printf "%s %s %s %s" "$XDPLB_BACKEND" "$XDPLB_ADDRESS" "$XDPLB_PORT" "$XDPLB_VIP" > {out}'
    )
    cfg = HealthCheckConfig.model_validate(
        {"checker": {"command": {"command": ["sh", "-c", script]}}, "timeout_ms": 500}
    )
    t = Target(
        key="k",
        backend=IPv6Address("fd78:6470:6c62::11"),
        address=IPv6Address("fd78:6470:6c62::100"),
        port=8443,
        check=cfg,
        vip="web",
    )
    r = asyncio.run(run_check(t))
    assert (r.ok, r.detail) == (True, "exit 0")
    assert out.read_text() == "fd78:6470:6c62::11 fd78:6470:6c62::100 8443 web"


def test_command_exit_1_reports_the_first_line_of_stderr() -> None:
    r = check(
        {"command": {"command": ["sh", "-c", "echo 'disk full' >&2; echo more >&2; exit 1"]}}, 80
    )
    assert (r.ok, r.detail) == (False, "exit 1: disk full")


def test_command_that_cannot_run() -> None:
    r = check({"command": {"command": ["/nonexistent/xdplb-check"]}}, 80)
    assert (r.ok, r.detail) == (
        False,
        "cannot run /nonexistent/xdplb-check: No such file or directory",
    )


def test_command_timeout_kills_it_and_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    r = check(
        {"command": {"command": ["sh", "-c", f"sleep 30 & echo $! > {pidfile}; wait"]}},
        80,
        timeout_ms=300,
    )
    assert (r.ok, r.detail) == (False, "timeout after 300 ms")
    assert r.latency < 30  # it waited its timeout, not the command's sleep
    child = int(pidfile.read_text())

    def child_state() -> str:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2]
        except FileNotFoundError:
            return "gone"

    # The grandchild was killed with the group (it may still be a zombie of init briefly).
    wait_for(child_state, f"sleep {child} killed", until=lambda st: st in ("gone", "Z"))


# --- sockets: mark and source ------------------------------------------------------------


def test_open_socket_sets_the_mark_and_binds_before_connecting() -> None:
    t = make_target({"tcp": {}}, 80, mark=0x2A, source=IPv4Address("127.0.0.3"))
    with open_socket(t, socket.SOCK_STREAM) as s:
        assert s.getsockopt(socket.SOL_SOCKET, SO_MARK) == 0x2A
        assert s.getsockname()[0] == "127.0.0.3"
        assert not s.getblocking()
    t = make_target({"udp": {}}, 80, "::1", mark=7)
    with open_socket(t, socket.SOCK_DGRAM) as s:
        assert s.getsockopt(socket.SOL_SOCKET, SO_MARK) == 7
        assert s.family == socket.AF_INET6


MARK = 0x2A


@pytest.fixture(scope="module")
def mark_ns() -> Iterator[str]:
    """A namespace where only packets with MARK are routed at all: the first rule makes
    every unmarked lookup unreachable (the local table comes after it)."""
    name = f"xdplbt-{os.getpid()}-hcmark"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (
            "link set lo up",
            "rule add pref 100 lookup local",
            "rule del pref 0",
            f"rule add pref 10 not fwmark {MARK:#x} unreachable",
        ):
            subprocess.run(["ip", "-n", name, *cmd.split()], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def _marked_server(kind: socket.SocketKind) -> socket.socket:
    # The server's replies need the mark too (a SYN-ACK and an accepted socket inherit
    # the listener's).
    s = socket.socket(socket.AF_INET, kind)
    s.setsockopt(socket.SOL_SOCKET, SO_MARK, MARK)
    s.bind(("127.0.0.1", 0))
    return s


@pytest.mark.parametrize("kind", ["tcp", "http", "udp"])
def test_marked_checks_take_the_marked_route(mark_ns: str, kind: str) -> None:
    async def main() -> tuple[CheckResult, CheckResult]:
        loop = asyncio.get_running_loop()
        sock = _marked_server(socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM)
        port = sock.getsockname()[1]
        closer: Any
        if kind == "udp":
            closer, _ = await loop.create_datagram_endpoint(Udp, sock=sock)
        elif kind == "http":
            closer = await asyncio.start_server(HttpServer().handle, sock=sock)
        else:  # the kernel completes the handshake: a listener is all a TCP check needs
            sock.listen(8)
            closer = sock
        try:
            marked = make_target({kind: {}}, port, mark=MARK)
            unmarked = make_target({kind: {}}, port)
            return await run_check(marked), await run_check(unmarked)
        finally:
            closer.close()

    with netns.enter(mark_ns):
        marked, unmarked = asyncio.run(main())
    assert marked.ok, marked.detail
    assert (unmarked.ok, unmarked.detail) == (False, "network unreachable")
