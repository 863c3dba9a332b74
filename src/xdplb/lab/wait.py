"""Waiting for a fact: read a value until it satisfies a condition, and fail after a
deadline with what did not happen and the last value seen.

The one poll loop of the lab and the tests. A test that sleeps and then asserts guesses
how long the machine takes; on a busy machine the guess is wrong one run in a few
hundred. Polling for the fact waits as long as it takes, and no longer. (Sleeps that are
the scenario itself -- pacing traffic, a window in which nothing must happen -- are not
waits, and do not belong here.)

::

    wait_for(lambda: shares(lb), "b2 out of the table", until=lambda s: b2 not in s)
    await wait_for_async(lambda: len(starts), "three checks", until=lambda n: n >= 3)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from xdplb.core.errors import LabError

T = TypeVar("T")

#: Seconds between two reads, by default.
INTERVAL = 0.02


class WaitTimeout(LabError):
    """What was waited for did not happen in time."""


def _truthy(value: object) -> bool:
    return bool(value)


def _timeout(
    what: str, timeout: float, last: object, detail: Callable[[], str] | None
) -> WaitTimeout:
    text = f"{what}: not after {timeout:g} s; last seen: {last!r}"
    if detail is not None:
        text += f"\n{detail()}"
    return WaitTimeout(text)


def wait_for(
    read: Callable[[], T],
    what: str,
    *,
    until: Callable[[T], object] = _truthy,
    timeout: float = 10.0,
    interval: float = INTERVAL,
    retry: tuple[type[BaseException], ...] = (),
    detail: Callable[[], str] | None = None,
) -> T:
    """Call ``read`` every ``interval`` seconds until ``until`` holds for its value
    (by default: until it is truthy); return that value.

    ``what`` names the fact ("b2 out of the table"). After ``timeout`` seconds raise
    :class:`WaitTimeout` with it, the last value read (or exception, for ``retry``:
    exceptions that mean "not yet") and ``detail()`` (a log tail, say). ``read`` is
    always called at least once, and once more at the deadline.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = read()
        except retry as exc:
            last = exc
        else:
            if until(value):
                return value
            last = value
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout, last, detail)
        time.sleep(interval)


async def wait_for_async(
    read: Callable[[], T],
    what: str,
    *,
    until: Callable[[T], object] = _truthy,
    timeout: float = 10.0,
    interval: float = 0.005,
    detail: Callable[[], str] | None = None,
) -> T:
    """:func:`wait_for` inside an event loop: the loop runs between two reads."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if until(value):
            return value
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout, value, detail)
        await asyncio.sleep(interval)
