"""Glue to the compiled libbpf binding: errno checks, fd ownership, log capture."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeAlias

from xdplb.core.errors import BpfError

try:
    from xdplb.datapath._libbpf_c import ffi as ffi
    from xdplb.datapath._libbpf_c import lib as lib
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "xdplb.datapath._libbpf_c is missing: run `make build` "
        "(or .venv/bin/python src/xdplb/datapath/libbpf_build.py)"
    ) from exc

StrPath: TypeAlias = "str | os.PathLike[str]"

_log = logging.getLogger("xdplb.libbpf")
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}

# libbpf's print hook is process-global: one capture at a time, guarded by a lock.
_capture_lock = threading.Lock()
_captured: list[str] | None = None


@ffi.def_extern()  # type: ignore[untyped-decorator]
def xdplb_libbpf_log(level: int, msg: Any) -> None:
    text = ffi.string(msg).decode(errors="replace")
    pylevel = _LEVELS.get(level, logging.DEBUG)
    if _captured is not None:
        # The caller reports it (LoadError.log): keep it out of the warning stream.
        _captured.append(text)
        pylevel = logging.DEBUG
    _log.log(pylevel, "%s", text.rstrip("\n"))


lib.xdplb_install_print()


@contextmanager
def capture_log() -> Iterator[list[str]]:
    """Collect everything libbpf prints (including verifier logs) inside the block."""
    global _captured
    with _capture_lock:
        buf: list[str] = []
        _captured = buf
        try:
            yield buf
        finally:
            _captured = None


def new_opts(ctype: str, **fields: Any) -> Any:
    """LIBBPF_OPTS equivalent: zeroed struct with ``sz`` set, then the given fields."""
    opts = ffi.new(f"struct {ctype} *")
    opts.sz = ffi.sizeof(f"struct {ctype}")
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def check(ret: int, what: str) -> int:
    """libbpf 1.x int-returning calls: negative means -errno."""
    if ret < 0:
        raise BpfError(what, -ret)
    return ret


def close_fd(fd: int) -> None:
    if fd >= 0:
        with suppress(OSError):
            os.close(fd)


def dup_fd(fd: int) -> int:
    """A close-on-exec duplicate, so a handle outlives the object it came from."""
    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)


def obj_info(fd: int, ctype: str, what: str) -> Any:
    """bpf_obj_get_info_by_fd into a zeroed ``struct <ctype>``."""
    info = ffi.new(f"struct {ctype} *")
    size = ffi.new("__u32 *", ffi.sizeof(f"struct {ctype}"))
    check(lib.bpf_obj_get_info_by_fd(fd, info, size), what)
    return info


def obj_get(path: str, what: str) -> int:
    return check(lib.bpf_obj_get(os.fsencode(path)), f"{what}({path})")


def obj_pin(fd: int, path: str, what: str) -> None:
    check(lib.bpf_obj_pin(fd, os.fsencode(path)), f"{what}({path})")
