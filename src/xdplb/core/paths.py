"""Where built objects, pins and run-time files live, and which names may pick one.

An instance name becomes a path (its pin directory, its API socket, pid and admin files),
so every path built from one goes through :func:`instance_name`: a plain file name that
stays a direct child of its root. The configuration's ``instance`` field, the CLI's
``-i`` and everything below build their paths through it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from xdplb.core.errors import XdplbError

#: The source tree (src layout, editable install): <root>/src/xdplb/core/paths.py.
ROOT = Path(__file__).resolve().parents[3]

#: BPF objects inside an installed package: `make install` ships them as package data.
PACKAGED_OBJECTS = Path(__file__).resolve().parents[1] / "_bpf"

#: Pins of every instance live under here, one directory per instance.
BPFFS_ROOT = Path(os.environ.get("XDPLB_BPFFS", "/sys/fs/bpf/xdplb"))


#: The mount table this process sees.
PROC_MOUNTS = Path("/proc/self/mounts")


def cgroup2_root(mounts: Path = PROC_MOUNTS) -> Path:
    """Where the cgroup v2 hierarchy is mounted: ``/sys/fs/cgroup`` on a unified host
    (Debian 12 and most systemd hosts), ``/sys/fs/cgroup/unified`` on a hybrid one.
    XdplbError if none is."""
    for line in mounts.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            return Path(fields[1])
    raise XdplbError("no cgroup v2 hierarchy is mounted (socket-level balancing needs one)")


def build_dir() -> Path:
    """Where the BPF objects are: ``XDPLB_BUILD_DIR``, else the installed package's, else
    the source tree's build/."""
    if env := os.environ.get("XDPLB_BUILD_DIR"):
        return Path(env)
    return PACKAGED_OBJECTS if PACKAGED_OBJECTS.is_dir() else ROOT / "build"


#: Another lb_xdp object than the build's (a test build of another layout): the daemon,
#: and every reader of pins, use it and its layout (docs/operations.md, "Upgrades").
LB_OBJECT_ENV = "XDPLB_LB_OBJECT"


def bpf_object(name: str) -> Path:
    """Path of a built BPF object, e.g. ``bpf_object("lb_xdp")`` (``XDPLB_LB_OBJECT``
    names another lb_xdp object)."""
    if name == "lb_xdp" and (env := os.environ.get(LB_OBJECT_ENV)):
        if not Path(env).exists():
            raise FileNotFoundError(f"{env} ({LB_OBJECT_ENV}) is missing")
        return Path(env)
    path = build_dir() / f"{name}.bpf.o"
    if not path.exists():
        installed = path.parent == PACKAGED_OBJECTS
        fix = "reinstall (`make install`)" if installed else "run `make build`"
        raise FileNotFoundError(f"{path} is missing: {fix}")
    return path


def test_object(name: str) -> Path:
    """Path of a BPF object built from tests/bpf/progs."""
    return build_dir() / "test" / f"{name}.bpf.o"


#: An instance name: letters, digits, ``_ . -``, at most 64, not starting with a dot
#: (``.``, ``..`` and hidden names never name an instance).
INSTANCE_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$"
_INSTANCE_RE = re.compile(INSTANCE_PATTERN)


class BadName(XdplbError, ValueError):
    """A name that would not stay a plain file name under its root."""


def instance_name(name: str) -> str:
    """``name`` if it may name an instance (:data:`INSTANCE_PATTERN`); BadName otherwise."""
    if not _INSTANCE_RE.fullmatch(name):
        raise BadName(
            f"{name!r} is not an instance name: 1 to 64 of A-Z a-z 0-9 _ . -, "
            "not starting with a dot"
        )
    return name


def under(root: Path, name: str) -> Path:
    """``root/name``, refusing any ``name`` that is not a plain file name (a slash, NUL,
    ``.``, ``..`` or a leading dot): the result is always a direct child of ``root``."""
    if not name or "/" in name or "\0" in name or name.startswith("."):
        raise BadName(f"{name!r} is not a plain file name under {root}")
    return root / name


def pin_root(instance: str) -> Path:
    """Per-instance pin directory in bpffs."""
    return under(BPFFS_ROOT, instance_name(instance))


#: The layout of the release before pins were versioned: its maps lie directly in the
#: instance's pin directory. Every later layout ``N`` has its own ``abi-<N>`` directory.
LEGACY_LAYOUT = 1
LAYOUT_PREFIX = "abi-"
#: The instance's XDP links, shared by every layout (a new program is swapped into them).
LINKS_DIR = "links"


def layout_dir(instance: str, version: int) -> Path:
    """Where lb_xdp's maps of layout ``version`` (``XDPLB_ABI_VERSION``) are pinned for
    ``instance``: ``<pin root>/abi-<N>``; the legacy layout's, the pin root itself."""
    root = pin_root(instance)
    if version == LEGACY_LAYOUT:
        return root
    if version < LEGACY_LAYOUT:
        raise ValueError(f"no layout {version}")
    return root / f"{LAYOUT_PREFIX}{version}"


def layout_name(version: int) -> str:
    """``abi-<N>``, as messages and docs name a layout."""
    return f"{LAYOUT_PREFIX}{version}"


def run_dir() -> Path:
    """The daemons' run-time files (pid, API socket, drains): ``XDPLB_RUN_DIR`` or /run/xdplb."""
    return Path(os.environ.get("XDPLB_RUN_DIR", "/run/xdplb"))


def api_socket(instance: str) -> Path:
    """The unix socket the daemon of ``instance`` serves its API on."""
    return under(run_dir(), f"{instance_name(instance)}.api.sock")


def pid_file(instance: str) -> Path:
    """The pid file of ``instance``'s daemon."""
    return under(run_dir(), f"{instance_name(instance)}.pid")
