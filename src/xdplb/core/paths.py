"""Where built objects and pins live."""

from __future__ import annotations

import os
from pathlib import Path

#: The source tree (src layout, editable install): <root>/src/xdplb/core/paths.py.
ROOT = Path(__file__).resolve().parents[3]

#: BPF objects inside an installed package: `make install` ships them as package data.
PACKAGED_OBJECTS = Path(__file__).resolve().parents[1] / "_bpf"

#: Pins of every instance live under here, one directory per instance.
BPFFS_ROOT = Path(os.environ.get("XDPLB_BPFFS", "/sys/fs/bpf/xdplb"))


def build_dir() -> Path:
    """Where the BPF objects are: ``XDPLB_BUILD_DIR``, else the installed package's, else
    the source tree's build/."""
    if env := os.environ.get("XDPLB_BUILD_DIR"):
        return Path(env)
    return PACKAGED_OBJECTS if PACKAGED_OBJECTS.is_dir() else ROOT / "build"


def bpf_object(name: str) -> Path:
    """Path of a built BPF object, e.g. ``bpf_object("lb_xdp")``."""
    path = build_dir() / f"{name}.bpf.o"
    if not path.exists():
        installed = path.parent == PACKAGED_OBJECTS
        fix = "reinstall (`make install`)" if installed else "run `make build`"
        raise FileNotFoundError(f"{path} is missing: {fix}")
    return path


def test_object(name: str) -> Path:
    """Path of a BPF object built from tests/bpf/progs."""
    return build_dir() / "test" / f"{name}.bpf.o"


def pin_root(instance: str) -> Path:
    """Per-instance pin directory in bpffs."""
    return BPFFS_ROOT / instance


def run_dir() -> Path:
    """The daemons' run-time files (pid, API socket, drains): ``XDPLB_RUN_DIR`` or /run/xdplb."""
    return Path(os.environ.get("XDPLB_RUN_DIR", "/run/xdplb"))


def api_socket(instance: str) -> Path:
    """The unix socket the daemon of ``instance`` serves its API on."""
    return run_dir() / f"{instance}.api.sock"


def pid_file(instance: str) -> Path:
    """The pid file of ``instance``'s daemon."""
    return run_dir() / f"{instance}.pid"
