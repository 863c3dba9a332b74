"""``lb_conns`` from user space: the session table, read and written under lb_xdp's claim.

lb_xdp keeps flows in an ARRAY of sets (``struct xdplb_conn_set``; as many as the map's
max_entries, ``limits.conn_table / CONN_WAYS``): a metadata line (the claim word ``seq``,
then each way's tag, last-seen tick, generation, state and flags), then a line per way
(the flow key, backend and later hops, table hash). A flow's set is ``sess_hash(key,
hash_seed) & conn_mask`` (the hash's multipliers drawn from the seed). The map is mapped
into this process (BPF_F_MMAPABLE) and every read and write goes through sessions.c
(compiled into ``_libbpf_c``), which speaks the program's claim protocol in C11 atomics: a
copy is taken between two loads of ``seq`` that agree and are even, a write claims the set
(``seq`` odd), writes and releases it. So user space never tears a session lb_xdp is
reading, nor reads a torn one, on any CPU.

Flushing is not a write here: it is a new ``conn_gen`` in ``lb_config``
(:meth:`xdplb.datapath.lb.LbMaps.flush_conns`); sessions of an older generation are
misses to lb_xdp and free ways to its inserts. :class:`SessionExport` reads the stream
of sessions lb_xdp records (``lb_sess_export``), what session sync will send.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xdplb.core import abi, hashing
from xdplb.core.closing import Closing
from xdplb.core.state import session_age
from xdplb.datapath._ffi import ffi, lib
from xdplb.datapath.clock import now_ticks
from xdplb.datapath.maps import Map
from xdplb.datapath.ringbuf import RingReader

WAYS = abi.CONN_WAYS
#: Sets of a session table of the default size.
SETS = abi.CONN_SETS
SET_SIZE = ctypes.sizeof(abi.ConnSet)
SESSION_SIZE = ctypes.sizeof(abi.Session)
_KEY = hashing.FLOW_KEY_SIZE
#: Copies of a way a writer keeps holding before a reader gives up on it.
_TRIES = 1000
#: Sets one chunk of :meth:`ConnTable.chunks` reads (256 KiB at 256 bytes a set).
CHUNK_SETS = 1024

_E = abi.Session.entry.offset
#: ``struct xdplb_session`` as a numpy record (offsets from the ctypes mirror). Ports are
#: the raw ``__be16`` words, as in the flow key.
SESSION_DTYPE = np.dtype(
    {
        "names": [
            "last_seen", "gen", "state", "flags",
            "src", "dst", "sport", "dport", "proto", "be_gen", "hop", "hash",
        ],
        "formats": [
            "<u4", "<u2", "u1", "u1",
            ("<u4", 4), ("<u4", 4), "<u2", "<u2", "u1", "u1", ("<u2", abi.MAX_HOPS), "<u4",
        ],
        "offsets": [
            abi.Session.last_seen.offset,
            abi.Session.gen.offset,
            abi.Session.state.offset,
            abi.Session.flags.offset,
            *(_E + getattr(abi.ConnEntry, f).offset
              for f in ("src", "dst", "sport", "dport", "proto", "be_gen", "hop", "hash")),
        ],
        "itemsize": SESSION_SIZE,
    }
)  # fmt: skip


#: ``struct xdplb_export_rec`` (an ``lb_sess_export`` record) as a numpy record.
EXPORT_DTYPE = np.dtype(
    {
        "names": ["type", "set", "way", "sess"],
        "formats": ["<u4", "<u4", "<u4", SESSION_DTYPE],
        "offsets": [
            abi.ExportRec.type.offset,
            abi.ExportRec.set.offset,
            abi.ExportRec.way.offset,
            abi.ExportRec.sess.offset,
        ],
        "itemsize": ctypes.sizeof(abi.ExportRec),
    }
)


class ImportResult(enum.IntEnum):
    """What an import did with one session (sessions.c, XDPLB_IMPORT_*)."""

    WRITTEN = 0  # into a free way
    REPLACED = 1  # over the flow's own session
    EVICTED = 2  # over another flow's live session: the set was full
    PRESENT = 3  # the flow had a live session and replace was not asked
    BUSY = 4  # the ways stayed held by other writers


class ImportMode(enum.IntEnum):
    """What an import does with a flow that has a live session (sessions.c)."""

    KEEP = 0  # leave it: PRESENT
    OVERWRITE = 1  # overwrite it: REPLACED
    NEWER = 2  # advance its last_seen when the import's is later (REPLACED), else PRESENT;
    # nothing else of it changes (a peer's refresh must not move the flow)


@dataclass(frozen=True)
class Entry:
    """One session of the table, as a validated copy holds it."""

    set: int
    way: int
    key: bytes
    """The flow key (``struct xdplb_flow_key``, 40 bytes)."""
    hops: tuple[int, ...]
    """Backend ids: the backend first, then later hops (Beamer), zeros left out."""
    hash: int
    state: abi.SessState
    last_seen: int
    """Tick (jiffies, :func:`xdplb.datapath.clock.now_ticks`) of its last packet."""
    gen: int
    flags: int
    be_gen: int

    @property
    def backend_id(self) -> int:
        return self.hops[0] if self.hops else 0

    def age(self, now: int) -> int:
        """Ticks since its last packet: a signed difference of ``__u32`` ticks, a stamp
        ahead of ``now`` counting as just seen (as lb_sess_age())."""
        return session_age(self.last_seen, now)

    def live(self, gen: int, timeouts: Sequence[int], now: int) -> bool:
        """Of generation ``gen`` and within its state's timeout (``conn_timeout``, ticks)
        at tick ``now``: what lb_xdp's lookup checks before the backend."""
        return self.gen == gen and self.age(now) <= timeouts[self.state]


