"""The last minute of per-VIP and per-backend rates (``GET /api/v1/history``, the status
page's sparklines). :class:`History` owns the samples: the daemon's loop feeds it a
``(time, Traffic)`` pair about once a second (:meth:`History.due`, :meth:`History.add`),
it keeps the last ``length`` intervals' counters and answers the rate of every interval
(:meth:`History.view`). Pure: no clock, no I/O, no bpf; an interval in which a counter
went back (a backend re-added under a new id, pins recreated, a wrap) has no rate, and a
clock that went back (another daemon's samples) starts the history afresh.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from xdplb.control.status import Counts, Traffic

#: Seconds between two samples the daemon aims at.
INTERVAL = 1.0
#: Intervals kept: one minute at one a second.
LENGTH = 60


class Series(BaseModel):
    """Per-second rates of one VIP or backend, one value per interval of
    :attr:`HistoryView.times`; None where it has none (not in that sample, or a counter
    went back)."""

    model_config = ConfigDict(frozen=True)

    packets: list[float | None]
    bytes: list[float | None]
    new_flows: list[float | None]


class HistoryView(BaseModel):
    """The rates of the last intervals, oldest first."""

    model_config = ConfigDict(frozen=True)

    interval: float
    """Seconds between two samples the daemon aims at (each rate uses the real gap)."""
    length: int
    """Intervals the daemon keeps."""
    times: list[float]
    """The end of each interval, in seconds on the daemon's monotonic clock (only
    differences mean anything; pass the last one as ``since`` to get what is newer)."""
    vips: dict[str, Series]
    """By VIP name (``198.18.100.1:80/tcp``)."""
    backends: dict[str, Series]
    """By backend address: the data path counts per backend, over all its VIPs."""


@dataclass(frozen=True)
class _Sample:
    t: float
    vips: dict[str, Counts]
    backends: dict[str, Counts]


def _rates(old: Counts | None, new: Counts | None, dt: float) -> list[float | None]:
    """Per second over ``dt``; None each if missing at one end or a counter went back."""
    if old is None or new is None or any(n < o for o, n in zip(old, new, strict=True)):
        return [None, None, None]
    return [(n - o) / dt for o, n in zip(old, new, strict=True)]


class History:
    """The last ``length`` intervals of counters of one daemon."""

    def __init__(self, interval: float = INTERVAL, length: int = LENGTH) -> None:
        if interval <= 0 or length < 1:
            raise ValueError(f"interval {interval} and length {length} must be positive")
        self.interval = interval
        self.length = length
        # length intervals need length + 1 samples.
        self._samples: deque[_Sample] = deque(maxlen=length + 1)

    def __len__(self) -> int:
        """Intervals held (samples - 1)."""
        return max(0, len(self._samples) - 1)

    def due(self, now: float) -> bool:
        """Whether a sample taken at ``now`` is due (the first one always is)."""
        return not self._samples or now - self._samples[-1].t >= self.interval

    def add(self, t: float, traffic: Traffic) -> None:
        """The counters of ``traffic``, taken at time ``t`` (seconds, any monotonic clock)."""
        if self._samples and t <= self._samples[-1].t:
            self._samples.clear()  # a clock that went back: another daemon's samples
        self._samples.append(_Sample(t, traffic.vips, traffic.backends))

    def view(self, since: float | None = None) -> HistoryView:
        """The rate of every interval that ends after ``since`` (None: all held)."""
        pairs = [
            (a, b) for a, b in itertools.pairwise(self._samples) if since is None or b.t > since
        ]

        def series(key: str, of: str) -> Series:
            rates = [
                _rates(getattr(a, of).get(key), getattr(b, of).get(key), b.t - a.t)
                for a, b in pairs
            ]
            packets, nbytes, new_flows = (list(col) for col in zip(*rates, strict=True))
            return Series(packets=packets, bytes=nbytes, new_flows=new_flows)

        def keys(of: str) -> list[str]:
            # Every key of the newest samples, in the order the status lists them.
            seen: dict[str, None] = {}
            for _, b in pairs:
                seen.update(dict.fromkeys(getattr(b, of)))
            return list(seen)

        return HistoryView(
            interval=self.interval,
            length=self.length,
            times=[b.t for _, b in pairs],
            vips={k: series(k, "vips") for k in keys("vips")},
            backends={k: series(k, "backends") for k in keys("backends")},
        )
