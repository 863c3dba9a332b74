"""HealthMonitor with a fake check function: hysteresis, schedule, target changes, limits.

The monitor runs on an event loop with a virtual clock that jumps to the next timer
(:class:`VirtualTimeLoop`): its schedule is asserted exactly, however busy the machine, and
every wait is still bounded in real time.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import selectors
import statistics
from collections.abc import Awaitable, Callable, Hashable
from ipaddress import IPv4Address
from typing import Any, TypeVar

import pytest

from xdplb.config.health import HealthCheckConfig
from xdplb.health.checkers import CheckResult, Target
from xdplb.health.monitor import HealthMonitor
from xdplb.lab.wait import wait_for_async

pytestmark = pytest.mark.unit

ADDR = IPv4Address("198.18.0.11")
T = TypeVar("T")


def target(key: Hashable, port: int = 80, **check: Any) -> Target:
    check.setdefault("interval_ms", 50)
    check.setdefault("timeout_ms", 50)
    check.setdefault("jitter", 0.0)
    cfg = HealthCheckConfig.model_validate({"checker": {"tcp": {}}, **check})
    return Target(key=key, backend=ADDR, address=ADDR, port=port, check=cfg)


class _JumpingSelector(selectors.DefaultSelector):
    """A selector that never sleeps: a wait for the next timer moves the clock there."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            self.clock[0] += timeout
            timeout = 0
        return super().select(timeout)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock that jumps to the next timer: the monitor's
    schedule (it reads only ``loop.time()``) is seen exactly, however busy the machine,
    and a test of seconds of checks takes milliseconds."""

    def __init__(self) -> None:
        self._clock = [0.0]
        super().__init__(_JumpingSelector(self._clock))

    def time(self) -> float:
        return self._clock[0]


def run_for(monitor: HealthMonitor, body: Callable[[], Awaitable[object]]) -> None:
    """Run the monitor while ``body`` runs, then cancel it (bounded: 10 virtual seconds),
    on a :class:`VirtualTimeLoop`."""

    async def main() -> None:
        task = asyncio.create_task(monitor.run())
        try:
            async with asyncio.timeout(10):
                await body()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        runner.run(main())


async def until(read: Callable[[], T], what: str, cond: Callable[[T], object]) -> T:
    """Until ``cond(read())``: fails after 5 s of real time naming ``what``."""
    return await wait_for_async(read, what, until=cond, timeout=5.0)


class Changes:
    """on_change that records each call with the number of checks seen so far."""

    def __init__(self) -> None:
        self.calls: list[tuple[Hashable, bool, int]] = []
        self.monitor: HealthMonitor | None = None

    def __call__(self, key: Hashable, up: bool) -> None:
        assert self.monitor is not None
        state = self.monitor.state(key)
        assert state is not None and state.up == up  # the state is already the new one
        self.calls.append((key, up, state.checks_total))


def test_rise_and_fall_counts_exactly() -> None:
    # fall 2, rise 3: isolated failures and short runs of successes change nothing.
    script = "SFSFF" + "SSFSSS" + "FSF"
    results = iter(script)
    done = asyncio.Event()

    async def check(t: Target) -> CheckResult:
        r = next(results, None)
        if r is None:
            done.set()
            await asyncio.sleep(3600)  # the script is over: a check that never ends
        return CheckResult(r == "S", f"fake {r}", 0.001)

    changes = Changes()
    m = HealthMonitor(changes, check=check)
    changes.monitor = m
    m.set_targets([target("a", rise_count=3, fall_count=2)])
    state = m.state("a")
    assert state is not None and state.up and not state.checked

    async def body() -> None:
        await done.wait()

    run_for(m, body)
    # Down at the 5th check (2nd failure in a row), up at the 11th (3rd success in a row).
    assert changes.calls == [("a", False, 5), ("a", True, 11)]
    s = m.state("a")
    assert s is not None
    assert (s.up, s.checked, s.checks_total, s.successes, s.failures) == (True, True, 14, 0, 1)
    assert s.last_detail == "fake F"
    assert m.checks_total == 14 and m.checks_failed == 6


def test_first_checks_spread_over_the_first_interval() -> None:
    n, interval = 200, 0.4
    first: dict[Hashable, float] = {}
    loop_start = 0.0

    async def check(t: Target) -> CheckResult:
        first.setdefault(t.key, asyncio.get_running_loop().time() - loop_start)
        return CheckResult(True, "ok", 0.0)

    m = HealthMonitor(lambda k, up: None, check=check, rng=random.Random(7))
    m.set_targets([target(i, interval_ms=400, timeout_ms=100) for i in range(n)])

    async def body() -> None:
        nonlocal loop_start
        loop_start = asyncio.get_running_loop().time()
        await until(lambda: len(first), f"a first check of all {n}", lambda k: k == n)

    run_for(m, body)
    times = sorted(first.values())
    assert times[-1] < interval
    # Uniform over [0, 0.4): every tenth of the interval gets some, none gets most.
    bins = collections.Counter(min(int(t / interval * 10), 9) for t in times)
    assert sorted(bins) == list(range(10))
    assert max(bins.values()) < n * 0.25


def test_jitter_varies_each_interval_within_bounds() -> None:
    starts: list[float] = []

    async def check(t: Target) -> CheckResult:
        starts.append(asyncio.get_running_loop().time())
        return CheckResult(True, "ok", 0.0)

    m = HealthMonitor(lambda k, up: None, check=check, rng=random.Random(1))
    m.set_targets([target("a", interval_ms=60, timeout_ms=50, jitter=0.5)])
    run_for(m, lambda: until(lambda: len(starts), "16 checks", lambda k: k >= 16))
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 60 ms x (1 +- 0.5): within [30, 90] ms (the clock is virtual: no timer slack).
    assert all(0.03 - 1e-9 <= g <= 0.09 + 1e-9 for g in gaps), gaps
    assert statistics.pstdev(gaps) > 0.005  # not a fixed period


def test_set_targets_keeps_unchanged_replaces_changed_drops_missing() -> None:
    failing = {"b", "c"}
    calls: collections.Counter[Hashable] = collections.Counter()

    async def check(t: Target) -> CheckResult:
        calls[t.key] += 1
        return CheckResult(t.key not in failing, "fake", 0.0)

    changes = Changes()
    m = HealthMonitor(changes, check=check)
    changes.monitor = m
    a, b, c = target("a"), target("b"), target("c")
    m.set_targets([a, b, c])

    async def body() -> None:
        await until(
            m.states, "b and c down", lambda st: all(not s.up for k, s in st.items() if k != "a")
        )
        await until(lambda: calls["a"], "three checks of a", lambda k: k >= 3)
        before = m.states()
        # a: equal (a new but equal object); b: another port; c: gone; d: new.
        m.set_targets([target("a"), target("b", port=81), target("d")])
        after = m.states()
        assert set(after) == {"a", "b", "d"}
        assert after["a"] == before["a"]  # state kept as it was
        assert after["b"].up is False  # replaced: keeps up/down and since ...
        assert after["b"].since == before["b"].since
        assert (after["b"].checked, after["b"].checks_total, after["b"].failures) == (
            False,
            0,
            0,
        )  # ... but counts afresh
        assert after["d"].up and not after["d"].checked
        assert m.state("c") is None
        c_calls = calls["c"]
        a_total = before["a"].checks_total
        failing.discard("b")  # b now answers: up after rise_count (2) checks
        await until(lambda: m.state("b"), "b up", lambda st: st is not None and st.up)
        await until(lambda: m.state("d"), "d checked", lambda st: st is not None and st.checked)
        assert calls["c"] == c_calls  # no check of a dropped target
        assert m.state("a").checks_total > a_total  # type: ignore[union-attr]

    run_for(m, body)
    downs = [(k, up) for k, up, _ in changes.calls]
    assert sorted(downs[:2]) == [("b", False), ("c", False)]
    assert downs[2:] == [("b", True)]  # nothing for the dropped c, nothing for a or d


def test_unchanged_target_keeps_its_schedule() -> None:
    starts: list[float] = []

    async def check(t: Target) -> CheckResult:
        starts.append(asyncio.get_running_loop().time())
        return CheckResult(True, "ok", 0.0)

    m = HealthMonitor(lambda k, up: None, check=check)
    m.set_targets([target("a", interval_ms=200, timeout_ms=100)])

    async def body() -> None:
        await until(lambda: len(starts), "the first check", lambda k: k == 1)
        for _ in range(20):  # a reload storm of the same target must not add checks
            m.set_targets([target("a", interval_ms=200, timeout_ms=100)])
            await asyncio.sleep(0.01)  # the storm's pace: 20 reloads over one interval
        await until(lambda: len(starts), "three checks", lambda k: k == 3)

    run_for(m, body)
    assert [b - a for a, b in itertools.pairwise(starts)] == pytest.approx([0.2, 0.2])


def test_overrunning_checks_of_one_target_never_overlap() -> None:
    running: collections.Counter[Hashable] = collections.Counter()
    most: collections.Counter[Hashable] = collections.Counter()
    starts: list[float] = []

    async def slow(t: Target) -> CheckResult:
        running[t.key] += 1
        most[t.key] = max(most[t.key], running[t.key])
        if t.key == "a":
            starts.append(asyncio.get_running_loop().time())
        try:
            await asyncio.sleep(0.12)  # more than twice the 50 ms interval
        finally:
            running[t.key] -= 1
        return CheckResult(True, "ok", 0.12)

    m = HealthMonitor(lambda k, up: None, check=slow)
    m.set_targets([target("a"), target("b")])
    run_for(m, lambda: until(lambda: len(starts), "five checks of a", lambda k: k >= 5))
    assert most == {"a": 1, "b": 1}
    gaps = [y - x for x, y in itertools.pairwise(starts)]
    assert gaps == pytest.approx([0.12] * len(gaps)), gaps  # back to back


def test_concurrency_is_bounded_and_nothing_starves() -> None:
    seen: collections.Counter[Hashable] = collections.Counter()
    peak = 0
    now = 0

    async def check(t: Target) -> CheckResult:
        nonlocal peak, now
        now += 1
        peak = max(peak, now)
        try:
            await asyncio.sleep(0.02)  # what a check costs: 20 ms
        finally:
            now -= 1
        seen[t.key] += 1
        return CheckResult(True, "ok", 0.02)

    m = HealthMonitor(lambda k, up: None, check=check, max_concurrent=5)
    m.set_targets([target(i) for i in range(40)])
    queued: list[int] = []

    async def body() -> None:
        async def watch() -> None:
            while True:
                queued.append(m.queued)
                assert m.in_flight <= 5
                await asyncio.sleep(0.003)  # the watch's sampling period

        w = asyncio.create_task(watch())
        await until(
            lambda: dict(seen),
            "two checks of each of 40 targets",
            lambda got: len(got) == 40 and min(got.values()) >= 2,
        )
        w.cancel()

    run_for(m, body)
    assert peak == 5
    assert max(queued) > 0  # 40 targets every 50 ms at 5 x 20 ms: saturated, so they queued
    assert m.in_flight == 0 and m.queued == 0  # after run() ended


def test_cancelling_run_cancels_checks_in_flight() -> None:
    started = asyncio.Event()
    cancelled: list[Hashable] = []

    async def hang(t: Target) -> CheckResult:
        started.set()
        try:
            await asyncio.sleep(3600)  # a check that hangs until cancelled
        except asyncio.CancelledError:
            cancelled.append(t.key)
            raise
        return CheckResult(True, "never", 0.0)

    m = HealthMonitor(lambda k, up: None, check=hang)
    m.set_targets([target("a")])
    run_for(m, started.wait)
    assert cancelled == ["a"]
    assert m.in_flight == 0
    assert m.state("a").checks_total == 0  # type: ignore[union-attr]


def test_a_raising_checker_counts_as_failure_and_a_raising_callback_is_survived() -> None:
    async def broken(t: Target) -> CheckResult:
        raise RuntimeError("bug")

    calls: list[tuple[Hashable, bool]] = []

    def on_change(key: Hashable, up: bool) -> None:
        calls.append((key, up))
        raise ValueError("callback bug")

    m = HealthMonitor(on_change, check=broken)
    m.set_targets([target("a", fall_count=2)])
    run_for(
        m,
        lambda: until(
            lambda: m.state("a"), "four checks", lambda st: st is not None and st.checks_total >= 4
        ),
    )
    assert calls == [("a", False)]
    s = m.state("a")
    assert s is not None and not s.up
    assert s.last_detail == "checker error: RuntimeError('bug')"


def test_duplicate_keys_are_refused() -> None:
    m = HealthMonitor(lambda k, up: None)
    with pytest.raises(ValueError, match="two targets have the key 'a'"):
        m.set_targets([target("a"), target("a", port=81)])


def test_checks_and_transitions_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The runtime logs each transition once, naming VIP and backend; the monitor adds no
    line of its own (it logged a repr of the key), and a successful check none at all."""
    script = "S" * 20 + "FF" + "SS" + "S" * 20
    results = iter(script)
    done = asyncio.Event()

    async def check(t: Target) -> CheckResult:
        r = next(results, None)
        if r is None:
            done.set()
            await asyncio.sleep(3600)  # the script is over: a check that never ends
        return CheckResult(r == "S", f"fake {r}", 0.001)

    changes = Changes()
    m = HealthMonitor(changes, check=check)
    changes.monitor = m
    m.set_targets([target(("198.18.100.1:80/tcp", ADDR), rise_count=2, fall_count=2)])

    async def body() -> None:
        await done.wait()

    with caplog.at_level("DEBUG"):
        run_for(m, body)
    assert [up for _, up, _ in changes.calls] == [False, True]
    assert m.checks_total == len(script)
    assert [r for r in caplog.records if r.name.startswith("xdplb")] == []