def key_of(rec: np.void) -> bytes:
    """The 40-byte flow key of a session record."""
    out = bytearray(_KEY)
    out[0:16] = rec["src"].tobytes()
    out[16:32] = rec["dst"].tobytes()
    out[32:34] = int(rec["sport"]).to_bytes(2, "little")
    out[34:36] = int(rec["dport"]).to_bytes(2, "little")
    out[36] = int(rec["proto"])
    return bytes(out)


def _entry(pos: int, rec: np.void) -> Entry:
    return Entry(
        pos // WAYS,
        pos % WAYS,
        key_of(rec),
        tuple(int(h) for h in rec["hop"] if h),
        int(rec["hash"]),
        abi.SessState(int(rec["state"]) & 3),
        int(rec["last_seen"]),
        int(rec["gen"]),
        int(rec["flags"]),
        int(rec["be_gen"]),
    )


def session(
    key: bytes,
    hops: Sequence[int],
    hash_: int,
    state: abi.SessState,
    last_seen: int,
    *,
    be_gen: int = 0,
) -> abi.Session:
    """A session to import: ``key`` a 40-byte flow key, ``hops`` backend ids (1 to 4)."""
    if not 1 <= len(hops) <= abi.MAX_HOPS or not hops[0]:
        raise ValueError(f"hops: 1 to {abi.MAX_HOPS} backend ids, the first not 0: {hops}")
    if any(not 0 <= h <= 0xFFFF for h in hops):
        raise ValueError(f"hops: backend ids fit 16 bits: {hops}")
    k = abi.FlowKey.from_buffer_copy(key)
    s = abi.Session()
    s.last_seen = last_seen & 0xFFFFFFFF
    s.state = state
    e = s.entry
    e.src[:] = k.src
    e.dst[:] = k.dst
    e.sport, e.dport, e.proto = k.sport, k.dport, k.proto
    e.be_gen = be_gen
    e.hop[: len(hops)] = hops
    e.hash = hash_
    return s


