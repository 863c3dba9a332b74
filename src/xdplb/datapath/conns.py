"""``lb_conns`` from user space: the set-associative connection table.

lb_xdp keeps flows in an ARRAY of sets (``struct xdplb_conn_set``; as many as the map's
max_entries, ``limits.conn_table / CONN_WAYS``, ``abi.CONN_SETS`` by default), the set of a
flow being ``flow_hash(key, hash_seed) & conn_mask`` (``lb_config``; sets - 1), each holding
``abi.CONN_WAYS`` flows with an LRU rank per way (``bpf/lib/lb_conns.h``). This module
turns that into what the rest of the code wants, a mapping of flow key bytes ->
(backend id, hash), and writes entries the way lb_xdp does.

lb_xdp takes no lock: its writers claim a set by making its ``seq`` odd (a compare-and-swap)
and make it even again when done. Every copy here is a ``BPF_F_LOCK`` one, which only
serializes user space with itself; a set read is validated by its ``seq`` instead (even, and
the same in a second copy made after the first: else it is read again), so readers never
see a half-written set. Writes cannot be ordered for lb_xdp's lockless readers and writers:
:meth:`ConnTable.put` (a read-modify-write) is for tests and tools, not for a table carrying
traffic. :meth:`ConnTable.flush` is meant for use under traffic: a read that sees part of an
entry zeroed is a miss (backend 0, tag or key not matching), or at worst carries a zero hash;
the rare race of a flush with two lb_xdp writers of one set is described in lb_conns.h.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from xdplb.core import abi, hashing
from xdplb.datapath.maps import BPF_F_LOCK, Map

WAYS = abi.CONN_WAYS
#: Sets of a connection table of the default size.
SETS = abi.CONN_SETS
SET_SIZE = ctypes.sizeof(abi.ConnSet)
_KEY = hashing.FLOW_KEY_SIZE

#: ``struct xdplb_conn_set`` as a numpy record (offsets from the ctypes mirror).
SET_DTYPE = np.dtype(
    {
        "names": ["rank", "tag", "backend_id", "hash", "seq", "slot"],
        "formats": [
            ("u1", WAYS),
            ("<u4", WAYS),
            ("<u4", WAYS),
            ("<u4", WAYS),
            "<u4",
            (("V", ctypes.sizeof(abi.ConnSlot)), WAYS),
        ],
        "offsets": [
            getattr(abi.ConnSet, f).offset
            for f in ("rank", "tag", "backend_id", "hash", "seq", "slot")
        ],
        "itemsize": SET_SIZE,
    }
)


#: Copies of one set tried before giving up on a set that lb_xdp keeps writing.
_READ_TRIES = 1000
#: Sets one chunk of :meth:`ConnTable.chunks` reads (320 KiB at 320 bytes a set).
CHUNK_SETS = 1024


class Entry(NamedTuple):
    """One way in use of one set, as :meth:`ConnTable.iter_entries` yields it."""

    set: int
    way: int
    key: bytes
    """The flow key (``struct xdplb_flow_key``, 40 bytes)."""
    backend_id: int
    hash: int


class TornRead(RuntimeError):
    """A set of ``lb_conns`` kept changing under every copy of it."""


def set_index(key: bytes, seed: int, sets: int = SETS) -> int:
    """The set of a flow key (40 bytes) under ``hash_seed`` ``seed`` in a table of
    ``sets`` sets (a power of 2)."""
    return hashing.flow_hash(key, seed) & (sets - 1)


def check_mask(mask: int, sets: int) -> None:
    """ValueError unless ``mask`` (``lb_config.conn_mask``) picks sets of a table of
    ``sets`` sets only, and all of them: ``mask + 1`` a power of 2, at most ``sets``."""
    n = mask + 1
    if mask < 0 or n & (n - 1) or n > sets:
        raise ValueError(
            f"conn_mask {mask:#x} does not fit lb_conns' {sets} sets (mask + 1 must be a "
            f"power of 2 no larger than the set count)"
        )


class ConnTable:
    """The ``lb_conns`` map of an instance (of any power-of-2 number of sets)."""

    def __init__(self, m: Map) -> None:
        sets = m.max_entries
        if m.value_size != SET_SIZE or sets < 1 or sets & (sets - 1):
            raise ValueError(
                f"{m!r} is not a connection table (a power of 2 of sets of {SET_SIZE} bytes)"
            )
        self.map = m
        #: Sets, and connections it holds.
        self.sets_count = sets
        self.capacity = sets * WAYS
        #: ``lb_config.conn_mask`` for this table.
        self.mask = sets - 1

    def sets(self) -> npt.NDArray[np.void]:
        """Every set, as records of :data:`SET_DTYPE`, each one consistent (seq-validated)."""
        first = np.frombuffer(self.map.lookup_array(BPF_F_LOCK), dtype=SET_DTYPE).copy()
        again = np.frombuffer(self.map.lookup_array(BPF_F_LOCK), dtype=SET_DTYPE)
        for idx in np.nonzero((first["seq"] & 1) | (first["seq"] != again["seq"]))[0]:
            first[idx] = np.frombuffer(self._read_raw(int(idx)), dtype=SET_DTYPE)[0]
        return first

    def read_sets(self, start: int, count: int) -> npt.NDArray[np.void]:
        """Sets ``start`` .. ``start + count - 1`` (fewer at the end), each seq-validated as
        :meth:`sets` does: one batch copy, a second to compare seqs, a set copy per
        set that changed."""
        first = np.frombuffer(
            self.map.lookup_array_range(start, count, BPF_F_LOCK), dtype=SET_DTYPE
        ).copy()
        again = np.frombuffer(
            self.map.lookup_array_range(start, len(first), BPF_F_LOCK), dtype=SET_DTYPE
        )
        for idx in np.nonzero((first["seq"] & 1) | (first["seq"] != again["seq"]))[0]:
            first[idx] = np.frombuffer(self._read_raw(start + int(idx)), dtype=SET_DTYPE)[0]
        return first

    def chunks(
        self, start: int = 0, chunk: int = CHUNK_SETS
    ) -> Iterator[tuple[int, npt.NDArray[np.void]]]:
        """(first set index, sets) from set ``start`` to the end, ``chunk`` sets at a time:
        a reader holds one chunk, never the table."""
        if chunk < 1:
            raise ValueError(f"chunk: must be at least 1 set, got {chunk}")
        for first in range(start, self.sets_count, chunk):
            yield first, self.read_sets(first, chunk)

    def iter_entries(self, start: int = 0, chunk: int = CHUNK_SETS) -> Iterator[Entry]:
        """Every entry from set ``start`` on, in set then way order, read by :meth:`chunks`.
        A flow that moves while the walk is under way may be seen twice or not at all
        (each set is consistent, the table as a whole is not: lb_xdp keeps writing)."""
        for first, sets in self.chunks(start, chunk):
            for s, w in zip(*np.nonzero(sets["backend_id"]), strict=True):
                rec = sets[s]
                yield Entry(
                    first + int(s),
                    int(w),
                    bytes(rec["slot"][w])[:_KEY],
                    int(rec["backend_id"][w]),
                    int(rec["hash"][w]),
                )

    def count(self) -> int:
        """Entries in the table."""
        return int(np.count_nonzero(self.sets()["backend_id"]))

    def estimate_count(self, samples: int = 2048) -> int:
        """Entries in the table, estimated from ``samples`` sets spread evenly over it:
        a few milliseconds instead of reading all of it (for status and metrics)."""
        step = max(1, self.sets_count // samples)
        used = sum(
            int(np.count_nonzero(np.frombuffer(self._read_raw(i), dtype=SET_DTYPE)["backend_id"]))
            for i in range(0, self.sets_count, step)
        )
        return used * step

    def entries(self) -> dict[bytes, tuple[int, int]]:
        """Flow key -> (backend id, hash), for every entry."""
        sets = self.sets()
        out: dict[bytes, tuple[int, int]] = {}
        for s, w in zip(*np.nonzero(sets["backend_id"]), strict=True):
            rec = sets[s]
            out[bytes(rec["slot"][w])[:_KEY]] = (int(rec["backend_id"][w]), int(rec["hash"][w]))
        return out

    def _copy(self, idx: int) -> bytes:
        raw = self.map.lookup(idx.to_bytes(4, "little"), BPF_F_LOCK)
        assert raw is not None  # an array index below max_entries
        return raw

    def _read_raw(self, idx: int) -> bytes:
        """One set, copied while no lb_xdp writer changed it (seq even and unchanged)."""
        off = abi.ConnSet.seq.offset
        raw = self._copy(idx)
        for _ in range(_READ_TRIES):
            again = self._copy(idx)
            seq = raw[off : off + 4]
            if not seq[0] & 1 and again[off : off + 4] == seq:
                return raw
            raw = again
        raise TornRead(f"lb_conns set {idx} changed under {_READ_TRIES} copies")

    def _read(self, idx: int) -> abi.ConnSet:
        return abi.ConnSet.from_buffer_copy(self._read_raw(idx))

    def get(self, key: bytes, seed: int) -> tuple[int, int] | None:
        """(backend id, hash) of a flow, or None; does not refresh it (lb_xdp does)."""
        st = self._read(set_index(key, seed, self.sets_count))
        w = _find(st, key, hashing.flow_hash(key, seed))
        return None if w is None else (st.backend_id[w], st.hash[w])

    def put(self, key: bytes, backend_id: int, hash_: int, seed: int) -> None:
        """Record a flow as lb_xdp would (replace, else an empty way, else evict the LRU)."""
        if not backend_id:
            raise ValueError("backend id 0 marks an empty way")
        idx = set_index(key, seed, self.sets_count)
        fhash = hashing.flow_hash(key, seed)
        st = self._read(idx)
        w = _find(st, key, fhash)
        rank = WAYS - 1
        if w is not None:
            rank = st.rank[w]
        else:
            empty = [i for i in range(WAYS) if not st.backend_id[i]]
            w = empty[0] if empty else max(range(WAYS), key=lambda i: (st.rank[i], -i))
        st.tag[w] = fhash
        st.backend_id[w] = backend_id
        st.hash[w] = hash_
        ctypes.memmove(ctypes.addressof(st.slot[w].key), key, _KEY)
        for i in range(WAYS):
            if st.rank[i] < rank:
                st.rank[i] += 1
        st.rank[w] = 0
        st.seq = (st.seq + 2) & 0xFFFFFFFF
        self.map.update(idx.to_bytes(4, "little"), st.pack(), BPF_F_LOCK)

    def flush(self) -> int:
        """Empty the table (each set zeroed under its lock); returns the entries it held."""
        n = self.count()
        self.map.update_array(bytes(self.sets_count * SET_SIZE), BPF_F_LOCK)
        return n


def _find(st: abi.ConnSet, key: bytes, fhash: int) -> int | None:
    for i in range(WAYS):
        if st.tag[i] == fhash and st.backend_id[i] and bytes(st.slot[i].key) == key:
            return i
    return None
