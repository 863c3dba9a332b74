"""Who asked for the change being applied, for the log lines that record it.

This module owns one context variable: the daemon sets it around each API request (the
unix socket peer's uid and pid, or the TCP peer's address, and whether a token was
used) and around a reload it starts itself (SIGHUP, the file changing);
:class:`~xdplb.control.runtime.Runtime` names it in the line each change logs. Being a
context variable, every request on the one event loop sees its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_caller: ContextVar[str] = ContextVar("xdplb_caller", default="the daemon")


def caller() -> str:
    """Who is asking now (``the daemon`` when nobody set it: its own replanning)."""
    return _caller.get()


@contextlib.contextmanager
def acting_for(who: str) -> Iterator[None]:
    """Inside the block, :func:`caller` is ``who``."""
    token = _caller.set(who)
    try:
        yield
    finally:
        _caller.reset(token)
