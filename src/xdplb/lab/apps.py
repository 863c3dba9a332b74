"""The lab's backend applications: real servers that say who they are.

One process per backend runs, on every address of its namespace (VIPs on loopback
included), dual-stack:
- HTTP on ``--http`` (default 80): ``GET`` answers ``<name>\\n``; ``POST`` answers
  ``<name>\\n`` followed by the request body, so a client can verify the bytes;
- a TCP echo on ``--echo`` (default 7): sends ``<name>\\n`` on accept, then echoes every
  byte until the client closes — long-lived streaming connections;
- a UDP echo on each ``--udp`` port (default 53): answers ``<name>\\n`` + the datagram.

Run as ``python -m xdplb.lab.apps --name b1`` inside a backend namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

#: <linux/in.h>; Python's socket module has it only from 3.12.
IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)


class _DualStack:
    """Listen on [::] with IPV6_V6ONLY off, so IPv4 and IPv6 VIPs share one socket."""

    allow_reuse_address = True
    daemon_threads = True
    # Tests open connections 16 at a time on a loaded 2-core machine: socketserver's
    # default accept queue of 5 would turn bursts into SYN retransmissions.
    request_queue_size = 128

    def server_bind(self) -> None:
        sock: socket.socket = self.socket  # type: ignore[attr-defined]
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()  # type: ignore[misc]


class HttpServer(_DualStack, ThreadingHTTPServer):
    address_family = socket.AF_INET6
    name = ""


class EchoServer(_DualStack, socketserver.ThreadingTCPServer):
    address_family = socket.AF_INET6
    name = ""


class _Http(BaseHTTPRequestHandler):
    server: HttpServer
    protocol_version = "HTTP/1.1"

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Backend", self.server.name)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._reply(f"{self.server.name}\n".encode())

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        self._reply(f"{self.server.name}\n".encode() + self.rfile.read(n))

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Echo(socketserver.BaseRequestHandler):
    server: EchoServer

    def handle(self) -> None:
        conn: socket.socket = self.request
        conn.sendall(f"{self.server.name}\n".encode())
        # A client that closes with bytes still in flight resets the connection: its
        # end, not an error (socketserver would print a traceback per stream).
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            while data := conn.recv(65536):
                conn.sendall(data)


def _udp_echo(name: str, family: socket.AddressFamily, port: int, stop: threading.Event) -> None:
    """Answer from the address the datagram was sent to (the VIP), as a client's connected
    socket requires: a wildcard socket would otherwise pick the source by route."""
    sock = socket.socket(family, socket.SOCK_DGRAM)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        level, kind = socket.IPPROTO_IPV6, socket.IPV6_PKTINFO
    else:
        sock.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        level, kind = socket.IPPROTO_IP, IP_PKTINFO
    sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    sock.settimeout(0.2)
    prefix = f"{name}\n".encode()
    while not stop.is_set():
        try:
            data, anc, _flags, peer = sock.recvmsg(65536, 256)
        except TimeoutError:
            continue
        info = next((d for lvl, t, d in anc if (lvl, t) == (level, kind)), None)
        if info is not None and family == socket.AF_INET:
            # struct in_pktinfo {ifindex; spec_dst; addr}: the request's addr becomes the
            # reply's spec_dst (its source), any interface.
            info = bytes(4) + info[8:12] + bytes(4)
        elif info is not None:
            # struct in6_pktinfo {addr; ifindex}: send from addr, any interface.
            info = info[:16] + bytes(4)
        sock.sendmsg([prefix + data], [(level, kind, info)] if info else [], 0, peer)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--name", required=True)
    ap.add_argument("--http", type=int, default=80)
    ap.add_argument("--echo", type=int, default=7)
    ap.add_argument("--udp", type=int, nargs="+", default=[53], help="UDP echo ports")
    args = ap.parse_args(argv)

    http = HttpServer(("::", args.http), _Http)
    echo = EchoServer(("::", args.echo), _Echo)
    http.name = echo.name = args.name
    stop = threading.Event()
    threads = [
        threading.Thread(target=http.serve_forever, daemon=True),
        threading.Thread(target=echo.serve_forever, daemon=True),
    ]
    threads += [
        threading.Thread(target=_udp_echo, args=(args.name, family, port, stop), daemon=True)
        for port in args.udp
        for family in (socket.AF_INET, socket.AF_INET6)
    ]
    for t in threads:
        t.start()

    def _exit(_sig: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _exit)
    signal.signal(signal.SIGINT, _exit)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    stop.wait()
    http.shutdown()
    echo.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
