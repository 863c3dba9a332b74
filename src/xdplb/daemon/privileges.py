"""Dropping the capabilities the daemon no longer needs once its programs are loaded.

The daemon starts as root with every capability: it mounts bpffs if needed, loads and
pins lb_xdp and reads back tables other processes wrote (``BPF_MAP_GET_FD_BY_ID`` needs
CAP_SYS_ADMIN). After that it only updates maps, creates table maps, may load hc_tc and
attach XDP to a newly configured interface, sets SO_MARK on health-check sockets, and
serves its API. So it keeps :data:`DAEMON_KEEP` and drops everything else from its
effective, permitted, inheritable and bounding sets, with no_new_privs set: a bug in the
API, a YAML parser or a health check's command then cannot load a kernel module, mount,
ptrace, override file permissions, or regain a dropped capability through exec.

The uid stays 0: pins and the run directory are root's (mode 0700 / 0600), and an
unprivileged uid would lose access to them. ctypes against libc: ``prctl`` and
``capset`` are two calls, not worth a dependency (python-prctl needs libcap headers).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
from collections.abc import Iterable
from pathlib import Path


class Cap(enum.IntEnum):
    """The capabilities named here (linux/capability.h)."""

    CHOWN = 0
    DAC_OVERRIDE = 1
    DAC_READ_SEARCH = 2
    KILL = 5
    SETUID = 7
    NET_BIND_SERVICE = 10
    NET_ADMIN = 12
    NET_RAW = 13
    SYS_MODULE = 16
    SYS_PTRACE = 19
    SYS_ADMIN = 21
    SYS_RESOURCE = 24
    PERFMON = 38
    BPF = 39


#: What the serving daemon still needs:
#: - BPF: map updates, new table maps, loading hc_tc;
#: - PERFMON: the verifier's full checks for programs loaded later (hc_tc), as at start;
#: - NET_ADMIN: attaching XDP/TC, the health tunnel's device and rule, SO_MARK;
#: - NET_BIND_SERVICE: an API or agents' port below 1024.
DAEMON_KEEP: frozenset[Cap] = frozenset({Cap.BPF, Cap.PERFMON, Cap.NET_ADMIN, Cap.NET_BIND_SERVICE})

_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def last_cap() -> int:
    return int(Path("/proc/sys/kernel/cap_last_cap").read_text())


def drop_capabilities(keep: Iterable[int] = DAEMON_KEEP) -> None:
    """Keep only ``keep`` in this process (all threads must be started after, or be
    this one: capabilities are per thread; the daemon calls this before its API and
    checkers start their threads), for good."""
    keep = frozenset(int(c) for c in keep)
    for cap in range(last_cap() + 1):
        if cap not in keep:
            _check(_libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"PR_CAPBSET_DROP {cap}")
    mask = sum(1 << c for c in keep)
    data = (_CapData * 2)()
    for i in range(2):
        word = (mask >> (32 * i)) & 0xFFFFFFFF
        data[i].effective = data[i].permitted = word
        data[i].inheritable = 0
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    _check(_libc.capset(ctypes.byref(header), data), "capset")
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def stray_threads(keep: Iterable[int] = DAEMON_KEEP) -> list[str]:
    """Threads of this process whose effective set is more than ``keep`` (they were
    started before :func:`drop_capabilities` and kept theirs)."""
    want = mask(keep)
    return [
        f"{t.name} ({(t / 'comm').read_text().strip()})"
        for t in Path("/proc/self/task").iterdir()
        if capabilities(f"self/task/{t.name}").get("CapEff", 0) & ~want
    ]


def capabilities(pid: int | str = "self") -> dict[str, int]:
    """The capability sets of a process as /proc shows them: CapEff, CapPrm, CapBnd, ..."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cap"):
            name, _, value = line.partition(":")
            out[name] = int(value.strip(), 16)
    return out


def mask(caps: Iterable[int]) -> int:
    return sum(1 << int(c) for c in caps)