class ConnTable(Closing):
    """The ``lb_conns`` map of an instance (any power-of-2 number of sets), mapped."""

    def __init__(self, m: Map) -> None:
        sets = m.max_entries
        if m.value_size != SET_SIZE or sets < 1 or sets & (sets - 1):
            raise ValueError(
                f"{m!r} is not a session table (a power of 2 of sets of {SET_SIZE} bytes)"
            )
        self.map = m
        #: Sets, and sessions it holds.
        self.sets_count = sets
        self.capacity = sets * WAYS
        #: ``lb_config.conn_mask`` for this table.
        self.mask = sets - 1
        self._mm = mmap.mmap(m.fd, sets * SET_SIZE, mmap.MAP_SHARED)
        self._base = ffi.from_buffer(self._mm)

    def close(self) -> None:
        self._base = None
        self._mm.close()

    # -- reading ------------------------------------------------------------------------

    def read(
        self, start: int = 0, count: int | None = None
    ) -> tuple[npt.NDArray[np.void], npt.NDArray[np.uint32]]:
        """Every way in use of sets ``start`` .. ``start + count - 1``, each a validated
        copy: (records of :data:`SESSION_DTYPE`, positions set x WAYS + way)."""
        count = self.sets_count - start if count is None else min(count, self.sets_count - start)
        cap = max(count, 0) * WAYS
        out = np.zeros(cap, dtype=SESSION_DTYPE)
        pos = np.zeros(cap, dtype=np.uint32)
        if cap == 0:
            return out, pos
        busy = ffi.new("uint32_t *")
        n = lib.xdplb_sess_read(
            self._base,
            start,
            count,
            ffi.cast("struct xdplb_session *", ffi.from_buffer(out)),
            ffi.cast("uint32_t *", ffi.from_buffer(pos)),
            cap,
            _TRIES,
            busy,
        )
        return out[:n], pos[:n]

    def chunks(
        self, start: int = 0, chunk: int = CHUNK_SETS
    ) -> Iterator[tuple[npt.NDArray[np.void], npt.NDArray[np.uint32]]]:
        """:meth:`read` from set ``start`` to the end, ``chunk`` sets at a time: a reader
        holds one chunk, never the table."""
        if chunk < 1:
            raise ValueError(f"chunk: must be at least 1 set, got {chunk}")
        for first in range(start, self.sets_count, chunk):
            yield self.read(first, chunk)

    def iter_entries(self, start: int = 0, chunk: int = CHUNK_SETS) -> Iterator[Entry]:
        """Every session from set ``start`` on, in table order (live or not: see
        :meth:`Entry.live`). A flow that moves while the walk is under way may be seen
        twice or not at all: each session is consistent, the table as a whole is not."""
        for recs, pos in self.chunks(start, chunk):
            for i in range(len(recs)):
                yield _entry(int(pos[i]), recs[i])

    def entries(self) -> dict[bytes, Entry]:
        """Flow key -> session, for every way in use (the first, if a flow has two)."""
        out: dict[bytes, Entry] = {}
        for e in self.iter_entries():
            out.setdefault(e.key, e)
        return out

    def count(self, gen: int | None = None, timeouts: Sequence[int] | None = None) -> int:
        """Ways in use; of generation ``gen`` and within ``timeouts`` (ticks) when given:
        the live sessions."""
        now = now_ticks()
        return sum(_live(recs, gen, timeouts, now) for recs, _ in self.chunks())

    def estimate_count(
        self, samples: int = 2048, gen: int | None = None, timeouts: Sequence[int] | None = None
    ) -> int:
        """:meth:`count` estimated from ``samples`` sets spread evenly over the table: a
        few milliseconds instead of reading all of it (for status and metrics)."""
        step = max(1, self.sets_count // samples)
        now = now_ticks()
        used = sum(
            _live(self.read(i, 1)[0], gen, timeouts, now) for i in range(0, self.sets_count, step)
        )
        return used * step

    def get(self, key: bytes, seed: int) -> Entry | None:
        """The flow's session as lb_xdp's lookup finds it (live or not), or None."""
        if len(key) != _KEY:
            raise ValueError(f"a flow key is {_KEY} bytes, got {len(key)}")
        out = ffi.new("struct xdplb_session *")
        pos = ffi.new("uint32_t *")
        k = ffi.cast("struct xdplb_flow_key *", ffi.from_buffer(key))
        rc = lib.xdplb_sess_get(self._base, self.mask, seed, k, _TRIES, out, pos)
        if rc < 0:
            raise TornRead(f"the set of {key.hex()} kept being written")
        if rc:
            return None
        rec = np.frombuffer(bytes(ffi.buffer(out)), dtype=SESSION_DTYPE)[0]
        return _entry(int(pos[0]), rec)

    # -- writing ------------------------------------------------------------------------

    def wipe(self) -> None:
        """Zero the whole table, for tests between cases: not under the claim, so only
        while no program runs on it. A table carrying traffic is flushed with a new
        generation instead (:meth:`xdplb.datapath.lb.LbMaps.flush_conns`)."""
        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(self._mm)), 0, len(self._mm))

    def import_sessions(
        self,
        sessions: Sequence[abi.Session],
        *,
        seed: int,
        gen: int,
        timeouts: Sequence[int],
        now: int | None = None,
        replace: bool | ImportMode = False,
    ) -> list[ImportResult]:
        """Write ``sessions`` into their sets under the claim, as this table's generation
        ``gen`` (``lb_config``'s ``hash_seed``, ``conn_gen`` and ``conn_timeout`` say
        where and what is live). ``replace``: True or :attr:`ImportMode.OVERWRITE`, a
        flow's live session is overwritten; False or ``KEEP``, it is kept (PRESENT);
        ``NEWER``, only its last-seen tick moves, forward. Each session written keeps its
        ``last_seen``; it is marked SESS_F_IMPORTED."""
        buf = b"".join(bytes(s) for s in sessions)
        records = np.frombuffer(buf, dtype=SESSION_DTYPE)
        out = self.import_records(
            records, seed=seed, gen=gen, timeouts=timeouts, now=now, replace=replace
        )
        return [ImportResult(int(r)) for r in out]

    def import_records(
        self,
        records: npt.NDArray[np.void],
        *,
        seed: int,
        gen: int,
        timeouts: Sequence[int],
        now: int | None = None,
        replace: bool | ImportMode = False,
    ) -> npt.NDArray[np.uint8]:
        """:meth:`import_sessions` of records of :data:`SESSION_DTYPE` (as :meth:`read`
        returns them, or as :func:`records` builds them), without a Python object per
        session; returns each one's :class:`ImportResult` value."""
        if records.dtype.itemsize != SESSION_SIZE:
            raise ValueError(f"records of {records.dtype.itemsize} bytes, not {SESSION_SIZE}")
        records = np.ascontiguousarray(records)
        n = len(records)
        result = np.zeros(n, dtype=np.uint8)
        if n == 0:
            return result
        tmo = ffi.new("uint32_t[]", [int(t) for t in timeouts])
        lib.xdplb_sess_import(
            self._base,
            self.mask,
            seed,
            gen,
            now_ticks() if now is None else now,
            tmo,
            ffi.cast("struct xdplb_session *", ffi.from_buffer(records)),
            n,
            int(replace),
            _TRIES,
            ffi.cast("uint8_t *", ffi.from_buffer(result)),
        )
        return result


