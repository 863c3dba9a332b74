"""The health monitor: checks thousands of targets from one asyncio loop, with hysteresis.

States follow keepalived and HAProxy: a target starts *up* (a restarted daemon or a new
backend must not empty the table while the first checks run), goes down after
``fall_count`` consecutive failures and comes back after ``rise_count`` consecutive
successes. Only those transitions are reported, through ``on_change(key, up)``, called
synchronously from the loop; the monitor itself logs neither them nor any check (the
caller, which knows what a key names, logs each transition once).

Scheduling: every target has one timer in the loop's own heap (``loop.call_at``), not a
sleeping task; the first fires at a random point within the first interval (so that
thousands of targets added at once do not fire together), the next one
``interval * (1 ± jitter * U)`` after the previous check *started*, and never before
that check has finished: the checks of one target never overlap. At most
``max_concurrent`` checks run at once; a target that falls due while all slots are taken
waits in a FIFO queue. A check that waits for a slot is not charged for the wait: its
timeout starts when it starts.

Lifecycle: ``await monitor.run()`` checks until the task running it is cancelled (then
in-flight checks are cancelled too, and a later ``run()`` starts over with the states
kept). ``set_targets`` may be called at any time, before or during ``run()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass

from xdplb.health.checkers import CheckResult, Target, run_check

log = logging.getLogger(__name__)

CheckFunction = Callable[[Target], Awaitable[CheckResult]]
ChangeCallback = Callable[[Hashable, bool], None]

#: Checks in flight at once, by default. Enough for slow or dead backends (each holds a
#: slot up to its timeout) without letting a loop's backlog inflate every check's latency.
DEFAULT_MAX_CONCURRENT = 512


@dataclass
class HealthState:
    """What the monitor knows about one target (a copy: changing it changes nothing)."""

    up: bool
    """Starts True: a new target is up until ``fall_count`` failures say otherwise."""
    since: float
    """time.monotonic() of the last transition, or of the target's creation."""
    checked: bool
    """At least one check has completed (under the current settings)."""
    successes: int
    """Consecutive successes (0 after a failure)."""
    failures: int
    """Consecutive failures (0 after a success)."""
    last_detail: str
    last_latency: float | None
    checks_total: int


class _Entry:
    """One target's settings, state and schedule."""

    __slots__ = ("alive", "handle", "started", "state", "target", "task")

    def __init__(self, target: Target, state: HealthState) -> None:
        self.target = target
        self.state = state
        self.alive = True  # False once dropped or replaced: results are then ignored
        self.handle: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[CheckResult] | None = None
        self.started = 0.0


