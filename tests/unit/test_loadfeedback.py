"""The load feedback controller against a simulated fleet: traffic follows the weights,
cpu = traffic share / capacity, reports carry gaussian noise (fixed seeds)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xdplb.control.weight_law import Bounds, FeedbackConfig, LoadController
from xdplb.core.reports import LoadReport

pytestmark = pytest.mark.unit

#: The agent's reporting interval in the simulation, seconds.
TICK = 1.0


class Fleet:
    """Backends of given capacities behind a balancer that honours weights exactly."""

    def __init__(
        self, capacity: Mapping[str, float], *, traffic: float, noise: float, seed: int
    ) -> None:
        self.capacity = dict(capacity)
        self.traffic = traffic  #: total offered load, in units of capacity
        self.noise = noise  #: standard deviation of a cpu report, absolute
        self.rng = np.random.default_rng(seed)

    def cpu(self, weights: Mapping[str, int]) -> dict[str, float]:
        total = sum(weights.values())
        return {
            n: self.traffic * weights[n] / total / self.capacity[n] if total else 0.0
            for n in self.capacity
        }

    def reports(self, weights: Mapping[str, int], at: float) -> list[LoadReport]:
        out = []
        total = sum(weights.values())
        for n, cpu in self.cpu(weights).items():
            noisy = min(max(cpu + self.rng.normal(0.0, self.noise), 0.0), 1.0)
            out.append(LoadReport(n, noisy, 1000.0 * weights[n] / total, at))
        return out


def run(
    ctl: LoadController, fleet: Fleet, seconds: float, t0: float = 0.0
) -> list[tuple[float, dict[str, int]]]:
    """Drive the loop: a report from every backend each TICK (measuring the weights in
    force during that tick), then an update. Returns the changes as (time, weights)."""
    weights = ctl.weights
    changes: list[tuple[float, dict[str, int]]] = []
    t = t0
    while t < t0 + seconds:
        t += TICK
        for r in fleet.reports(weights, t):
            ctl.observe(r)
        new = ctl.update(t)
        if new is not None:
            weights = new
            changes.append((t, new))
    return changes


def ratio(w: Mapping[str, int], a: str, b: str) -> float:
    return w[a] / w[b]


def test_a_backend_twice_as_fast_gets_twice_the_weight() -> None:
    fleet = Fleet({"fast": 2.0, "slow": 1.0}, traffic=1.5, noise=0.02, seed=1)
    ctl = LoadController(FeedbackConfig(min_interval=5.0), {"fast": 500, "slow": 500})
    run(ctl, fleet, 120.0)
    assert ratio(ctl.weights, "fast", "slow") == pytest.approx(2.0, rel=0.1)
    cpu = fleet.cpu(ctl.weights)
    assert cpu["fast"] == pytest.approx(cpu["slow"], rel=0.1)
    assert sum(ctl.weights.values()) == pytest.approx(1000, abs=2)


def test_mixed_fleet_converges_to_capacity_shares() -> None:
    capacity = {"b1": 1.0, "b2": 1.5, "b3": 2.0, "b4": 4.0}
    fleet = Fleet(capacity, traffic=4.0, noise=0.02, seed=2)
    ctl = LoadController(FeedbackConfig(min_interval=5.0), dict.fromkeys(capacity, 250))
    run(ctl, fleet, 200.0)
    w = ctl.weights
    for n, c in capacity.items():
        assert w[n] / w["b1"] == pytest.approx(c, rel=0.1), (n, w)


def quick_reversals(changes: list[tuple[float, dict[str, int]]], name: str, gap: float) -> int:
    """Changes undone at once: a ringing loop moves back at every opportunity (``gap``)."""
    steps = [(t, w[name]) for t, w in changes]
    return sum(
        1
        for (_, w0), (t1, w1), (t2, w2) in zip(steps, steps[1:], steps[2:], strict=False)
        if t2 - t1 <= gap and (w1 - w0) * (w2 - w1) < 0
    )


@pytest.mark.parametrize("seed", [3, 4, 5, 8])
def test_noisy_reports_do_not_make_weights_oscillate(seed: int) -> None:
    # Noise of 0.03 on a cpu near 0.4 is 7.5% per report, more than the deadband.
    fleet = Fleet({"fast": 2.0, "slow": 1.0}, traffic=1.2, noise=0.03, seed=seed)
    ctl = LoadController(FeedbackConfig(min_interval=5.0), {"fast": 500, "slow": 500})
    run(ctl, fleet, 60.0)  # converge
    settled = ctl.weights["fast"]
    changes = run(ctl, fleet, 600.0, t0=60.0)
    history = [settled] + [w["fast"] for _, w in changes]
    # 120 opportunities to change: few taken, each small, all near the settled weight.
    assert len(changes) <= 15, history
    assert all(abs(s) <= 0.05 * settled for s in np.diff(history)), history
    assert all(abs(h - settled) <= 0.06 * settled for h in history), history
    # Noise may hop the weight between neighbours of the equilibrium now and then, but a
    # change is not undone at the next opportunity, as it would be in a ringing loop.
    assert quick_reversals(changes, "fast", gap=5.0 + 2 * TICK) <= 1, changes


def test_the_oscillation_check_catches_an_undamped_loop() -> None:
    # Full gain on raw single reports, no deadband: noise alone makes it hop every time.
    cfg = FeedbackConfig(
        min_interval=5.0, gain=1.0, deadband=0.0, smoothing=1.0, min_reports=1, max_step=10.0
    )
    fleet = Fleet({"fast": 2.0, "slow": 1.0}, traffic=1.2, noise=0.03, seed=3)
    ctl = LoadController(cfg, {"fast": 500, "slow": 500})
    changes = run(ctl, fleet, 600.0)
    assert quick_reversals(changes, "fast", gap=5.0 + 2 * TICK) > 20


def test_convergence_is_monotone_without_noise() -> None:
    fleet = Fleet({"fast": 3.0, "slow": 1.0}, traffic=1.5, noise=0.0, seed=0)
    ctl = LoadController(FeedbackConfig(min_interval=5.0), {"fast": 500, "slow": 500})
    changes = run(ctl, fleet, 120.0)
    fast = [500] + [w["fast"] for _, w in changes]
    assert all(b > a for a, b in itertools.pairwise(fast)), fast  # no overshoot
    assert ratio(ctl.weights, "fast", "slow") == pytest.approx(3.0, rel=0.1)


def test_equal_backends_stay_equal() -> None:
    names = ["b1", "b2", "b3"]
    fleet = Fleet(dict.fromkeys(names, 1.0), traffic=1.5, noise=0.02, seed=6)
    ctl = LoadController(FeedbackConfig(min_interval=5.0), dict.fromkeys(names, 300))
    changes = run(ctl, fleet, 300.0)
    assert len(changes) <= 3
    assert all(270 <= w <= 330 for w in ctl.weights.values()), ctl.weights


def test_min_reports_before_a_backend_is_judged() -> None:
    ctl = LoadController(FeedbackConfig(min_reports=3), {"a": 100, "b": 100})
    for t in (0.0, 1.0):
        ctl.observe(LoadReport("a", 0.8, 0.0, t))
        ctl.observe(LoadReport("b", 0.2, 0.0, t))
        assert ctl.update(t) is None
    ctl.observe(LoadReport("a", 0.8, 0.0, 2.0))
    ctl.observe(LoadReport("b", 0.2, 0.0, 2.0))
    assert ctl.update(2.0) is not None


def test_weights_follow_a_backend_that_slows_down() -> None:
    fleet = Fleet({"b1": 1.0, "b2": 1.0}, traffic=1.0, noise=0.02, seed=8)
    ctl = LoadController(FeedbackConfig(min_interval=5.0), {"b1": 500, "b2": 500})
    run(ctl, fleet, 60.0)
    assert ratio(ctl.weights, "b1", "b2") == pytest.approx(1.0, rel=0.1)
    fleet.capacity["b2"] = 0.5  # a noisy neighbour takes half of b2
    changes = run(ctl, fleet, 150.0, t0=60.0)
    b2 = [500] + [w["b2"] for _, w in changes]
    assert all(b <= a for a, b in itertools.pairwise(b2)), b2  # one way, no ringing
    assert ratio(ctl.weights, "b1", "b2") == pytest.approx(2.0, rel=0.1)


def test_bounds_are_respected() -> None:
    fleet = Fleet({"fast": 10.0, "slow": 1.0}, traffic=2.0, noise=0.0, seed=0)
    cfg = FeedbackConfig(
        min_interval=5.0,
        bounds={"slow": Bounds(min_weight=200, max_weight=600)},
        default_bounds=Bounds(min_weight=1, max_weight=700),
    )
    ctl = LoadController(cfg, {"fast": 500, "slow": 500})
    changes = run(ctl, fleet, 120.0)
    assert changes
    for _, w in changes:
        assert 200 <= w["slow"] <= 600
        assert 1 <= w["fast"] <= 700
    assert ctl.weights == {"fast": 700, "slow": 200}  # both pinned: the best it may do


def test_steps_are_limited_by_max_step() -> None:
    cfg = FeedbackConfig(max_step=1.25, gain=1.0, min_reports=1)
    ctl = LoadController(cfg, {"a": 1000, "b": 1000})
    ctl.observe(LoadReport("a", 0.9, 0.0, 1.0))
    ctl.observe(LoadReport("b", 0.01, 0.0, 1.0))
    new = ctl.update(1.0)
    assert new is not None
    # a down by 1.25, b up by 1.25, then both rescaled to the same total.
    assert new["b"] / new["a"] == pytest.approx(1.25**2, rel=0.01)


def test_min_interval_is_respected() -> None:
    fleet = Fleet({"fast": 4.0, "slow": 1.0}, traffic=1.5, noise=0.02, seed=7)
    ctl = LoadController(FeedbackConfig(min_interval=7.0), {"fast": 500, "slow": 500})
    times = [t for t, _ in run(ctl, fleet, 100.0)]
    assert len(times) >= 2
    assert all(b - a >= 7.0 for a, b in itertools.pairwise(times)), times


def test_update_says_none_until_min_interval_has_passed() -> None:
    cfg = FeedbackConfig(min_interval=10.0, settle=1.0, min_reports=1)
    ctl = LoadController(cfg, {"a": 100, "b": 100})
    ctl.observe(LoadReport("a", 0.8, 0.0, 0.0))
    ctl.observe(LoadReport("b", 0.2, 0.0, 0.0))
    assert ctl.update(0.0) is not None
    ctl.observe(LoadReport("a", 0.8, 0.0, 9.0))
    ctl.observe(LoadReport("b", 0.2, 0.0, 9.0))
    assert ctl.update(9.99) is None
    assert ctl.update(10.0) is not None
    assert ctl.last_change == 10.0


def test_stale_reports_are_ignored() -> None:
    cfg = FeedbackConfig(max_age=5.0, min_reports=1)
    ctl = LoadController(cfg, {"a": 100, "b": 100, "c": 100})
    ctl.observe(LoadReport("a", 0.9, 0.0, 0.0))  # old
    ctl.observe(LoadReport("b", 0.5, 0.0, 10.0))
    assert ctl.update(10.0) is None  # only b is fresh: nothing to balance against
    ctl.observe(LoadReport("c", 0.3, 0.0, 10.0))
    new = ctl.update(10.0)
    assert new is not None
    assert new["a"] == 100  # no fresh report: keeps its weight
    assert new["c"] > new["b"]


def test_reports_of_the_old_weights_are_ignored_after_a_change() -> None:
    cfg = FeedbackConfig(min_interval=5.0, settle=2.0, min_reports=1)
    ctl = LoadController(cfg, {"a": 100, "b": 100})
    ctl.observe(LoadReport("a", 0.8, 0.0, 0.0))
    ctl.observe(LoadReport("b", 0.2, 0.0, 0.0))
    first = ctl.update(0.0)
    assert first is not None and first["a"] < 100
    # Inside settle, measuring the old weights: had they counted, a would move back up.
    ctl.observe(LoadReport("a", 0.1, 0.0, 1.0))
    ctl.observe(LoadReport("b", 0.9, 0.0, 1.0))
    assert ctl.ignored_reports == 2
    second = ctl.update(5.0)  # the cost estimates from before the change still hold
    assert second is not None and second["a"] < first["a"]


def test_inside_the_deadband_nothing_moves() -> None:
    ctl = LoadController(FeedbackConfig(deadband=0.05, min_reports=1), {"a": 100, "b": 100})
    ctl.observe(LoadReport("a", 0.52, 0.0, 0.0))
    ctl.observe(LoadReport("b", 0.48, 0.0, 0.0))
    assert ctl.update(0.0) is None


def test_drained_and_unknown_backends() -> None:
    ctl = LoadController(FeedbackConfig(min_reports=1), {"a": 100, "b": 100, "drained": 0})
    ctl.observe(LoadReport("ghost", 0.9, 0.0, 0.0))
    ctl.observe(LoadReport("drained", 0.0, 0.0, 0.0))
    ctl.observe(LoadReport("a", 0.8, 0.0, 0.0))
    ctl.observe(LoadReport("b", 0.2, 0.0, 0.0))
    new = ctl.update(0.0)
    assert new is not None and new["drained"] == 0
    assert ctl.ignored_reports == 2  # the unknown one, and the drained one


def test_smoothing_averages_reports() -> None:
    cfg = FeedbackConfig(smoothing=0.5, gain=1.0, min_reports=1)
    ctl = LoadController(cfg, {"a": 100, "b": 100})
    for cpu in (0.2, 0.6):  # EWMA: 0.5 * 0.6 + 0.5 * 0.2 = 0.4
        ctl.observe(LoadReport("a", cpu, 0.0, 0.0))
    ctl.observe(LoadReport("b", 0.2, 0.0, 0.0))
    new = ctl.update(0.0)
    assert new is not None
    assert new["b"] / new["a"] == pytest.approx(2.0, rel=0.02)


def test_total_weight_rescales_small_base_weights() -> None:
    ctl = LoadController(FeedbackConfig(total_weight=1000), {"a": 1, "b": 1})
    assert ctl.weights == {"a": 500, "b": 500}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gain": 0.0}, "gain: must be in (0, 1], got 0.0"),
        ({"gain": 1.5}, "gain: must be in (0, 1], got 1.5"),
        ({"gain": math.nan}, "gain: must be a finite number, got nan"),
        ({"deadband": -0.1}, "deadband: must be in [0, 1), got -0.1"),
        ({"smoothing": 0.0}, "smoothing: must be in (0, 1], got 0.0"),
        ({"max_step": 1.0}, "max_step: must be > 1, got 1.0"),
        ({"min_reports": 0}, "min_reports: must be a positive integer, got 0"),
        ({"min_interval": 0.0}, "min_interval: must be > 0, got 0.0"),
        ({"settle": 60.0}, "settle: must be in [0, min_interval=60.0), got 60.0"),
        ({"max_age": -1.0}, "max_age: must be > 0, got -1.0"),
        ({"total_weight": 0}, "total_weight: must be a positive integer or None, got 0"),
        (
            {"default_bounds": Bounds(min_weight=10, max_weight=5)},
            "default_bounds.min_weight: 10 is above max_weight 5",
        ),
        (
            {"bounds": {"b1": Bounds(max_weight=70000)}},
            "bounds['b1'].max_weight: must be an integer in 0..65535, got 70000",
        ),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as e:
        FeedbackConfig(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cpu": 1.5}, "cpu: must be within 0..1, got 1.5"),
        ({"rps": -1.0}, "rps: must be >= 0, got -1.0"),
        ({"backend": ""}, "backend: must be a non-empty string, got ''"),
        ({"at": math.inf}, "at: must be a finite number, got inf"),
    ],
)
def test_bad_report_names_the_field(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"backend": "b1", "cpu": 0.5, "rps": 10.0, "at": 0.0} | kwargs
    with pytest.raises(ValueError) as e:
        LoadReport(**fields)
    assert str(e.value) == message


def test_bad_base_weights() -> None:
    with pytest.raises(ValueError, match=r"^base_weights\['a'\]: must be an integer"):
        LoadController(FeedbackConfig(), {"a": -1})
    with pytest.raises(ValueError, match=r"^base_weights: at least one backend"):
        LoadController(FeedbackConfig(), {})


@settings(max_examples=200, deadline=None)
@given(
    base=st.lists(st.integers(0, 2000), min_size=2, max_size=6),
    lo=st.integers(0, 50),
    hi=st.integers(100, 3000),
    cpus=st.lists(st.floats(0.0, 1.0), min_size=6, max_size=6),
    gain=st.floats(0.05, 1.0),
)
def test_any_update_stays_within_bounds(
    base: list[int], lo: int, hi: int, cpus: list[float], gain: float
) -> None:
    names = [f"b{i}" for i in range(len(base))]
    cfg = FeedbackConfig(default_bounds=Bounds(lo, hi), gain=gain, min_reports=1)
    ctl = LoadController(cfg, dict(zip(names, base, strict=True)))
    start = ctl.weights
    for n, cpu in zip(names, cpus, strict=False):
        ctl.observe(LoadReport(n, cpu, 0.0, 0.0))
    new = ctl.update(0.0)
    if new is None:
        return
    assert new.keys() == start.keys()
    for n, w in new.items():
        if base[names.index(n)] == 0:
            assert w == 0  # drained stays drained
        else:
            assert lo <= w <= hi