class SessionExport(Closing):
    """The consumer side of ``lb_sess_export``: one :class:`abi.ExportRec` for each session
    lb_xdp records (``EXPORT_NEW``) or moves to another state (``EXPORT_UPDATE``) while
    ``lb_config`` has ``CFG_F_EXPORT``. lb_xdp never waits for room: a record that finds
    the ring full is counted (``EXPORT_DROP``) and the packet goes on."""

    #: Bytes a record takes in the ring: the kernel's 8-byte header, the record, 8-aligned.
    RECORD_BYTES = (8 + ctypes.sizeof(abi.ExportRec) + 7) & ~7

    def __init__(self, ring: Map) -> None:
        self._ring = RingReader(ring)
        #: Records the ring holds when nobody reads it.
        self.capacity = ring.max_entries // self.RECORD_BYTES

    def skip(self) -> None:
        """Forget what the ring holds (records from before this reader wanted them)."""
        self._ring.skip()

    def wait(self, timeout_s: float) -> bool:
        """Until a record is there or ``timeout_s`` passed; True if one is."""
        return self._ring.wait(timeout_s)

    def drain_records(self, limit: int | None = None) -> npt.NDArray[np.void]:
        """The records submitted so far, oldest first (at most ``limit``), consumed, as
        records of :data:`EXPORT_DTYPE`."""
        return self._ring.drain_array(EXPORT_DTYPE, limit)

    def close(self) -> None:
        self._ring.close()


