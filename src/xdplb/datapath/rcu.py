"""Wait for every BPF program run that has started to end: an RCU grace period.

XDP and TC programs run inside RCU read-side sections. ``membarrier(2)`` with
``MEMBARRIER_CMD_GLOBAL`` returns only after ``synchronize_rcu()``: after it, no CPU is
still in a program run that began before the call. User space needs that twice: before
rewriting the half of ``lb_vip_index`` a reader may still be in (lb.py), and after
swapping a new program into a link, before reading the old program's table for the last
time (upgrade.py).
"""

from __future__ import annotations

import ctypes
import errno
import platform

from xdplb.core.errors import BpfError

#: __NR_membarrier by machine (arch/*/include/uapi/asm/unistd*.h).
_NR_MEMBARRIER = {
    "x86_64": 324,
    "aarch64": 283,
    "riscv64": 283,
    "loongarch64": 283,
    "ppc64le": 365,
    "s390x": 356,
}
MEMBARRIER_CMD_GLOBAL = 1 << 0

_libc = ctypes.CDLL(None, use_errno=True)


def synchronize() -> None:
    """Return after an RCU grace period (``membarrier(MEMBARRIER_CMD_GLOBAL)``)."""
    nr = _NR_MEMBARRIER.get(platform.machine())
    if nr is None:
        raise BpfError(f"membarrier on {platform.machine()}", errno.ENOSYS)
    if _libc.syscall(nr, MEMBARRIER_CMD_GLOBAL, 0) != 0:
        raise BpfError("membarrier(MEMBARRIER_CMD_GLOBAL)", ctypes.get_errno())
