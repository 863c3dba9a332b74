"""One health check of one target: TCP connect, HTTP(S) request, UDP exchange, command.

:func:`run_check` never raises for what the network or the backend does: every outcome is
a :class:`CheckResult` whose ``detail`` is written for an operator ("connect refused",
"HTTP 503", "timeout after 1000 ms"). The whole check, connect included, is bounded by
the target's ``timeout_ms``.

Every socket a check opens gets the target's firewall mark and source address *before*
it connects: a tunnel check (``via: tunnel``) connects to the VIP and relies on the mark
being on the very first packet (the SYN), which the LB's TC program encapsulates to the
backend. That is also why HTTP does not use httpx's ``socket_options`` (httpcore applies
them after connecting) but a network backend of our own (:class:`_MarkedBackend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import ssl
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

from xdplb.config.health import HealthCheckConfig
from xdplb.core.addresses import IPAddress

#: Linux: defer the choice of a source port from bind() to connect(), so that binding a
#: source address does not use up ephemeral ports (which bind() alone picks without
#: knowing the destination).
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)
SO_MARK = getattr(socket, "SO_MARK", 36)

#: Most of a response body an HTTP check reads while looking for ``body``.
MAX_BODY = 64 * 1024
#: Most of a command's stderr kept for the detail.
MAX_DETAIL = 200


@dataclass(frozen=True)
class Target:
    """One thing to check: a backend of a VIP, reached in one way."""

    key: Hashable
    """What the monitor reports state for, e.g. (vip_name, backend_address)."""
    backend: IPAddress
    """The backend this target stands for (the command's XDPLB_BACKEND)."""
    address: IPAddress
    """Where to connect: the VIP (via tunnel) or the backend itself (direct)."""
    port: int
    """Already resolved: the check's ``check_port`` or the VIP's port; 1..65535."""
    check: HealthCheckConfig
    mark: int = 0
    """SO_MARK of the check's socket (0: none): how a tunnel check is steered."""
    source: IPAddress | None = None
    """Bind the check's socket to this address (None: the kernel chooses)."""
    vip: str = ""
    """The VIP's name or address, for the command's environment (XDPLB_VIP)."""

    def __post_init__(self) -> None:
        # A command may stand for a wildcard VIP (port 0); a connection needs a port.
        low = 0 if self.check.checker.kind == "command" else 1
        if not low <= self.port <= 65535:
            raise ValueError(f"port must be between {low} and 65535, got {self.port}")
        if not 0 <= self.mark <= 0xFFFFFFFF:
            raise ValueError(f"mark must fit in 32 bits, got {self.mark}")
        if self.source is not None and self.source.version != self.address.version:
            raise ValueError(f"source {self.source} and address {self.address} differ in family")


@dataclass(frozen=True)
class CheckResult:
    """What one check found."""

    ok: bool
    detail: str
    """For an operator: why it failed, or what it saw ("HTTP 200")."""
    latency: float
    """Seconds from the start of the check to its outcome."""


async def run_check(target: Target) -> CheckResult:
    """Run one check of ``target``, bounded by its ``timeout_ms``."""
    t0 = time.perf_counter()
    timeout_ms = target.check.timeout_ms
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            ok, detail = await _CHECKS[target.check.checker.kind](target)
    except TimeoutError:
        ok, detail = False, f"timeout after {timeout_ms} ms"
    except OSError as e:
        ok, detail = False, _os_detail(e)
    return CheckResult(ok, detail, time.perf_counter() - t0)


# --- sockets ----------------------------------------------------------------------------


def open_socket(target: Target, kind: socket.SocketKind) -> socket.socket:
    """A non-blocking socket for ``target``, marked and bound, not yet connected."""
    family = socket.AF_INET6 if target.address.version == 6 else socket.AF_INET
    sock = socket.socket(family, kind)
    try:
        sock.setblocking(False)
        if target.mark:
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_MARK, target.mark)
            except OSError as e:
                raise OSError(e.errno, f"SO_MARK {target.mark:#x}: {e.strerror}") from None
        if target.source is not None:
            if kind == socket.SOCK_STREAM:
                sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((str(target.source), 0))
        return sock
    except BaseException:
        sock.close()
        raise


async def _connect(target: Target, kind: socket.SocketKind) -> socket.socket:
    sock = open_socket(target, kind)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (str(target.address), target.port))
    except BaseException:
        sock.close()
        raise
    return sock


_ERRNO_DETAIL = {
    errno.ECONNREFUSED: "connect refused",
    errno.ECONNRESET: "connection reset",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.EADDRNOTAVAIL: "source address not available",
}


def _os_detail(e: OSError) -> str:
    if isinstance(e, ssl.SSLError):
        return f"TLS: {e.reason or e}"
    if e.errno in _ERRNO_DETAIL:
        return _ERRNO_DETAIL[e.errno]
    if e.strerror:
        return e.strerror if e.errno is None else f"{e.strerror} (errno {e.errno})"
    return str(e) or type(e).__name__


# --- TCP ---------------------------------------------------------------------------------


async def _tcp(target: Target) -> tuple[bool, str]:
    sock = await _connect(target, socket.SOCK_STREAM)
    sock.close()  # a clean close; the connection was the whole check
    return True, "connected"


# --- UDP ---------------------------------------------------------------------------------