def records(
    keys: npt.NDArray[np.uint32],
    backend: npt.NDArray[np.uint16],
    hashes: npt.NDArray[np.uint32],
    state: abi.SessState,
    last_seen: int,
) -> npt.NDArray[np.void]:
    """Sessions as records of :data:`SESSION_DTYPE`, many at once: ``keys`` an ``(n, 10)``
    array of flow-key words (``struct xdplb_flow_key``), one backend id and hash each."""
    n = len(keys)
    out = np.zeros(n, dtype=SESSION_DTYPE)
    out["src"] = keys[:, 0:4]
    out["dst"] = keys[:, 4:8]
    out["sport"] = keys[:, 8] & 0xFFFF
    out["dport"] = keys[:, 8] >> 16
    out["proto"] = keys[:, 9] & 0xFF
    out["hop"][:, 0] = backend
    out["hash"] = hashes
    out["state"] = state
    out["last_seen"] = last_seen
    return out


def _live(
    recs: npt.NDArray[np.void], gen: int | None, timeouts: Sequence[int] | None, now: int
) -> int:
    return int(np.count_nonzero(live_mask(recs, gen, timeouts, now)))


def live_mask(
    recs: npt.NDArray[np.void], gen: int | None, timeouts: Sequence[int] | None, now: int
) -> npt.NDArray[np.bool_]:
    """Which records of :data:`SESSION_DTYPE` are of generation ``gen`` and within
    ``timeouts`` (ticks) at tick ``now`` (either check left out when None)."""
    keep = np.ones(len(recs), dtype=bool)
    if gen is not None:
        keep &= recs["gen"] == gen
    if timeouts is not None:
        age = (np.uint32(now) - recs["last_seen"]).astype(np.uint32).view(np.int32)
        age = np.maximum(age, 0).astype(np.uint32)
        keep &= age <= np.asarray(timeouts, dtype=np.uint32)[recs["state"] & 3]
    return keep


class TornRead(RuntimeError):
    """A set of ``lb_conns`` kept being written under every copy of it."""


def set_index(key: bytes, seed: int, sets: int = SETS) -> int:
    """The set of a flow key (40 bytes) under ``hash_seed`` ``seed`` in a table of
    ``sets`` sets (a power of 2)."""
    return hashing.sess_hash(key, seed) & (sets - 1)


def check_mask(mask: int, sets: int) -> None:
    """ValueError unless ``mask`` (``lb_config.conn_mask``) picks sets of a table of
    ``sets`` sets only, and all of them: ``mask + 1`` a power of 2, at most ``sets``."""
    n = mask + 1
    if mask < 0 or n & (n - 1) or n > sets:
        raise ValueError(
            f"conn_mask {mask:#x} does not fit lb_conns' {sets} sets (mask + 1 must be a "
            f"power of 2 no larger than the set count)"
        )
