"""Map layouts: which one an lb_xdp object has, where each is pinned, which ones an
instance has pinned, and the BTF that describes a pinned map.

lb_xdp's maps are pinned under ``<pin root>/abi-<N>`` where N is the object's
``XDPLB_ABI_VERSION`` (its BTF's ``enum xdplb_abi``; an object without one is the
legacy layout, whose maps lie directly in the pin root). The XDP links stay in
``<pin root>/links`` whatever the layout: a daemon of another layout swaps its program
into them (docs/operations.md, "Upgrades").
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from xdplb.core import paths
from xdplb.core.btf import Btf, BtfError
from xdplb.core.errors import BpfError, XdplbError
from xdplb.datapath._ffi import ffi, lib
from xdplb.datapath.maps import Map

#: A file that says "lb_xdp's maps are pinned here" (every layout has had it).
MARKER = "lb_conns"


class LayoutMismatch(XdplbError):
    """The instance's pins are of another layout than this xdplb reads."""


def _raw_btf(handle: object, what: str) -> Btf:
    if handle == ffi.NULL:
        raise BpfError(what, ffi.errno or 22)
    try:
        size = ffi.new("__u32 *")
        data = lib.btf__raw_data(handle, size)
        if data == ffi.NULL:
            raise BpfError(f"btf__raw_data({what})", 12)
        return Btf.parse(bytes(ffi.buffer(data, size[0])))
    finally:
        lib.btf__free(handle)


def object_btf(path: Path) -> Btf:
    """The BTF of a BPF object file (``.bpf.o``)."""
    return _raw_btf(lib.btf__parse(os.fsencode(path), ffi.NULL), f"btf__parse({path})")


def kernel_btf(btf_id: int) -> Btf:
    """A BTF object loaded in the kernel, by id (a map's ``btf_id``; CAP_SYS_ADMIN)."""
    return _raw_btf(
        lib.btf__load_from_kernel_by_id(btf_id), f"btf__load_from_kernel_by_id({btf_id})"
    )


def map_btf(m: Map) -> tuple[Btf, int]:
    """The BTF describing map ``m`` and its value's type id; XdplbError if it has none."""
    if not m.btf_id or not m.btf_value_type_id:
        raise XdplbError(f"map {m.name} (id {m.id}) carries no type information (BTF)")
    return kernel_btf(m.btf_id), m.btf_value_type_id


def version_of(btf: Btf) -> int:
    """``XDPLB_ABI_VERSION`` of the object ``btf`` describes; the legacy layout's for an
    object from before versioning (no ``enum xdplb_abi``)."""
    try:
        return btf.enum_values("xdplb_abi")["XDPLB_ABI_VERSION"]
    except (BtfError, KeyError):
        return paths.LEGACY_LAYOUT


@lru_cache(maxsize=16)
def _object_version(path: str, mtime_ns: int) -> int:
    return version_of(object_btf(Path(path)))


def object_version(path: Path) -> int:
    """The layout of an lb_xdp object file (:func:`version_of` its BTF)."""
    return _object_version(str(path), path.stat().st_mtime_ns)


def current_version() -> int:
    """The layout this xdplb runs and reads: its lb_xdp object's (``XDPLB_LB_OBJECT``, or
    the build's)."""
    return object_version(paths.bpf_object("lb_xdp"))


def pinned_layouts(instance: str) -> dict[int, Path]:
    """Layout version -> directory, for every layout whose lb_xdp maps ``instance`` has
    pinned (usually one; two during an upgrade)."""
    root = paths.pin_root(instance)
    out: dict[int, Path] = {}
    if (root / MARKER).exists():
        out[paths.LEGACY_LAYOUT] = root
    if root.is_dir():
        for d in root.glob(f"{paths.LAYOUT_PREFIX}*"):
            n = d.name.removeprefix(paths.LAYOUT_PREFIX)
            if n.isdigit() and int(n) > paths.LEGACY_LAYOUT and (d / MARKER).exists():
                out[int(n)] = d
    return dict(sorted(out.items()))


def pins_dir(instance: str, version: int | None = None) -> Path:
    """Where a reader of ``instance``'s pins finds lb_xdp's maps: the directory of layout
    ``version`` (default :func:`current_version`). LayoutMismatch, saying which layout
    runs, if only other layouts are pinned; the directory (maybe missing) if none is."""
    version = current_version() if version is None else version
    here = paths.layout_dir(instance, version)
    if (here / MARKER).exists():
        return here
    others = pinned_layouts(instance)
    if others:
        running = ", ".join(paths.layout_name(v) for v in others)
        raise LayoutMismatch(
            f"instance {instance} runs layout {running}; this xdplb reads "
            f"{paths.layout_name(version)}: use the xdplb release that runs it, or start "
            f"this release's daemon (`xdplb run`), which migrates the instance to "
            f"{paths.layout_name(version)} and keeps its connections"
        )
    return here


def remove_layout(instance: str, version: int) -> int:
    """Remove the pinned maps of one layout of ``instance`` (its health-check maps too),
    never the links nor another layout's maps. Returns how many pins it removed."""
    d = paths.layout_dir(instance, version)
    removed = 0
    if version == paths.LEGACY_LAYOUT:
        # The maps lie beside links/ and the abi-<N> directories: only plain pins go,
        # and the legacy hc_tc directory.
        pins = [p for p in d.iterdir() if not p.is_dir()] if d.is_dir() else []
        hc = d / "hc"
        pins += [p for p in hc.iterdir() if not p.is_dir()] if hc.is_dir() else []
        for p in pins:
            p.unlink(missing_ok=True)
            removed += 1
        if hc.is_dir():
            hc.rmdir()
        return removed
    for p in sorted(d.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if p.is_dir():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)
            removed += 1
    if d.is_dir():
        d.rmdir()
    return removed