async def _udp(target: Target) -> tuple[bool, str]:
    spec = target.check.checker.udp
    assert spec is not None
    loop = asyncio.get_running_loop()
    # Connected: the kernel drops datagrams from anyone else, and an ICMP port
    # unreachable comes back as ECONNREFUSED on the receive.
    sock = await _connect(target, socket.SOCK_DGRAM)
    try:
        await loop.sock_sendall(sock, spec.payload.encode())
        try:
            reply = await loop.sock_recv(sock, 65535)
        except ConnectionRefusedError:
            return False, "port unreachable"
    finally:
        sock.close()
    if spec.expect is not None and spec.expect.encode() not in reply:
        return False, f"reply lacks {spec.expect!r}"
    return True, f"reply of {len(reply)} bytes"


# --- command -----------------------------------------------------------------------------


async def _command(target: Target) -> tuple[bool, str]:
    spec = target.check.checker.command
    assert spec is not None
    env = dict(os.environ)
    env.update(
        XDPLB_BACKEND=str(target.backend),
        XDPLB_ADDRESS=str(target.address),
        XDPLB_PORT=str(target.port),
        XDPLB_VIP=target.vip,
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            *spec.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills its children too
        )
    except OSError as e:
        return False, f"cannot run {spec.command[0]}: {e.strerror or e}"
    try:
        _, err = await proc.communicate()
    except BaseException:  # the timeout (or the monitor stopping): kill the whole group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        # Reap it; shielded so that a second cancellation cannot leave a zombie behind.
        await asyncio.shield(proc.wait())
        raise
    code = proc.returncode
    if code == 0:
        return True, "exit 0"
    first = err.decode(errors="replace").strip().splitlines()
    why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
    return False, f"{why}: {first[0][:MAX_DETAIL]}" if first else why


# --- HTTP --------------------------------------------------------------------------------


class _Stream(httpcore.AsyncNetworkStream):
    """httpcore's view of one connection: asyncio streams over our own socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        async with asyncio.timeout(timeout):
            return await self._reader.read(max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            self._writer.write(buffer)
            await self._writer.drain()

    async def aclose(self) -> None:
        self._writer.close()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        async with asyncio.timeout(timeout):
            await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info in ("client_addr", "server_addr"):
            return self._writer.get_extra_info("sockname" if info == "client_addr" else "peername")
        if info == "socket":
            return self._writer.get_extra_info("socket")
        return None


class _MarkedBackend(httpcore.AsyncNetworkBackend):
    """Connects with :func:`open_socket`, so the SYN already carries the mark."""

    def __init__(self, target: Target) -> None:
        self._target = target

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        sock = open_socket(self._target, socket.SOCK_STREAM)
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
            reader, writer = await asyncio.open_connection(sock=sock)
        except BaseException:
            sock.close()
            raise
        return _Stream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _tls_context(verify: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


#: Made once: loading the CA bundle takes milliseconds, and contexts are not tied to a loop.
_TLS = {True: _tls_context(True), False: _tls_context(False)}


def _client(target: Target) -> httpx.AsyncClient:
    """A client whose every connection is opened by :class:`_MarkedBackend`, one per check
    (``Connection: close``: nothing to keep alive, nothing to clean up between checks)."""
    spec = target.check.checker.http
    assert spec is not None
    ctx = _TLS[spec.verify_tls]
    transport = httpx.AsyncHTTPTransport(verify=ctx, retries=0)
    # httpx does not let a network backend be passed in; the pool is its one attribute
    # that holds it (httpx 0.27 and 0.28 alike).
    transport._pool = httpcore.AsyncConnectionPool(
        ssl_context=ctx,
        max_connections=None,
        max_keepalive_connections=0,
        retries=0,
        network_backend=_MarkedBackend(target),
    )
    return httpx.AsyncClient(transport=transport, verify=ctx, trust_env=False, timeout=None)


def url_of(target: Target) -> str:
    """The URL of an HTTP(S) check: the target address (IPv6 in brackets) and port."""
    spec = target.check.checker.http
    assert spec is not None
    host = f"[{target.address}]" if target.address.version == 6 else str(target.address)
    return f"{spec.scheme}://{host}:{target.port}{spec.uri}"


async def _http(target: Target) -> tuple[bool, str]:
    spec = target.check.checker.http
    assert spec is not None
    headers = {"Connection": "close", "User-Agent": "xdplb-health"}
    extensions: dict[str, Any] = {}
    if spec.host is not None:
        headers["Host"] = spec.host
        extensions["sni_hostname"] = spec.host
    try:
        async with _client(target) as client:
            request = client.build_request(
                spec.method, url_of(target), headers=headers, extensions=extensions
            )
            response = await client.send(request, stream=True)
            try:
                if response.status_code not in spec.codes:
                    return False, f"HTTP {response.status_code}"
                if spec.body is None:
                    return True, f"HTTP {response.status_code}"
                return await _find_body(response, spec.body)
            finally:
                await response.aclose()
    except httpx.HTTPError as e:
        return False, _http_detail(e)


async def _find_body(response: httpx.Response, needle: str) -> tuple[bool, str]:
    want = needle.encode()
    seen = bytearray()
    async for chunk in response.aiter_bytes():  # decoded: gzip and chunked alike
        seen += chunk
        if want in seen:
            return True, f"HTTP {response.status_code}"
        if len(seen) >= MAX_BODY:
            break
    return False, f"body lacks {needle!r}"


def _http_detail(e: httpx.HTTPError) -> str:
    cause: BaseException | None = e
    while cause is not None:  # the OSError under httpx's and httpcore's wrappers
        if isinstance(cause, OSError):
            return _os_detail(cause)
        cause = cause.__cause__ or cause.__context__
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, httpx.RemoteProtocolError):
        return f"bad HTTP response: {e}"
    return str(e) or type(e).__name__


_CHECKS = {"tcp": _tcp, "http": _http, "udp": _udp, "command": _command}
