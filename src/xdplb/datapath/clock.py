"""The session table's clock, read from user space.

lb_xdp stamps a session with jiffies (``bpf_jiffies64()``: the JIT inlines it into one
load, where a clock helper call costs ~15 ns a packet). User space has no jiffies, so
``bpf/clock.bpf.c`` reads them for it: one BPF_PROG_TEST_RUN (a few microseconds) gives
the kernel's jiffies and CLOCK_MONOTONIC together. HZ, the ticks per second, is the
kernel's CONFIG_HZ when its configuration is readable, else measured from two readings.
"""

from __future__ import annotations

import gzip
import os
import struct
import time
from functools import cache
from pathlib import Path

from xdplb.core.errors import XdplbError
from xdplb.datapath._ffi import check, ffi, lib, new_opts
from xdplb.datapath.objects import BpfObject

_CTX = struct.Struct("<QQ")
#: The HZ values Linux is built with; a measurement is rounded to the nearest.
KNOWN_HZ = (100, 250, 300, 1000)


class Clock:
    """``clock.bpf.o`` loaded: :meth:`read` the kernel's jiffies and monotonic time."""

    def __init__(self) -> None:
        from xdplb.core import paths

        self._obj = BpfObject.load(paths.bpf_object("clock"))
        self._fd = self._obj.program("clock_read").fd

    def read(self) -> tuple[int, int]:
        """(jiffies, CLOCK_MONOTONIC ns), read together in the kernel."""
        buf = ffi.new("char[]", _CTX.size)
        opts = new_opts("bpf_test_run_opts", ctx_in=buf, ctx_size_in=_CTX.size)
        check(lib.bpf_prog_test_run_opts(self._fd, opts), "bpf_prog_test_run_opts(clock_read)")
        jiffies, mono = _CTX.unpack(ffi.buffer(buf, _CTX.size)[:])
        return jiffies, mono

    def now(self) -> int:
        """The session clock now: jiffies as a ``__u32``, as lb_xdp stamps them."""
        return self.read()[0] & 0xFFFFFFFF

    def close(self) -> None:
        self._obj.close()


@cache
def clock() -> Clock:
    """This process's clock (loaded once)."""
    return Clock()


def now_ticks() -> int:
    """The session clock now (jiffies, as a ``__u32``)."""
    return clock().now()


def _kconfig_hz() -> int | None:
    release = os.uname().release
    for path in (Path("/proc/config.gz"), Path(f"/boot/config-{release}")):
        try:
            raw = path.read_bytes()
        except OSError:
            continue
        text = gzip.decompress(raw) if path.suffix == ".gz" else raw
        for line in text.decode(errors="replace").splitlines():
            if line.startswith("CONFIG_HZ="):
                return int(line.split("=", 1)[1])
    return None


@cache
def hz() -> int:
    """The kernel's HZ: jiffies a second."""
    known = _kconfig_hz()
    if known:
        return known
    c = clock()
    j0, t0 = c.read()
    time.sleep(0.2)
    j1, t1 = c.read()
    measured = (j1 - j0) * 1e9 / (t1 - t0)
    best = min(KNOWN_HZ, key=lambda h: abs(h - measured))
    if abs(best - measured) > 0.15 * best:
        raise XdplbError(f"the kernel's HZ is not one of {KNOWN_HZ}: measured {measured:.0f}")
    return best
