"""Client-side traffic for the lab: real sockets opened in the client's namespace.

Each exchange verifies its bytes and returns the name of the backend that answered
(the servers of :mod:`xdplb.lab.apps` say who they are). Source ports can be fixed so
that a test knows its flows — and so what the model predicts for them — in advance.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import socket
from dataclasses import dataclass

from xdplb.lab import netns


class ExchangeError(Exception):
    """A lab exchange failed or returned bytes other than those sent."""


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET


def open_socket(ns: str, addr: str, kind: int, src_port: int | None) -> socket.socket:
    """A socket of the right family created in ``ns``, bound to ``src_port`` if given."""
    with netns.enter(ns):
        sock = socket.socket(_family(addr), kind)
    if src_port is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if sock.family == socket.AF_INET6 else "0.0.0.0", src_port))
    return sock


def http_post(
    ns: str,
    addr: str,
    port: int,
    body: bytes,
    *,
    src_port: int | None = None,
    timeout: float = 5.0,
) -> str:
    """One HTTP/1.1 POST over its own connection; the backend's name."""
    sock = open_socket(ns, addr, socket.SOCK_STREAM, src_port)
    try:
        sock.settimeout(timeout)
        sock.connect((addr, port))
        conn = http.client.HTTPConnection(addr, port, timeout=timeout)
        conn.sock = sock
        conn.request("POST", "/", body=body, headers={"Connection": "close"})
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException) as e:
        # HTTPException: the server died mid-reply (IncompleteRead, a bad status line).
        raise ExchangeError(f"HTTP {addr}:{port} from port {src_port}: {e!r}") from e
    finally:
        sock.close()
    name, sep, echoed = data.partition(b"\n")
    if resp.status != 200 or not sep or echoed != body:
        raise ExchangeError(f"HTTP {addr}:{port}: bad reply {resp.status} {data[:60]!r}")
    return name.decode()


def udp_exchange(
    ns: str,
    addr: str,
    port: int,
    payload: bytes,
    *,
    src_port: int | None = None,
    timeout: float = 2.0,
    tries: int = 3,
) -> str:
    """One datagram and its echo; the backend's name. Retries a lost datagram.

    The socket is connected, so a reply from any address but the VIP is not taken:
    direct server return must answer from the VIP."""
    sock = open_socket(ns, addr, socket.SOCK_DGRAM, src_port)
    try:
        sock.settimeout(timeout / tries)
        sock.connect((addr, port))
        for _ in range(tries):
            sock.send(payload)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            name, sep, echoed = data.partition(b"\n")
            if not sep or echoed != payload:
                raise ExchangeError(f"UDP {addr}:{port}: bad reply {data[:60]!r}")
            return name.decode()
    finally:
        sock.close()
    raise ExchangeError(f"UDP {addr}:{port} from port {src_port}: no reply")


@dataclass
class EchoStream:
    """A long-lived TCP connection to the echo service, verifying every byte."""

    sock: socket.socket
    backend: str
    sent: int = 0

    @classmethod
    def open(
        cls,
        ns: str,
        addr: str,
        port: int = 7,
        *,
        src_port: int | None = None,
        timeout: float = 5.0,
    ) -> EchoStream:
        sock = open_socket(ns, addr, socket.SOCK_STREAM, src_port)
        sock.settimeout(timeout)
        try:
            sock.connect((addr, port))
            greeting = b""
            while not greeting.endswith(b"\n"):
                chunk = sock.recv(1)
                if not chunk:
                    raise ExchangeError(f"echo {addr}:{port}: closed before greeting")
                greeting += chunk
        except OSError as e:
            sock.close()
            raise ExchangeError(f"echo {addr}:{port} from port {src_port}: {e}") from e
        return cls(sock, greeting.decode().strip())

    def exchange(self, size: int = 4096) -> None:
        """Send ``size`` random bytes and read exactly them back."""
        data = os.urandom(size)
        try:
            self.sock.sendall(data)
            got = bytearray()
            while len(got) < size:
                chunk = self.sock.recv(size - len(got))
                if not chunk:
                    raise ExchangeError(f"echo via {self.backend}: closed after {self.sent} B")
                got += chunk
        except OSError as e:
            raise ExchangeError(f"echo via {self.backend}: {e} after {self.sent} B") from e
        if bytes(got) != data:
            raise ExchangeError(f"echo via {self.backend}: corrupted bytes after {self.sent} B")
        self.sent += size

    def close(self) -> None:
        self.sock.close()
