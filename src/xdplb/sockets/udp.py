"""The plain SO_REUSEPORT UDP helper: one socket per worker, no dispatcher.

A UDP server that reads one socket from many threads, or one thread that hands
datagrams to workers, serialises on that socket (its lock, its queue, the dispatcher's
core). With SO_REUSEPORT each worker has its own socket on the same address and port,
and the kernel picks the socket for each datagram by a hash of its 4-tuple: the same
flow always lands on the same socket, as long as the group's membership does not change
(a socket added or closed re-spreads the flows; keeping flows in place across a change
is what :mod:`xdplb.sockets.reuseport` adds with BPF).

::

    socks = udp_group("::", 4433, 4)
    with UdpWorkers(socks, lambda data, peer, i: data):   # an echo, one thread per socket
        ...
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import selectors
import socket
import threading
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

#: The largest datagram a worker reads.
MAX_DATAGRAM = 65535
#: Datagrams a worker answers between two looks at its stop pipe.
BATCH = 64

#: ``handle(data, peer, index)`` -> the reply to send back from the same socket, or None.
#: ``index`` is the position of the socket in the group.
Handler = Callable[[bytes, Any, int], bytes | None]


def family_of(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal (``::``, ``::1``), AF_INET otherwise."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def udp_group(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` UDP sockets bound to ``host:port`` with SO_REUSEPORT (one reuseport group).

    ``port`` 0 takes an ephemeral port for the first socket, and the others join it.
    The sockets are not inheritable (Python's default); the caller owns and closes them.
    """
    if n < 1:
        raise ValueError(f"a group needs at least one socket, not {n}")
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family_of(host), socket.SOCK_DGRAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
            port = s.getsockname()[1]
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


class UdpWorkers:
    """One worker per socket, each reading only its own socket and answering from it.

    Threads (the default) share one interpreter lock, so they show the pattern (no
    shared queue, no dispatcher) rather than scale the handler; ``processes=True`` forks
    one process per socket instead, which uses every core. Stopping wakes each worker
    through a pipe: a socket closed under a blocked recvfrom() would not wake it.
    """

    def __init__(
        self, socks: Sequence[socket.socket], handle: Handler, *, processes: bool = False
    ) -> None:
        self._socks = list(socks)
        self._handle = handle
        self._wake_r, self._wake_w = os.pipe()
        self._stopped = False
        self._workers: list[threading.Thread | BaseProcess] = []
        for i, s in enumerate(self._socks):
            if processes:
                # fork: the child has the sockets and the handler without pickling.
                ctx = multiprocessing.get_context("fork")
                self._workers.append(ctx.Process(target=self._run, args=(i, s), daemon=True))
            else:
                self._workers.append(
                    threading.Thread(target=self._run, args=(i, s), name=f"udp-{i}", daemon=True)
                )
        self.errors: list[BaseException] = []
        """Exceptions a handler raised in a worker thread (the worker goes on with the
        next datagram); a worker process logs them instead."""

    def start(self) -> UdpWorkers:
        for w in self._workers:
            w.start()
        return self

    def _run(self, index: int, sock: socket.socket) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while True:
                if any(key.fileobj == self._wake_r for key, _ in sel.select()):
                    return
                # A batch, without blocking: another reader of the same socket (a
                # takeover's other process) may have taken what was queued; and the wake
                # pipe is looked at between two batches even under a steady flood.
                for _ in range(BATCH):
                    try:
                        data, peer = sock.recvfrom(MAX_DATAGRAM, socket.MSG_DONTWAIT)
                    except (BlockingIOError, InterruptedError):
                        break
                    try:
                        reply = self._handle(data, peer, index)
                        if reply is not None:
                            sock.sendto(reply, peer)
                    except Exception as exc:  # a bad datagram must not stop the worker
                        self.errors.append(exc)
                        log.warning("udp worker %d: %r", index, exc)

    def stop(self) -> None:
        """Stop every worker and wait for it; the sockets stay open (the caller's). A
        batch being answered is answered; nothing more is read."""
        if self._stopped:
            return
        self._stopped = True
        os.write(self._wake_w, b"x")
        for w in self._workers:
            if w.ident is not None:  # started
                w.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> UdpWorkers:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
