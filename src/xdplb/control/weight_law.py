"""Load-aware weights, as Bilibili's Nickel does them: backends report their load, the
controller moves their weights toward equal load. Off unless configured.

Sans-I/O (like the planner): reports and the clock go in, weights come out; nothing here
reads a socket or a clock. :mod:`xdplb.agent` produces the reports and receives them.

Control law, once per ``min_interval`` at most::

    cost_i  = EWMA over reports of cpu_i / share_i     (share_i = w_i / sum w, in force)
    load_i  = cost_i * share_i                         (the smoothed cpu at today's weights)
    f_i     = clip((mean_load / load_i) ** gain, 1 / max_step, max_step)   (1 in the deadband)
    w_i    <- w_i * f_i, rescaled so the total stays put, clamped to bounds, rounded

What is smoothed, and why: the cpu normalised by the backend's weight share, i.e. cpu per
unit of traffic share. That is a property of the machine, not of its weight, so the
smoothing runs across weight changes without putting a delay in the loop (smoothing the
raw cpu would: after a change the average still remembers the old weights, the loop acts
on stale feedback and rings). The load judged is that cost times the share in force: the
smoothed cpu the backend has at its current weight. The weight share and not the measured
rps share: rps counts new TCP connections, which differ in cost and are noisy at low
rates, while the weight share is exact and is what the table hands out (Maglev within
1%); a backend whose real share differs still shows it in its cpu. A change of total
traffic scales every cost alike, which relative weights ignore.

Why it converges: with cpu_i proportional to w_i / capacity_i (traffic follows the
weights), in log space the law is ``d_i <- (1 - gain) * d_i`` for the deviation d_i of
log w_i from its equilibrium log(capacity_i) + const (the rescaling and the choice of mean
only add a term common to every backend, which relative weights ignore). With
0 < gain <= 1 that is a contraction with a non-negative factor: deviations shrink
geometrically and never change sign, so there is no overshoot. What would break it is
handled explicitly:

- reports of mixed weights: a report describes the interval before it, so one received
  just after a change measured partly the old weights; reports received less than
  ``settle`` seconds after a change are ignored;
- noise: the EWMA averages reports (across changes, see above), a backend needs
  ``min_reports`` before it counts, and the ``deadband`` keeps a backend still while its
  load is within that relative distance of the mean, so noise around the equilibrium
  moves nothing instead of making weights jitter.

Backends with a weight of 0 in force get no traffic and tell nothing about their cost:
they are not judged (a base weight of 0 is a drain by the operator and stays 0). A backend
with no fresh report (none within ``max_age``) keeps its weight and does not count toward
the mean; when it reports again its average starts afresh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from xdplb.core.reports import LoadReport, finite

#: Weights are __u16-sized in the configuration (``BackendConfig.weight``).
MAX_WEIGHT = 65535
#: Floor for a measured load: an idle backend would otherwise ask for an infinite factor
#: (``max_step`` bounds it anyway; this keeps the arithmetic finite).
_MIN_LOAD = 1e-3


@dataclass(frozen=True, slots=True)
class Bounds:
    """The range the controller may move one backend's weight within."""

    min_weight: int = 1
    """Lowest weight; above 0 keeps a slow backend in the table (and reporting load)."""
    max_weight: int = MAX_WEIGHT
    """Highest weight."""

    def check(self, where: str) -> None:
        for name in ("min_weight", "max_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_WEIGHT:
                raise ValueError(
                    f"{where}.{name}: must be an integer in 0..{MAX_WEIGHT}, got {v!r}"
                )
        if self.min_weight > self.max_weight:
            raise ValueError(
                f"{where}.min_weight: {self.min_weight} is above max_weight {self.max_weight}"
            )


@dataclass(frozen=True, slots=True)
class FeedbackConfig:
    """How the controller moves weights. Every error names the field at fault."""

    bounds: Mapping[str, Bounds] = field(default_factory=dict)
    """Per-backend bounds, by backend identity."""
    default_bounds: Bounds = Bounds()
    """Bounds of backends not in ``bounds``."""
    gain: float = 0.5
    """Fraction of the (log) distance to equal load covered per change, 0 < gain <= 1."""
    deadband: float = 0.05
    """A backend whose load is within this relative distance of the mean does not move."""
    smoothing: float = 0.2
    """EWMA alpha for reports: weight of the newest report, 0 < smoothing <= 1."""
    min_reports: int = 3
    """Reports a backend's average must rest on before the backend is judged."""
    max_step: float = 2.0
    """Largest factor one change may move a weight by, either way (small steps, as Beamer
    asks, and a bound on what a wild report can do)."""
    min_interval: float = 60.0
    """Seconds between two weight changes: at least the lookup table's own minimum
    interval between changes (60 s by default for Beamer tables), so the controller never
    moves faster than the table may. Whoever wires the two passes the table's value."""
    settle: float = 1.5
    """Reports received less than this many seconds after a change are ignored: they
    describe the old weights. At least the agent's interval plus the time to apply."""
    max_age: float = 5.0
    """Reports older than this are ignored; a backend with none fresh keeps its weight."""
    total_weight: int | None = None
    """Total of the weights handed out; None keeps the base weights' total. Weights are
    relative, so raise it when base weights are small (1:1 has no room to move)."""

    def __post_init__(self) -> None:
        # A copy: the config is frozen, a caller's dict is not.
        object.__setattr__(self, "bounds", MappingProxyType(dict(self.bounds)))
        for name, b in self.bounds.items():
            if not isinstance(b, Bounds):
                raise ValueError(f"bounds[{name!r}]: must be a Bounds, got {b!r}")
            b.check(f"bounds[{name!r}]")
        if not isinstance(self.default_bounds, Bounds):
            raise ValueError(f"default_bounds: must be a Bounds, got {self.default_bounds!r}")
        self.default_bounds.check("default_bounds")
        if not 0.0 < finite("gain", self.gain) <= 1.0:
            raise ValueError(f"gain: must be in (0, 1], got {self.gain!r}")
        if not 0.0 <= finite("deadband", self.deadband) < 1.0:
            raise ValueError(f"deadband: must be in [0, 1), got {self.deadband!r}")
        if not 0.0 < finite("smoothing", self.smoothing) <= 1.0:
            raise ValueError(f"smoothing: must be in (0, 1], got {self.smoothing!r}")
        m = self.min_reports
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"min_reports: must be a positive integer, got {m!r}")
        if not finite("max_step", self.max_step) > 1.0:
            raise ValueError(f"max_step: must be > 1, got {self.max_step!r}")
        if not finite("min_interval", self.min_interval) > 0.0:
            raise ValueError(f"min_interval: must be > 0, got {self.min_interval!r}")
        if not 0.0 <= finite("settle", self.settle) < self.min_interval:
            raise ValueError(
                f"settle: must be in [0, min_interval={self.min_interval}), got {self.settle!r}"
            )
        if not finite("max_age", self.max_age) > 0.0:
            raise ValueError(f"max_age: must be > 0, got {self.max_age!r}")
        t = self.total_weight
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t <= 0):
            raise ValueError(f"total_weight: must be a positive integer or None, got {t!r}")

    def bounds_of(self, backend: str) -> Bounds:
        return self.bounds.get(backend, self.default_bounds)


