"""Network namespaces without ``ip netns exec``.

``ip netns exec`` also unshares the mount namespace and remounts /sys, which hides
/sys/fs/bpf (and the cgroup v2 mount) from the command it runs. Here only the network
namespace changes: a thread switches with libc ``setns`` (Python 3.11 has no
os.setns), and a child process switches between fork and exec.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from xdplb.core.errors import LabError

#: Where ``ip netns add`` puts its bind mounts.
NETNS_RUN_DIR = Path("/run/netns")

CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.setns.restype = ctypes.c_int


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise LabError(f"setns({what}): {os.strerror(err)} (errno {err})")


def ns_path(ns: str) -> Path:
    """The bind mount of a named namespace (``/run/netns/<ns>``)."""
    return NETNS_RUN_DIR / ns


def open_ns(ns: str) -> int:
    """An O_RDONLY descriptor of namespace ``ns``; the caller closes it."""
    try:
        return os.open(ns_path(ns), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise LabError(f"network namespace {ns!r} does not exist") from None


@contextlib.contextmanager
def enter(ns: str) -> Iterator[None]:
    """Run the block with this thread in namespace ``ns``, then switch back.

    setns() changes the calling thread only: other threads keep their namespace.
    Sockets opened inside stay in ``ns`` after the block ends.
    """
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = open_ns(ns)
        try:
            _setns(target, ns)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home, "back to the original namespace")
    finally:
        os.close(home)


def popen(ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside namespace ``ns`` (only the network namespace changes).

    The child calls setns() between fork and exec (``preexec_fn``), so /sys and
    bpffs look the same as in the caller. ``kw`` goes to subprocess.Popen.
    """
    fd = open_ns(ns)

    def _child() -> None:
        # Runs in the forked child: no exceptions beyond this point are useful,
        # the parent sees a SubprocessError if it fails.
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({ns})")

    try:
        return subprocess.Popen(list(argv), preexec_fn=_child, **kw)
    finally:
        os.close(fd)


def run(
    ns: str, argv: Sequence[str], *, check: bool = True, timeout: float = 30.0, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in ``ns`` to completion, output captured as text.

    A non-zero exit with ``check`` raises LabError carrying the command and its stderr.
    """
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    with popen(ns, argv, text=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise LabError(f"[{ns}] {' '.join(argv)}: timed out after {timeout} s") from None
    done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
    if check and done.returncode != 0:
        raise LabError(f"[{ns}] {' '.join(argv)}: exit {done.returncode}: {(err or '').strip()}")
    return done


def list_namespaces() -> list[str]:
    """Names of every namespace under /run/netns."""
    try:
        return sorted(p.name for p in NETNS_RUN_DIR.iterdir())
    except FileNotFoundError:
        return []


def delete(ns: str) -> None:
    """``ip netns del``; LabError when it fails and the namespace is still there."""
    # Deleting the namespace destroys its veths, whose bridge-side peers go with them.
    done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True, check=False)
    if done.returncode != 0 and ns_path(ns).exists():
        raise LabError(f"ip netns del {ns}: {done.stderr.strip()}")
