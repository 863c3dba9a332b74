"""Where built objects and pins live."""

from __future__ import annotations

import os
from pathlib import Path

#: The source tree (src layout, editable install): <root>/src/xdplb/paths.py.
ROOT = Path(__file__).resolve().parents[2]

#: Pins of every instance live under here, one directory per instance.
BPFFS_ROOT = Path(os.environ.get("XDPLB_BPFFS", "/sys/fs/bpf/xdplb"))


def build_dir() -> Path:
    return Path(os.environ.get("XDPLB_BUILD_DIR", ROOT / "build"))


def bpf_object(name: str) -> Path:
    """Path of a built BPF object, e.g. ``bpf_object("lb_xdp")``."""
    path = build_dir() / f"{name}.bpf.o"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `make build`")
    return path


def test_object(name: str) -> Path:
    """Path of a BPF object built from tests/bpf/progs."""
    return build_dir() / "test" / f"{name}.bpf.o"


def pin_root(instance: str) -> Path:
    """Per-instance pin directory in bpffs."""
    return BPFFS_ROOT / instance