@dataclass(slots=True)
class _Smoothed:
    cost: float
    """EWMA of cpu / weight share: cpu per unit of traffic share."""
    at: float
    """Receipt time of the newest report folded in."""
    reports: int


class LoadController:
    """Weights toward equal load: :meth:`observe` reports, :meth:`update` with the clock."""

    def __init__(self, config: FeedbackConfig, base_weights: Mapping[str, int]) -> None:
        if not base_weights:
            raise ValueError("base_weights: at least one backend is needed")
        for name, w in base_weights.items():
            if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_WEIGHT:
                raise ValueError(
                    f"base_weights[{name!r}]: must be an integer in 0..{MAX_WEIGHT}, got {w!r}"
                )
        self.config = config
        base_total = sum(base_weights.values())
        scale = 1.0
        if config.total_weight is not None and base_total > 0:
            scale = config.total_weight / base_total
        # Unrounded weights: rounding errors do not accumulate over changes.
        self._exact = {
            n: self._clamp(n, w * scale) if w > 0 else 0.0 for n, w in base_weights.items()
        }
        self._weights = _round(self._exact, self.config)
        self._loads: dict[str, _Smoothed] = {}
        self._last_change: float | None = None
        self.ignored_reports = 0
        """Reports dropped by :meth:`observe`: unknown backend, weight 0 in force, or
        received within ``settle`` of a change."""

    @property
    def weights(self) -> dict[str, int]:
        """The weights as of the last change (or the start, base weights scaled)."""
        return dict(self._weights)

    @property
    def last_change(self) -> float | None:
        return self._last_change

    def observe(self, report: LoadReport) -> None:
        """Fold a report into the backend's smoothed cost."""
        cfg = self.config
        weight = self._weights.get(report.backend, 0)
        if weight == 0:
            self.ignored_reports += 1  # unknown, or no traffic to measure a cost by
            return
        if self._last_change is not None and report.at < self._last_change + cfg.settle:
            self.ignored_reports += 1  # it measured (partly) the weights before the change
            return
        cost = report.cpu * sum(self._weights.values()) / weight
        s = self._loads.get(report.backend)
        if s is None or report.at - s.at > cfg.max_age:
            self._loads[report.backend] = _Smoothed(cost, report.at, 1)
            return
        s.cost = cfg.smoothing * cost + (1.0 - cfg.smoothing) * s.cost
        s.at = max(s.at, report.at)
        s.reports += 1

    def update(self, now: float) -> dict[str, int] | None:
        """The new weights of every backend, or None: too soon, or nothing to change.

        The caller applies returned weights at once: reports received from ``now + settle``
        on are read as measuring them.
        """
        cfg = self.config
        if self._last_change is not None and now - self._last_change < cfg.min_interval:
            return None
        total = sum(self._weights.values())
        loads = {
            n: max(s.cost * self._weights[n] / total, _MIN_LOAD)
            for n, s in self._loads.items()
            if self._weights[n] > 0 and now - s.at <= cfg.max_age and s.reports >= cfg.min_reports
        }
        if len(loads) < 2:
            return None  # one backend alone has nothing to balance against
        mean = sum(loads.values()) / len(loads)
        raw: dict[str, float] = {}
        for n, load in loads.items():
            f = 1.0
            if abs(load / mean - 1.0) >= cfg.deadband:
                f = min(max((mean / load) ** cfg.gain, 1.0 / cfg.max_step), cfg.max_step)
            raw[n] = self._exact[n] * f
        if all(raw[n] == self._exact[n] for n in raw):
            return None
        # Only relative weights matter: keep the participants' total where it was.
        k = sum(self._exact[n] for n in raw) / sum(raw.values())
        exact = dict(self._exact)
        for n, w in raw.items():
            exact[n] = self._clamp(n, w * k)
        weights = _round(exact, cfg)
        if weights == self._weights:
            return None  # below integer resolution: the table would not change
        self._exact, self._weights = exact, weights
        self._last_change = now
        return dict(weights)

    def _clamp(self, name: str, w: float) -> float:
        b = self.config.bounds_of(name)
        return min(max(w, float(b.min_weight)), float(b.max_weight))


def _round(exact: Mapping[str, float], cfg: FeedbackConfig) -> dict[str, int]:
    """Integers within bounds whose total is the rounded exact total (largest remainder)."""
    floors = {n: math.floor(w) for n, w in exact.items()}
    spare = round(sum(exact.values())) - sum(floors.values())
    # Ties go by name: equal exact weights round the same way on every LB node.
    order = sorted(exact, key=lambda n: (-(exact[n] - floors[n]), n))
    out = dict(floors)
    for n in order:
        if spare <= 0:
            break
        if exact[n] > floors[n] and out[n] < cfg.bounds_of(n).max_weight:
            out[n] += 1
            spare -= 1
    return out
