"""core.closing: ``with`` gives the object itself and closes it, also on an exception."""

from __future__ import annotations

import pytest

from xdplb.core.closing import Closing

pytestmark = pytest.mark.unit


class Held(Closing):
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_with_gives_the_object_and_closes_it() -> None:
    held = Held()
    with held as got:
        assert got is held and held.closed == 0
    assert held.closed == 1


def test_an_exception_closes_and_propagates() -> None:
    held = Held()
    with pytest.raises(KeyError), held:
        raise KeyError("x")
    assert held.closed == 1


def test_a_class_without_close_cannot_be_made() -> None:
    class NoClose(Closing):
        pass

    with pytest.raises(TypeError):
        NoClose()  # type: ignore[abstract]
