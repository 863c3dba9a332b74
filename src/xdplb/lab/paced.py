"""Paced long-lived connections: a steady, known load whose every byte is checked.

:class:`PacedStreams` holds ``n`` connections to the lab's echo service; every
``period`` seconds each sends ``size`` random bytes and reads them back. The load is
fixed by the pacing, not by how fast the path is, so its throughput (bytes echoed
back intact per second) only falls when the path loses or delays packets: a stream
whose previous exchange is still outstanding at its next tick skips that tick. That
makes it a measure of a path under stress (a flood, churn) rather than of the CPU.

One thread and one selector serve every stream (non-blocking sockets), so a hundred
streams cost a few percent of a core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import selectors
import threading
import time
from collections.abc import Callable, Iterable

from xdplb.core.closing import Closing
from xdplb.lab.traffic import EchoStream, ExchangeError
from xdplb.lab.wait import WaitTimeout, wait_for


@dataclasses.dataclass(frozen=True)
class PacedTotals:
    """Counts since the streams started, at one instant (subtract two for a window)."""

    #: time.monotonic() when taken.
    at: float
    #: Bytes echoed back intact, summed over streams.
    bytes: int
    #: Exchanges completed.
    exchanges: int
    #: Ticks skipped because the stream's previous exchange was still outstanding.
    missed: int
    #: Streams broken so far (closed, reset, corrupted bytes).
    broken: int

    def rate(self, since: PacedTotals) -> float:
        """Bytes per second between ``since`` and this."""
        return (self.bytes - since.bytes) / (self.at - since.at)


@dataclasses.dataclass
class _Stream:
    es: EchoStream
    next_tick: float
    #: The bytes of the outstanding exchange (b"" when idle) and how many came back.
    expect: bytes = b""
    got: int = 0
    unsent: bytes = b""
    started: float = 0.0
    broken: str = ""


@dataclasses.dataclass
class BrokenStream:
    """A stream that broke: which backend it was on, when, and why."""

    backend: str
    at: float
    reason: str
    #: Index of the stream in :attr:`PacedStreams.streams`.
    index: int


#: How long a stream may take to move on after its path changed (TCP retransmits with
#: backoff: a few hundred ms of loss costs a second or two), or to break.
RESUME_WAIT = 30.0


class PacedStreams(Closing):
    """``n`` echo connections from namespace ``ns`` to ``addr``:``port``, each
    exchanging ``size`` bytes every ``period`` seconds, staggered over the period.

    A connection that fails to open raises ExchangeError, or with ``strict=False`` is
    left out and recorded in :attr:`failed_connects`."""

    def __init__(
        self,
        ns: str,
        addr: str,
        port: int = 7,
        *,
        n: int = 100,
        size: int = 1024,
        period: float = 0.1,
        connect_timeout: float = 5.0,
        on_break: Callable[[BrokenStream], None] | None = None,
        strict: bool = True,
    ) -> None:
        self.size = size
        self.period = period
        self.on_break = on_break
        self.broken: list[BrokenStream] = []
        #: Longest time an exchange took, in seconds.
        self.max_latency = 0.0
        self._bytes = self._exchanges = self._missed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name="paced-streams", daemon=True)
        #: Connections that failed to open (``strict=False``), as error messages.
        self.failed_connects: list[str] = []
        now = time.monotonic()
        self.streams: list[_Stream] = []
        try:
            for i in range(n):
                try:
                    es = EchoStream.open(ns, addr, port, timeout=connect_timeout)
                except ExchangeError as e:
                    if strict:
                        raise
                    self.failed_connects.append(str(e))
                    continue
                es.sock.setblocking(False)
                self.streams.append(_Stream(es, now + period * (i + 1) / n))
        except BaseException:
            self.close()
            raise

    @property
    def backends(self) -> list[str]:
        """The backend of each stream, in order."""
        return [s.es.backend for s in self.streams]

    @property
    def ports(self) -> list[int]:
        """The client's source port of each stream, in order (its flow, with the
        destination)."""
        return [int(s.es.sock.getsockname()[1]) for s in self.streams]

    def verified(self) -> list[int]:
        """Bytes echoed back intact so far, per stream: a stream that neither broke nor
        moved on since an earlier reading is stalled."""
        return [s.es.sent for s in self.streams]

    def wait_resumed(self, since: list[int], timeout: float = RESUME_WAIT) -> list[int]:
        """Wait until every stream that did not break has verified bytes beyond ``since``
        (:meth:`verified` earlier); the streams still stalled at the deadline (empty:
        none)."""

        def stalled() -> list[int]:
            broken = {b.index for b in self.broken}
            now = self.verified()
            return [
                i
                for i, (a, b) in enumerate(zip(since, now, strict=True))
                if b <= a and i not in broken
            ]

        try:
            return wait_for(
                stalled, "every stream moving on", until=lambda s: not s, timeout=timeout
            )
        except WaitTimeout:
            return stalled()

    def why_broken(self, stalled: Iterable[int] = ()) -> dict[int, str]:
        """Stream index -> why it broke (its backend and reason, or ``stalled``), for the
        streams that broke so far and those ``stalled``."""
        out = {b.index: f"{b.backend}: {b.reason}" for b in self.broken}
        out.update({i: "stalled" for i in stalled if i not in out})
        return out

    def totals(self) -> PacedTotals:
        with self._lock:
            return PacedTotals(
                time.monotonic(), self._bytes, self._exchanges, self._missed, len(self.broken)
            )

    @property
    def nominal_rate(self) -> float:
        """Bytes per second if no tick is ever skipped."""
        return len(self.streams) * self.size / self.period

    # -- the loop ---------------------------------------------------------------------

    def _break(self, i: int, s: _Stream, reason: str) -> None:
        s.broken = reason
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(s.es.sock)
        b = BrokenStream(s.es.backend, time.monotonic(), reason, i)
        with self._lock:
            self.broken.append(b)
        if self.on_break is not None:
            self.on_break(b)

    def _send(self, i: int, s: _Stream) -> None:
        try:
            n = s.es.sock.send(s.unsent)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._break(i, s, f"send: {e}")
            return
        s.unsent = s.unsent[n:]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if s.unsent else 0)
        self._sel.modify(s.es.sock, events, i)

    def _recv(self, i: int, s: _Stream) -> None:
        try:
            data = s.es.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as e:
            self._break(i, s, f"recv: {e} after {s.es.sent} B")
            return
        if not data:
            self._break(i, s, f"closed by the peer after {s.es.sent} B")
            return
        if not s.expect or data != s.expect[s.got : s.got + len(data)]:
            self._break(i, s, f"corrupted or unexpected bytes after {s.es.sent + s.got} B")
            return
        s.got += len(data)
        if s.got == len(s.expect):
            took = time.monotonic() - s.started
            s.es.sent += s.got
            with self._lock:
                self._bytes += s.got
                self._exchanges += 1
                self.max_latency = max(self.max_latency, took)
            s.expect, s.got = b"", 0

    def _tick(self, i: int, s: _Stream, now: float) -> None:
        while s.next_tick <= now:
            s.next_tick += self.period
        if s.expect:
            with self._lock:
                self._missed += 1
            return
        s.expect = s.unsent = os.urandom(self.size)
        s.got, s.started = 0, now
        self._send(i, s)

    def _run(self) -> None:
        for i, s in enumerate(self.streams):
            self._sel.register(s.es.sock, selectors.EVENT_READ, i)
        while not self._stop.is_set():
            live = [(i, s) for i, s in enumerate(self.streams) if not s.broken]
            if not live:
                self._stop.wait(0.05)
                continue
            wait = min(s.next_tick for _, s in live) - time.monotonic()
            for key, events in self._sel.select(max(0.0, min(wait, 0.05))):
                i = key.data
                s = self.streams[i]
                if s.broken:
                    continue
                if events & selectors.EVENT_WRITE and s.unsent:
                    self._send(i, s)
                if events & selectors.EVENT_READ and not s.broken:
                    self._recv(i, s)
            now = time.monotonic()
            for i, s in live:
                if not s.broken and s.next_tick <= now:
                    self._tick(i, s, now)

    # -- lifetime ---------------------------------------------------------------------

    def start(self) -> PacedStreams:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop (an exchange still outstanding is neither counted nor broken)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def close(self) -> None:
        self.stop()
        for s in self.streams:
            s.es.close()
        self._sel.close()

    def __enter__(self) -> PacedStreams:
        return self.start()


def one_shot(ns: str, addr: str, port: int = 7, size: int = 1024, timeout: float = 5.0) -> str:
    """A new connection: connect, one verified exchange, close. The backend's name;
    ExchangeError if any step fails."""
    es = EchoStream.open(ns, addr, port, timeout=timeout)
    try:
        es.exchange(size)
        return es.backend
    finally:
        es.close()
