"""Which lab instances exist and whose they are, so that none outlives its process.

Every instance has its own prefix (``xl<pid><letter>``) on its namespace names and bpffs
pin directories, and a record in /run/xdplb/lab naming its owner process (pid and start
time, which tells a reused pid apart). :func:`cleanup_stale` removes the namespaces, pins
and records of instances whose owner is gone; the instances of this process still alive
at interpreter exit are torn down then (atexit).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from xdplb.core import paths
from xdplb.core.errors import LabError
from xdplb.lab import netns

if TYPE_CHECKING:
    from xdplb.lab.topology import Lab

#: Namespace/pin names of every lab instance: xl<pid><letter>-<node>.
_PREFIX_RE = re.compile(r"^(xl(\d+)[a-z])-")
_REGISTRY_DIR = Path("/run/xdplb/lab")


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after it.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _owner_alive(prefix: str, pid: int) -> bool:
    started = _proc_start_time(pid)
    if started is None:
        return False
    try:
        reg = json.loads((_REGISTRY_DIR / f"{prefix}.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return True  # no record to compare with: assume the pid is the owner
    return bool(reg.get("start_time") == started)


def cleanup_stale() -> list[str]:
    """Remove the namespaces, pins and records of lab instances whose process is gone.

    Returns what was removed. Instances of live processes are left alone.
    """
    removed: list[str] = []
    dead: dict[str, bool] = {}

    def is_dead(name: str) -> str | None:
        m = _PREFIX_RE.match(name)
        if m is None:
            return None
        prefix = m.group(1)
        if prefix not in dead:
            dead[prefix] = not _owner_alive(prefix, int(m.group(2)))
        return prefix if dead[prefix] else None

    for ns in netns.list_namespaces():
        if is_dead(ns):
            netns.delete(ns)
            removed.append(str(netns.ns_path(ns)))
    if paths.BPFFS_ROOT.is_dir():
        for pin in paths.BPFFS_ROOT.iterdir():
            if is_dead(pin.name):
                shutil.rmtree(pin, ignore_errors=True)
                removed.append(str(pin))
    if paths.run_dir().is_dir():
        for run_file in paths.run_dir().glob("xl*-*"):  # the daemons' pid, socket, admin state
            if is_dead(run_file.name):
                if run_file.is_dir():  # a BIRD directory (<instance>.bird)
                    shutil.rmtree(run_file, ignore_errors=True)
                else:
                    run_file.unlink(missing_ok=True)
                removed.append(str(run_file))
    if _REGISTRY_DIR.is_dir():
        for rec in _REGISTRY_DIR.glob("xl*.json"):
            if is_dead(rec.stem + "-"):
                rec.unlink(missing_ok=True)
                removed.append(str(rec))
    return removed


_live_labs: set[Lab] = set()
_live_lock = threading.Lock()
_seq = 0


@atexit.register
def _teardown_all() -> None:
    with _live_lock:
        labs = list(_live_labs)
    for lab in labs:
        with contextlib.suppress(Exception):
            lab.teardown()


def new_prefix() -> str:
    """``xl<pid><letter>``, not in use by any namespace or pin."""
    global _seq
    existing = set(netns.list_namespaces())
    if paths.BPFFS_ROOT.is_dir():
        existing.update(p.name for p in paths.BPFFS_ROOT.iterdir())
    taken = {m.group(1) for name in existing if (m := _PREFIX_RE.match(name))}
    with _live_lock:
        for _ in range(26):
            prefix = f"xl{os.getpid()}{chr(ord('a') + _seq % 26)}"
            _seq += 1
            if prefix not in taken:
                return prefix
    raise LabError("no free lab prefix: 26 labs of this process are alive")


def register(lab: Lab) -> None:
    """Record ``lab`` as this process's: torn down at exit, its prefix owned by this pid."""
    with _live_lock:
        _live_labs.add(lab)
    _REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    rec = {"pid": os.getpid(), "start_time": _proc_start_time(os.getpid())}
    (_REGISTRY_DIR / f"{lab.prefix}.json").write_text(json.dumps(rec))


def unregister(lab: Lab) -> None:
    """``lab`` is torn down: its record goes, and exit no longer tears it down."""
    (_REGISTRY_DIR / f"{lab.prefix}.json").unlink(missing_ok=True)
    with _live_lock:
        _live_labs.discard(lab)
