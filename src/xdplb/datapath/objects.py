"""BPF object files: open, pin-aware load, and the programs and maps they hold."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from xdplb.core.closing import Closing
from xdplb.core.errors import LoadError, XdplbError
from xdplb.datapath._ffi import StrPath, capture_log, ffi, lib, new_opts
from xdplb.datapath.maps import Map
from xdplb.datapath.programs import Program


class PinnedSizeError(XdplbError):
    """Pinned maps that the object would reuse have another size than asked for:
    ``mismatches`` holds (map name, pinned max_entries, wanted max_entries)."""

    def __init__(self, mismatches: list[tuple[str, int, int]]) -> None:
        self.mismatches = mismatches
        super().__init__(
            "; ".join(f"pinned {n} has {p} entries, {w} asked for" for n, p, w in mismatches)
        )


class BpfObject(Closing):
    """A loaded BPF object (one ``.bpf.o``).

    Its programs and maps are handles on duplicated descriptors. close() closes them
    all; to keep one beyond that, take ``Map.from_fd(obj.map(name).fd)`` first.
    """

    def __init__(self, path: Path, obj: Any, pin_root: Path | None) -> None:
        self.path = path
        self.pin_root = pin_root
        self._obj = obj
        self.programs: dict[str, Program] = {}
        self.maps: dict[str, Map] = {}
        try:
            self._collect(obj)
        except BaseException:
            self.close()  # takes the libbpf object down with it
            raise

    def _collect(self, obj: Any) -> None:
        """Take a handle on every program and every map libbpf created."""
        prog = lib.bpf_object__next_program(obj, ffi.NULL)
        while prog != ffi.NULL:
            name = ffi.string(lib.bpf_program__name(prog)).decode()
            fd = lib.bpf_program__fd(prog)
            if fd >= 0:  # programs left out of the load (autoload off) have no fd
                self.programs[name] = Program.from_fd(fd, name)
            prog = lib.bpf_object__next_program(obj, prog)
        m = lib.bpf_object__next_map(obj, ffi.NULL)
        while m != ffi.NULL:
            name = ffi.string(lib.bpf_map__name(m)).decode()
            fd = lib.bpf_map__fd(m)
            if fd >= 0:  # maps libbpf did not create (autocreate off) have no fd
                self.maps[name] = Map.from_fd(fd, name)
            m = lib.bpf_object__next_map(obj, m)

    @classmethod
    def load(
        cls,
        path: StrPath,
        pin_root: StrPath | None = None,
        max_entries: Mapping[str, int] | None = None,
        programs: Collection[str] | None = None,
    ) -> BpfObject:
        """Open and load ``path``. Maps declared LIBBPF_PIN_BY_NAME are pinned under
        ``pin_root`` (created if missing), or reused with their contents if already
        pinned there; without ``pin_root`` nothing is pinned. ``max_entries`` (map name
        -> size) overrides the object's sizes; names the object does not have are
        ignored, so one table serves every object. ``programs``: load only these (None:
        every one); ``()`` creates and pins the maps without a verifier pass.
        Raises LoadError with errno and the libbpf/verifier log, or PinnedSizeError
        (nothing loaded) when a pinned map it would reuse has another size: libbpf
        would refuse to reuse it."""
        path = Path(path)
        root = Path(pin_root) if pin_root is not None else None
        c_path = os.fsencode(path)
        # opts only points at the string: keep it alive in c_root for the whole call.
        c_root = ffi.new("char[]", os.fsencode(root)) if root is not None else ffi.NULL
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        opts = new_opts("bpf_object_open_opts", pin_root_path=c_root)
        with capture_log() as log:
            obj = lib.bpf_object__open_file(c_path, opts)
            if obj == ffi.NULL:
                err = ffi.errno  # read before anything else can clobber it
                raise LoadError(f"bpf_object__open_file({path})", err, "".join(log))
            try:
                if root is None:
                    _unpin(obj)
                _set_sizes(obj, max_entries or {})
                if programs is not None:
                    _select_programs(obj, programs)
            except BaseException:
                lib.bpf_object__close(obj)
                raise
            ret = lib.bpf_object__load(obj)
            if ret < 0:
                lib.bpf_object__close(obj)
                raise LoadError(f"bpf_object__load({path})", -ret, "".join(log))
        return cls(path, obj, root)

    def program(self, name: str) -> Program:
        try:
            return self.programs[name]
        except KeyError:
            raise KeyError(
                f"{self.path.name} has no program {name!r}: {sorted(self.programs)}"
            ) from None

    def map(self, name: str) -> Map:
        try:
            return self.maps[name]
        except KeyError:
            raise KeyError(f"{self.path.name} has no map {name!r}: {sorted(self.maps)}") from None

    def close(self) -> None:
        """Close the object and every handle it gave out through programs/maps."""
        for prog in self.programs.values():
            prog.close()
        for m in self.maps.values():
            m.close()
        obj, self._obj = self._obj, None
        if obj is not None:
            lib.bpf_object__close(obj)

    def __del__(self) -> None:
        # Only the libbpf object: handles already given out close themselves.
        obj, self._obj = getattr(self, "_obj", None), None
        if obj is not None:
            lib.bpf_object__close(obj)

    def __repr__(self) -> str:
        return f"BpfObject({str(self.path)!r}, programs={sorted(self.programs)})"


def _select_programs(obj: Any, names: Collection[str]) -> None:
    """Load only the programs ``names`` (KeyError for a name the object lacks)."""
    have = set()
    prog = lib.bpf_object__next_program(obj, ffi.NULL)
    while prog != ffi.NULL:
        name = ffi.string(lib.bpf_program__name(prog)).decode()
        have.add(name)
        if lib.bpf_program__set_autoload(prog, name in names) < 0:
            raise XdplbError(f"cannot set autoload of program {name}")
        prog = lib.bpf_object__next_program(obj, prog)
    if missing := set(names) - have:
        raise KeyError(f"the object has no program {sorted(missing)}: {sorted(have)}")


def _unpin(obj: Any) -> None:
    """No pinning at all for an object loaded without a pin root: libbpf would pin its
    LIBBPF_PIN_BY_NAME maps straight into /sys/fs/bpf, and reuse what another such load
    left there (KERNEL_NOTES.md)."""
    m = lib.bpf_object__next_map(obj, ffi.NULL)
    while m != ffi.NULL:
        ret = lib.bpf_map__set_pin_path(m, ffi.NULL)
        if ret < 0:
            raise LoadError("bpf_map__set_pin_path(NULL)", -ret)
        m = lib.bpf_object__next_map(obj, m)


def _set_sizes(obj: Any, sizes: Mapping[str, int]) -> None:
    """bpf_map__set_max_entries for every map of an opened object named in ``sizes``,
    after checking that none of them is pinned with another size."""
    bad: list[tuple[str, int, int]] = []
    todo: list[tuple[Any, str, int]] = []
    m = lib.bpf_object__next_map(obj, ffi.NULL)
    while m != ffi.NULL:
        name = ffi.string(lib.bpf_map__name(m)).decode()
        if name in sizes:
            todo.append((m, name, sizes[name]))
            c_pin = lib.bpf_map__pin_path(m)
            pin = os.fsdecode(ffi.string(c_pin)) if c_pin != ffi.NULL else None
            if pin is not None and os.path.exists(pin):
                with Map.from_pinned(pin) as pinned:
                    if pinned.max_entries != sizes[name]:
                        bad.append((name, pinned.max_entries, sizes[name]))
        m = lib.bpf_object__next_map(obj, m)
    if bad:
        raise PinnedSizeError(bad)
    for m, name, size in todo:
        ret = lib.bpf_map__set_max_entries(m, size)
        if ret < 0:
            raise LoadError(f"bpf_map__set_max_entries({name}, {size})", -ret)
