"""BPF maps: element, iteration and batch operations on a map file descriptor."""

from __future__ import annotations

import enum
import errno
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy

from xdplb.core.closing import Closing
from xdplb.core.errors import BpfError
from xdplb.datapath._ffi import (
    StrPath,
    check,
    close_fd,
    dup_fd,
    ffi,
    lib,
    new_opts,
    obj_get,
    obj_info,
    obj_pin,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    from typing_extensions import Buffer

    #: Anything with the buffer protocol: bytes, bytearray, memoryview, numpy arrays.
    BytesLike: TypeAlias = Buffer | numpy.ndarray[Any, Any]

BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2
BPF_F_LOCK = 4  # element flag: copy the value under its bpf_spin_lock

BPF_F_NO_PREALLOC = 1 << 0
BPF_F_RDONLY_PROG = 1 << 7
BPF_F_WRONLY_PROG = 1 << 8
BPF_F_MMAPABLE = 1 << 10
#: On an inner-map template: inner maps may differ from it in max_entries.
BPF_F_INNER_MAP = 1 << 12


class MapType(enum.IntEnum):
    """``enum bpf_map_type`` from <linux/bpf.h>."""

    UNSPEC = 0
    HASH = 1
    ARRAY = 2
    PROG_ARRAY = 3
    PERF_EVENT_ARRAY = 4
    PERCPU_HASH = 5
    PERCPU_ARRAY = 6
    STACK_TRACE = 7
    CGROUP_ARRAY = 8
    LRU_HASH = 9
    LRU_PERCPU_HASH = 10
    LPM_TRIE = 11
    ARRAY_OF_MAPS = 12
    HASH_OF_MAPS = 13
    DEVMAP = 14
    SOCKMAP = 15
    CPUMAP = 16
    XSKMAP = 17
    SOCKHASH = 18
    CGROUP_STORAGE = 19
    REUSEPORT_SOCKARRAY = 20
    PERCPU_CGROUP_STORAGE = 21
    QUEUE = 22
    STACK = 23
    SK_STORAGE = 24
    DEVMAP_HASH = 25
    STRUCT_OPS = 26
    RINGBUF = 27
    INODE_STORAGE = 28
    TASK_STORAGE = 29
    BLOOM_FILTER = 30
    USER_RINGBUF = 31
    CGRP_STORAGE = 32
    ARENA = 33

    @classmethod
    def _missing_(cls, value: object) -> MapType | None:
        # A newer kernel than this list: keep the number rather than fail.
        if not isinstance(value, int):
            return None
        member = int.__new__(cls, value)
        member._name_ = f"TYPE_{value}"
        member._value_ = value
        return member

    @property
    def percpu(self) -> bool:
        return self in _PERCPU


_PERCPU = frozenset(
    {
        MapType.PERCPU_HASH,
        MapType.PERCPU_ARRAY,
        MapType.LRU_PERCPU_HASH,
        MapType.PERCPU_CGROUP_STORAGE,
    }
)
_ARRAYS = frozenset({MapType.ARRAY, MapType.PERCPU_ARRAY})
#: Hash maps with BPF_MAP_LOOKUP_BATCH (an LPM trie has none).
_BATCHED = frozenset({MapType.HASH, MapType.LRU_HASH, MapType.PERCPU_HASH, MapType.LRU_PERCPU_HASH})


def possible_cpus() -> int:
    """Number of possible CPUs (the per-CPU value count), libbpf_num_possible_cpus."""
    return check(lib.libbpf_num_possible_cpus(), "libbpf_num_possible_cpus")


def _round8(n: int) -> int:
    return (n + 7) & ~7


class Map(Closing):
    """An open BPF map. Owns its file descriptor (closed by close() or on collection)."""

    def __init__(self, fd: int, name: str | None = None) -> None:
        """Wrap ``fd`` (ownership is taken); attributes come from the kernel's map info."""
        self._fd = fd
        try:
            info = obj_info(fd, "bpf_map_info", "bpf_obj_get_info_by_fd(map)")
        except BaseException:
            close_fd(fd)
            self._fd = -1
            raise
        self.id: int = info.id
        self.type: MapType = MapType(info.type)
        self.key_size: int = info.key_size
        self.value_size: int = info.value_size
        self.max_entries: int = info.max_entries
        self.flags: int = info.map_flags
        #: The map's type information (0: none): its BTF object and the key's and value's
        #: type ids in it (xdplb.datapath.layout reads layouts through them).
        self.btf_id: int = info.btf_id
        self.btf_key_type_id: int = info.btf_key_type_id
        self.btf_value_type_id: int = info.btf_value_type_id
        # The kernel keeps 15 characters of the name; libbpf knows the whole one.
        self.name: str = name if name is not None else ffi.string(info.name).decode()
        #: Bytes the kernel reads or writes for one value (all CPUs for per-CPU maps).
        self.value_stride: int = (
            possible_cpus() * _round8(self.value_size) if self.type.percpu else self.value_size
        )

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_pinned(cls, path: StrPath) -> Map:
        return cls(obj_get(str(path), "bpf_obj_get"))

    @classmethod
    def from_id(cls, map_id: int) -> Map:
        return cls(check(lib.bpf_map_get_fd_by_id(map_id), f"bpf_map_get_fd_by_id({map_id})"))

    @classmethod
    def from_fd(cls, fd: int, name: str | None = None) -> Map:
        """A handle on a duplicate of ``fd``; the caller keeps ownership of ``fd``."""
        return cls(dup_fd(fd), name)

    @classmethod
    def create(
        cls,
        map_type: MapType | int,
        key_size: int,
        value_size: int,
        max_entries: int,
        *,
        name: str = "",
        flags: int = 0,
        inner_map_fd: int | None = None,
    ) -> Map:
        """bpf_map_create. ``inner_map_fd`` is the template of a map-in-map outer map."""
        opts = new_opts("bpf_map_create_opts", map_flags=flags)
        if inner_map_fd is not None:
            opts.inner_map_fd = inner_map_fd
        c_name = name.encode() if name else ffi.NULL
        fd = lib.bpf_map_create(int(map_type), c_name, key_size, value_size, max_entries, opts)
        return cls(check(fd, f"bpf_map_create({name or MapType(map_type).name})"), name or None)

    # -- lifetime ---------------------------------------------------------------------

    @property
    def fd(self) -> int:
        return self._fd

    def pin(self, path: StrPath) -> None:
        obj_pin(self._fd, str(path), f"bpf_obj_pin(map {self.name})")

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        close_fd(fd)

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Map({self.name!r}, {self.type.name}, key={self.key_size}, "
            f"value={self.value_size}, max={self.max_entries}, id={self.id})"
        )

    # -- single elements ---------------------------------------------------------------

    def _key(self, key: BytesLike) -> Any:
        buf = ffi.from_buffer(key)
        if len(buf) != self.key_size:
            raise ValueError(f"map {self.name}: key is {len(buf)} bytes, want {self.key_size}")
        return buf

    def lookup(self, key: BytesLike, flags: int = 0) -> bytes | None:
        """The value at ``key``, or None. Per-CPU maps return every CPU's value, raw."""
        value = ffi.new("char[]", self.value_stride)
        ret = lib.bpf_map_lookup_elem_flags(self._fd, self._key(key), value, flags)
        if ret == -errno.ENOENT:
            return None
        check(ret, f"bpf_map_lookup_elem({self.name})")
        return bytes(ffi.buffer(value))

    def lookup_percpu(self, key: BytesLike) -> list[bytes]:
        """One value_size value per possible CPU; [] if the key is absent."""
        if not self.type.percpu:
            raise ValueError(f"map {self.name} is not per-CPU ({self.type.name})")
        raw = self.lookup(key)
        if raw is None:
            return []
        step = _round8(self.value_size)
        return [raw[i : i + self.value_size] for i in range(0, len(raw), step)]

    def update(self, key: BytesLike, value: BytesLike, flags: int = BPF_ANY) -> None:
        val = ffi.from_buffer(value)
        if len(val) != self.value_stride:
            raise ValueError(
                f"map {self.name}: value is {len(val)} bytes, want {self.value_stride}"
            )
        check(
            lib.bpf_map_update_elem(self._fd, self._key(key), val, flags),
            f"bpf_map_update_elem({self.name})",
        )

    def delete(self, key: BytesLike) -> bool:
        """Delete ``key``; False if it was absent."""
        ret = lib.bpf_map_delete_elem(self._fd, self._key(key))
        if ret == -errno.ENOENT:
            return False
        check(ret, f"bpf_map_delete_elem({self.name})")
        return True

    # -- iteration -------------------------------------------------------------------

    def keys(self) -> Iterator[bytes]:
        """Every key, via bpf_map_get_next_key. Deleting while iterating may restart a
        hash map walk: take ``list(m.keys())`` first."""
        nxt = ffi.new("char[]", self.key_size)
        prev: Any = ffi.NULL
        while True:
            ret = lib.bpf_map_get_next_key(self._fd, prev, nxt)
            if ret == -errno.ENOENT:
                return
            check(ret, f"bpf_map_get_next_key({self.name})")
            key = ffi.buffer(nxt)[:]
            yield key
            prev = ffi.from_buffer(key)

    def __iter__(self) -> Iterator[bytes]:
        return self.keys()

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        for key in self.keys():
            value = self.lookup(key)
            if value is not None:  # deleted since get_next_key
                yield key, value

    def count(self) -> int:
        """Entries in a hash-like map (hash, LRU, LPM trie): one batch lookup where the
        map type has it, a key walk otherwise. Arrays always hold max_entries."""
        if self.type in _ARRAYS:
            return self.max_entries
        if self.type in _BATCHED:
            try:
                return self.lookup_batch()[2]
            except BpfError as e:
                if e.errno not in (errno.EINVAL, 524, errno.EOPNOTSUPP):  # 524: ENOTSUPP
                    raise
        return sum(1 for _ in self.keys())

    # -- batches -----------------------------------------------------------------------

    def update_batch(self, keys: BytesLike, values: BytesLike, count: int, flags: int = 0) -> None:
        """bpf_map_update_batch over ``count`` packed keys and values (no copy: numpy
        arrays and other buffers are passed to the kernel as they are)."""
        kbuf = ffi.from_buffer(keys)
        vbuf = ffi.from_buffer(values)
        if len(kbuf) < count * self.key_size or len(vbuf) < count * self.value_stride:
            raise ValueError(
                f"map {self.name}: {count} entries need {count * self.key_size} key bytes and "
                f"{count * self.value_stride} value bytes, got {len(kbuf)} and {len(vbuf)}"
            )
        n = ffi.new("__u32 *", count)
        opts = new_opts("bpf_map_batch_opts", elem_flags=flags)
        ret = lib.bpf_map_update_batch(self._fd, kbuf, vbuf, n, opts)
        check(ret, f"bpf_map_update_batch({self.name}, {n[0]}/{count} done)")

    def lookup_batch(self, flags: int = 0) -> tuple[bytes, bytes, int]:
        """The whole map: (concatenated keys, concatenated values, count).

        ``flags`` are element flags (BPF_F_LOCK)."""
        ks, vs, cap = self.key_size, self.value_stride, self.max_entries
        keys = ffi.new("char[]", cap * ks)
        values = ffi.new("char[]", cap * vs)
        # The batch cursor is a bucket number (hash) or a key (array): room for both.
        token_size = max(ks, 8)
        out_token = ffi.new("char[]", token_size)
        in_token = ffi.new("char[]", token_size)
        cursor: Any = ffi.NULL
        opts = new_opts("bpf_map_batch_opts", elem_flags=flags)
        total = 0
        while total < cap:
            n = ffi.new("__u32 *", cap - total)
            ret = lib.bpf_map_lookup_batch(
                self._fd, cursor, out_token, keys + total * ks, values + total * vs, n, opts
            )
            total += n[0]
            if ret == -errno.ENOENT:  # end of map; n holds the last partial batch
                break
            check(ret, f"bpf_map_lookup_batch({self.name})")
            ffi.memmove(in_token, out_token, token_size)
            cursor = in_token
        return ffi.buffer(keys, total * ks)[:], ffi.buffer(values, total * vs)[:], total

    def _require_array(self) -> None:
        if self.type not in _ARRAYS or self.key_size != 4:
            raise ValueError(f"map {self.name} is not an array map ({self.type.name})")

    def update_array(self, values: BytesLike, flags: int = 0) -> None:
        """Write indices 0..n-1 from n packed values, in one bpf_map_update_batch call
        (``flags``: element flags, BPF_F_LOCK).

        Not atomic with respect to the data path: swap whole tables for that.
        """
        self._require_array()
        nbytes = len(ffi.from_buffer(values))
        count, rest = divmod(nbytes, self.value_stride)
        if rest or count > self.max_entries:
            raise ValueError(
                f"map {self.name}: {nbytes} bytes is not n * {self.value_stride} "
                f"with n <= {self.max_entries}"
            )
        if count:
            self.update_batch(numpy.arange(count, dtype=numpy.uint32), values, count, flags)

    def lookup_array(self, flags: int = 0) -> bytes:
        """Every value of an array map, indices 0..max_entries-1, concatenated."""
        self._require_array()
        _, values, _ = self.lookup_batch(flags)
        return values

    def lookup_array_range(self, start: int, count: int, flags: int = 0) -> bytes:
        """Values of indices ``start`` .. ``start + count - 1`` of an array map (fewer at
        its end), concatenated: one bpf_map_lookup_batch call. Its cursor is the key
        before the batch (the kernel walks get_next_key from it), none for index 0."""
        self._require_array()
        count = max(0, min(count, self.max_entries - start))
        if count == 0:
            return b""
        ks, vs = self.key_size, self.value_stride
        keys = ffi.new("char[]", count * ks)
        values = ffi.new("char[]", count * vs)
        in_token = ffi.new("__u32 *", start - 1 if start else 0)
        out_token = ffi.new("__u32 *")
        n = ffi.new("__u32 *", count)
        opts = new_opts("bpf_map_batch_opts", elem_flags=flags)
        ret = lib.bpf_map_lookup_batch(
            self._fd, in_token if start else ffi.NULL, out_token, keys, values, n, opts
        )
        if ret != -errno.ENOENT:  # ENOENT: the map ended within the batch
            check(ret, f"bpf_map_lookup_batch({self.name}, from {start})")
        return bytes(ffi.buffer(values, n[0] * vs))
