"""wait_for / wait_for_async: the value once the condition holds, else a failure that
names the fact and the last value seen."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import pytest

from xdplb.lab.wait import WaitTimeout, wait_for, wait_for_async

pytestmark = pytest.mark.unit


def test_returns_the_value_that_satisfied_the_condition() -> None:
    n = itertools.count()
    assert wait_for(lambda: next(n), "three reads", until=lambda v: v >= 3, interval=0) == 3


def test_truthy_by_default_and_read_once_even_without_time() -> None:
    assert wait_for(lambda: {"a": 1}, "a non-empty dict", timeout=0) == {"a": 1}


def test_timeout_names_the_fact_the_last_value_and_the_detail() -> None:
    n = itertools.count()
    with pytest.raises(WaitTimeout) as e:
        wait_for(
            lambda: next(n),
            "b2 out of the table",
            until=lambda v: v < 0,
            timeout=0.05,
            interval=0.01,
            detail=lambda: "log tail",
        )
    msg = str(e.value)
    assert msg.startswith("b2 out of the table: not after 0.05 s; last seen: ")
    assert int(msg.split("last seen: ")[1].split("\n")[0]) >= 1
    assert msg.endswith("\nlog tail")


def test_retry_exceptions_mean_not_yet_others_propagate() -> None:
    calls = itertools.count()

    def flaky() -> str:
        if next(calls) < 2:
            raise FileNotFoundError("not pinned yet")
        return "pinned"

    assert wait_for(flaky, "pinned", retry=(FileNotFoundError,), interval=0) == "pinned"
    with pytest.raises(WaitTimeout, match=r"last seen: FileNotFoundError\('gone'\)"):
        wait_for(_raise(FileNotFoundError("gone")), "x", retry=(OSError,), timeout=0)
    with pytest.raises(KeyError):
        wait_for(_raise(KeyError("bug")), "x", retry=(OSError,))


def _raise(exc: BaseException) -> Callable[[], None]:
    def read() -> None:
        raise exc

    return read


def test_async_lets_the_loop_run_between_reads() -> None:
    async def main() -> int:
        box = [0]

        async def bump() -> None:
            for _ in range(3):
                await asyncio.sleep(0)
                box[0] += 1

        task = asyncio.create_task(bump())
        got = await wait_for_async(lambda: box[0], "three bumps", until=lambda v: v == 3)
        await task
        return got

    assert asyncio.run(main()) == 3
    with pytest.raises(WaitTimeout, match="never: not after 0 s; last seen: False"):
        asyncio.run(wait_for_async(lambda: False, "never", timeout=0))