class HealthMonitor:
    """Runs the checks of a set of targets and reports up/down transitions."""

    def __init__(
        self,
        on_change: ChangeCallback,
        *,
        rng: random.Random | None = None,
        check: CheckFunction = run_check,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self._on_change = on_change
        self._rng = rng if rng is not None else random.Random()
        self._check = check
        self._max = max_concurrent
        self._entries: dict[Hashable, _Entry] = {}
        self._queue: deque[_Entry] = deque()  # due, waiting for a slot
        self._in_flight = 0
        self._tasks: set[asyncio.Task[CheckResult]] = set()  # in flight, dropped ones too
        self._loop: asyncio.AbstractEventLoop | None = None  # set while run() runs
        self.checks_total = 0
        """Checks completed since creation (a counter for metrics)."""
        self.checks_failed = 0
        """Of which failed."""

    # --- targets ------------------------------------------------------------------------

    def set_targets(self, targets: Iterable[Target]) -> None:
        """Make ``targets`` the set checked: new keys are added (up, first check at a
        random point of the first interval), missing ones dropped (silently: the caller
        removed them), and a key whose target changed starts over with fresh counters and
        schedule but keeps ``up``, so no transition goes unreported. A key whose target is
        equal keeps its state and its schedule."""
        wanted: dict[Hashable, Target] = {}
        for t in targets:
            if t.key in wanted:
                raise ValueError(f"two targets have the key {t.key!r}")
            wanted[t.key] = t
        kept_up: dict[Hashable, HealthState] = {}
        for key, entry in list(self._entries.items()):
            target = wanted.get(key)
            if target == entry.target:
                continue
            if target is not None:
                kept_up[key] = entry.state
            self._drop(entry)
            del self._entries[key]
        now = time.monotonic()
        for key, target in wanted.items():
            if key in self._entries:
                continue
            old = kept_up.get(key)
            state = HealthState(
                up=True if old is None else old.up,
                since=now if old is None else old.since,
                checked=False,
                successes=0,
                failures=0,
                last_detail="not checked yet",
                last_latency=None,
                checks_total=0,
            )
            entry = self._entries[key] = _Entry(target, state)
            if self._loop is not None:
                self._schedule_first(entry)

    def state(self, key: Hashable) -> HealthState | None:
        """A copy of the state of ``key`` (None: no such target)."""
        entry = self._entries.get(key)
        return None if entry is None else dataclasses.replace(entry.state)

    def states(self) -> dict[Hashable, HealthState]:
        """A copy of every target's state."""
        return {k: dataclasses.replace(e.state) for k, e in self._entries.items()}

    @property
    def in_flight(self) -> int:
        """Checks running now."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Targets due but waiting for a free slot (a sign of saturation)."""
        return len(self._queue)

    # --- running ------------------------------------------------------------------------

    async def run(self) -> None:
        """Check until cancelled."""
        if self._loop is not None:
            raise RuntimeError("this HealthMonitor is already running")
        self._loop = asyncio.get_running_loop()
        try:
            for entry in self._entries.values():
                self._schedule_first(entry)
            await self._loop.create_future()  # never set: only cancellation ends run()
        finally:
            self._loop = None
            self._queue.clear()
            for entry in self._entries.values():
                if entry.handle is not None:
                    entry.handle.cancel()
                    entry.handle = None
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _drop(self, entry: _Entry) -> None:
        entry.alive = False
        if entry.handle is not None:
            entry.handle.cancel()
            entry.handle = None
        if entry.task is not None:
            entry.task.cancel()  # its slot frees when it ends (_finished)

    def _jittered(self, entry: _Entry) -> float:
        spec = entry.target.check
        return spec.interval_ms / 1000 * (1 + spec.jitter * self._rng.uniform(-1.0, 1.0))

    def _schedule_first(self, entry: _Entry) -> None:
        assert self._loop is not None
        delay = self._rng.uniform(0.0, entry.target.check.interval_ms / 1000)
        entry.handle = self._loop.call_at(self._loop.time() + delay, self._due, entry)

    def _due(self, entry: _Entry) -> None:
        entry.handle = None
        if not entry.alive:
            return
        if self._in_flight < self._max:
            self._start(entry)
        else:
            self._queue.append(entry)

    def _start(self, entry: _Entry) -> None:
        assert self._loop is not None
        self._in_flight += 1
        entry.started = self._loop.time()
        task = self._loop.create_task(self._guarded(entry.target))
        entry.task = task
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._finished(entry, t))

    async def _guarded(self, target: Target) -> CheckResult:
        try:
            return await self._check(target)
        except Exception as e:  # a checker bug must not stop the monitor: count a failure
            log.exception("health check of %r raised", target.key)
            return CheckResult(False, f"checker error: {e!r}", 0.0)

    def _finished(self, entry: _Entry, task: asyncio.Task[CheckResult]) -> None:
        self._in_flight -= 1
        self._tasks.discard(task)
        if entry.task is task:
            entry.task = None
        if self._loop is None:
            return  # run() is over
        if entry.alive and not task.cancelled():
            self._record(entry, task.result())
        if entry.alive:  # (on_change may have dropped it)
            due = max(entry.started + self._jittered(entry), self._loop.time())
            entry.handle = self._loop.call_at(due, self._due, entry)
        while self._queue and self._in_flight < self._max:
            waiting = self._queue.popleft()
            if waiting.alive:
                self._start(waiting)

    def _record(self, entry: _Entry, result: CheckResult) -> None:
        s = entry.state
        spec = entry.target.check
        s.checked = True
        s.checks_total += 1
        s.last_detail = result.detail
        s.last_latency = result.latency
        self.checks_total += 1
        if result.ok:
            s.successes += 1
            s.failures = 0
            if not s.up and s.successes >= spec.rise_count:
                self._transition(entry, up=True)
        else:
            self.checks_failed += 1
            s.failures += 1
            s.successes = 0
            if s.up and s.failures >= spec.fall_count:
                self._transition(entry, up=False)

    def _transition(self, entry: _Entry, *, up: bool) -> None:
        entry.state.up = up
        entry.state.since = time.monotonic()
        # Not logged here: the callback's owner names the VIP and backend in its one line.
        try:
            self._on_change(entry.target.key, up)
        except Exception:
            log.exception("on_change(%r, %s) raised", entry.target.key, up)
