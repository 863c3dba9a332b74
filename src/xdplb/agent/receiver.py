"""The controller's end of the agents' reports: a UDP socket whose poll never blocks.

Each datagram is decoded as untrusted (:func:`~xdplb.agent.wire.decode_report`), stamped
with the receiver's clock, and dropped when it is a duplicate or arrived out of order.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from xdplb.agent.wire import MAX_DATAGRAM, decode_report
from xdplb.core.closing import Closing
from xdplb.core.reports import LoadReport

log = logging.getLogger("xdplb.agent")  # the agent's one logger, whichever module logs

#: A report whose seq is at most this far behind the last one of its backend arrived out
#: of order (or twice) and is dropped; further behind is an agent that started over.
REORDER_WINDOW = 64


@dataclass(slots=True)
class ReceiverStats:
    """What the receiver did with the datagrams it read."""

    received: int = 0
    """Reports accepted."""
    malformed: int = 0
    """Datagrams dropped by :func:`decode_report`."""
    reordered: int = 0
    """Reports dropped as duplicates or older than one already accepted."""


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


class ReportReceiver(Closing):
    """The controller's end: a UDP socket whose :meth:`poll` never blocks."""

    def __init__(
        self,
        bind: tuple[str, int],
        *,
        clock: Callable[[], float] = time.monotonic,
        max_batch: int = 4096,
    ) -> None:
        self._clock = clock
        self._max_batch = max_batch
        self._last_seq: dict[str, int] = {}
        self.stats = ReceiverStats()
        self._sock = socket.socket(_family(bind[0]), socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            self._sock.bind(bind)
        except OSError:
            self._sock.close()
            raise

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def fileno(self) -> int:
        """For select()/poll() by the caller's event loop."""
        return self._sock.fileno()

    def poll(self) -> list[LoadReport]:
        """The reports waiting on the socket (at most ``max_batch``), stamped with the clock."""
        out: list[LoadReport] = []
        while len(out) < self._max_batch:
            try:
                data, source = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except (BlockingIOError, InterruptedError):
                break
            now = self._clock()
            try:
                wire = decode_report(data)
            except ValueError as e:
                self.stats.malformed += 1
                log.debug("malformed report from %s: %s", source[0], e)
                continue
            last = self._last_seq.get(wire.backend)
            if last is not None and 0 <= last - wire.seq < REORDER_WINDOW:
                self.stats.reordered += 1
                continue
            self._last_seq[wire.backend] = wire.seq
            self.stats.received += 1
            out.append(wire.received(now))
        return out

    def close(self) -> None:
        self._sock.close()
