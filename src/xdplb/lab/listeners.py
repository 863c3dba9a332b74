"""Servers of a test's own on every backend: a listener on ``[::]:port`` (both
families) in each backend's namespace, served by a thread of the test's process, so a
test can see what a backend received and answer exactly as it needs (a sink that hashes
an upload, a source that streams a payload). :mod:`xdplb.lab.apps` is the lab's
general-purpose server process; this is for byte-exact experiments in one test."""

from __future__ import annotations

import contextlib
import socket
import threading

from xdplb.core.closing import Closing
from xdplb.lab.topology import Lab


class BackendListeners(Closing):
    """``handle(name, conn, peer)`` runs for every connection a backend accepts, in
    that backend's thread; :meth:`close` (or leaving the ``with``) stops them all."""

    def __init__(self, lab: Lab, port: int, names: list[str] | None = None) -> None:
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []
        for name in lab.backends if names is None else names:
            with lab.enter(name):
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("::", port))
            sock.listen(8)
            sock.settimeout(0.2)
            self.socks.append(sock)
            t = threading.Thread(target=self._serve, args=(name, sock), daemon=True)
            t.start()
            self.threads.append(t)

    def handle(self, name: str, conn: socket.socket, peer: tuple[str, int]) -> None:
        raise NotImplementedError

    def _serve(self, name: str, sock: socket.socket) -> None:
        while not self.stop.is_set():
            try:
                conn, peer = sock.accept()
            except TimeoutError:
                continue
            # A client that gave up (reset) ends its connection, not the server.
            with conn, contextlib.suppress(OSError):
                conn.settimeout(15)
                self.handle(name, conn, peer)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        for s in self.socks:
            s.close()
