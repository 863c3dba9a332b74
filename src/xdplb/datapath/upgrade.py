"""Carrying the session table from one map layout to another (docs/operations.md,
"Upgrades").

A daemon whose lb_xdp has another layout (``XDPLB_ABI_VERSION``) than the maps an
instance has pinned loads its own maps beside them, then copies every session across:
:class:`OldTable` reads the old ``lb_conns`` through the BTF its map carries, finding each
way's fields by name, so the same code reads the legacy layout (per-way arrays in the
set, the key in ``slot[w].key``), today's (``meta`` + ``way[]``) and any later one that
keeps the names. A session's backend (and later hops) are carried by address: the old
``lb_backends`` says which address an old id names, the new maps which id that address
has now. :func:`copy_sessions` imports them with ``replace=False``, so what the new
program has already recorded wins.

What is required of an old layout: the key's fields (``src``, ``dst``, ``sport``,
``dport``, ``proto``) and the backend (``hop`` or ``backend_id``) per way, and ``addr``
and ``family`` in ``lb_backends``. Everything else has a default: no ``last_seen`` is
now, no ``state`` is TCP_EST for TCP and UDP otherwise, no ``flags`` means a way is in
use when it names a backend, no ``gen`` means the current generation.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import logging
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress
from xdplb.core.btf import Btf, BtfError, Field, Kind
from xdplb.core.closing import Closing
from xdplb.core.errors import XdplbError
from xdplb.core.hashing import FLOW_KEY_SIZE
from xdplb.datapath import layout
from xdplb.datapath.clock import now_ticks
from xdplb.datapath.conns import ConnTable, ImportResult, session
from xdplb.datapath.maps import Map

log = logging.getLogger("xdplb.datapath.upgrade")

#: A way's flow key, in ``struct xdplb_flow_key`` order.
KEY_FIELDS = ("src", "dst", "sport", "dport", "proto")
#: The way's backend: the hop list (backend first), or the legacy single backend id.
BACKEND_FIELDS = ("hop", "backend_id")
#: Per-way fields read when the layout has them.
OPTIONAL_FIELDS = ("hash", "state", "last_seen", "gen", "flags", "be_gen")
#: Sets read per batch (a few MiB at most).
CHUNK_SETS = 4096
#: Copies of a set that a writer kept changing before it is given up (counted busy).
_TRIES = 100
_U32 = struct.Struct("<I")


class UpgradeRefused(XdplbError):
    """The instance's pinned layout cannot be migrated: nothing was attached or removed,
    and the old program keeps forwarding."""


def _refusal(instance: str, old: int, new: int, cause: str) -> UpgradeRefused:
    return UpgradeRefused(
        f"instance {instance}: cannot migrate the session table from layout "
        f"{paths.layout_name(old)} to {paths.layout_name(new)}: {cause}. Nothing was "
        f"attached or removed: the running lb_xdp keeps forwarding. To start afresh, run "
        f"`xdplb stop -i {instance}` (it detaches lb_xdp and drops every connection), then "
        f"start this release; or run the xdplb release that made these pins"
    )


class LayoutError(ValueError):
    """A map's layout lacks what a migration needs (the message names it)."""


@dataclass(frozen=True)
class WayFields:
    """Where each field of each way of a set lies: name -> [way] -> its elements
    (one for a scalar, ``n`` for an array such as ``src[4]`` or ``hop[4]``)."""

    ways: int
    by_name: dict[str, list[list[Field]]]
    seq: Field | None

    @classmethod
    def find(cls, btf: Btf, tid: int) -> WayFields:
        """The fields of a session set (``struct xdplb_conn_set`` of any layout) by name:
        inside the way array (the array of structs holding ``src``), else in a per-way
        array outside it (``meta.tag[w]``, ``backend_id[w]``). LayoutError if a required
        field is missing."""
        fields = btf.fields(tid)
        anchor = next((f for f in fields if f.leaf == "src"), None)
        if anchor is None:
            raise LayoutError("no field src: no way array found")
        k = next((i for i, p in enumerate(anchor.path) if isinstance(p, int)), None)
        if k is None:
            raise LayoutError(f"{anchor.name} is not inside an array of ways")
        prefix = anchor.path[:k]
        inside: dict[str, dict[int, list[tuple[tuple[str | int, ...], Field]]]] = {}
        outside: list[Field] = []
        for f in fields:
            if f.path[:k] == prefix and len(f.path) > k and isinstance(f.path[k], int):
                sub = f.path[k + 1 :]
                inside.setdefault(f.leaf, {}).setdefault(int(f.path[k]), []).append((sub, f))
            else:
                outside.append(f)
        ways = 1 + max(int(f.path[k]) for f in fields if f.path[:k] == prefix and
                       len(f.path) > k and isinstance(f.path[k], int))  # fmt: skip
        by_name: dict[str, list[list[Field]]] = {}
        for name in (*KEY_FIELDS, *BACKEND_FIELDS, *OPTIONAL_FIELDS):
            found = _inside(inside.get(name, {}), ways)
            if found is None:
                found = _outside(outside, name, ways)
            if found is not None:
                by_name[name] = found
        seq = next((f for f in outside if f.leaf == "seq" and f.path[-1] == "seq"), None)
        missing = [n for n in KEY_FIELDS if n not in by_name]
        if missing:
            raise LayoutError(
                f"no field {', '.join(missing)} in a way (the flow key is {', '.join(KEY_FIELDS)})"
            )
        if not any(n in by_name for n in BACKEND_FIELDS):
            raise LayoutError(f"no backend in a way (a field {' or '.join(BACKEND_FIELDS)})")
        return cls(ways, by_name, seq)


def _inside(
    per_way: dict[int, list[tuple[tuple[str | int, ...], Field]]], ways: int
) -> list[list[Field]] | None:
    if len(per_way) != ways:
        return None
    out = []
    for w in range(ways):
        items = per_way[w]
        # The first sub-path holding the name (a layout with two would be ambiguous).
        first = _stem(items[0][0])
        out.append([f for sub, f in items if _stem(sub) == first])
    return out


def _stem(sub: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """A path up to its last member name (``("key", "src", 3)`` -> ``("key", "src")``)."""
    i = max(j for j, p in enumerate(sub) if isinstance(p, str))
    return sub[: i + 1]


def _outside(fields: list[Field], name: str, ways: int) -> list[list[Field]] | None:
    """``name[w]`` (or ``name[w][i]``) outside the way array, ``ways`` long."""
    cands = [f for f in fields if f.leaf == name and isinstance(f.path[-1], int)]
    if not cands:
        return None
    stem = _stem(cands[0].path)
    cands = [f for f in cands if _stem(f.path) == stem]
    idx = len(stem)
    per: list[list[Field]] = [[] for _ in range(ways)]
    for f in cands:
        w = f.path[idx]
        if not isinstance(w, int) or w >= ways:
            return None
        per[w].append(f)
    return per if all(per) else None


def _dtype(fields: dict[str, Field], itemsize: int) -> np.dtype[np.void]:
    """A numpy record of the scalars ``fields`` (name -> where) of a value."""
    for n, f in fields.items():
        if f.bits or f.size not in (1, 2, 4, 8) or f.kind is Kind.FLOAT:
            raise LayoutError(f"{f.name} ({n.split('.')[0]}) is not a plain integer")
    names = list(fields)
    return np.dtype(
        {
            "names": names,
            "formats": [("<i" if fields[n].signed else "<u") + str(fields[n].size) for n in names],
            "offsets": [fields[n].offset for n in names],
            "itemsize": itemsize,
        }
    )


@dataclass(frozen=True)
class OldSession:
    """One session read out of an old layout, its backends still old ids."""

    key: bytes
    """``struct xdplb_flow_key`` (40 bytes)."""
    hops: tuple[int, ...]
    hash: int
    state: abi.SessState
    last_seen: int
    gen: int | None
    be_gen: int | None


@dataclass(frozen=True)
class OldBackend:
    addr: IPAddress
    gen: int | None


@dataclass
class CopyResult:
    """What one copy of the sessions did."""

    #: Sessions found in the old table (ways in use, read whole).
    found: int = 0
    #: Written into the new table.
    copied: int = 0
    #: Already there (a pass before, or the new program recorded the flow).
    present: int = 0
    #: Skipped: no backend of the new maps has the session's backend's address.
    no_backend: int = 0
    #: Skipped: of an old generation (flushed), or its backend slot reassigned since.
    stale: int = 0
    #: Skipped: past its state's idle timeout (the new table's).
    expired: int = 0
    #: Not copied: a set of the old table kept being written, or of the new one held.
    busy: int = 0
    #: Copied over another session of a full set.
    evicted: int = 0

    def __str__(self) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in dataclasses.asdict(self).items())


class OldTable(Closing):
    """The pinned session table of another layout, read through its BTF."""

    def __init__(self, instance: str, version: int, target: int) -> None:
        """Open layout ``version``'s pins of ``instance`` and check that every session of
        it can be read: UpgradeRefused (naming the map and field) if not. ``target``:
        the layout migrated to (for messages)."""
        self.instance = instance
        self.version = version
        self.dir = paths.layout_dir(instance, version)
        self.maps: dict[str, Map] = {}
        try:
            for name in ("lb_conns", "lb_backends", "lb_config"):
                path = self.dir / name
                if path.exists():
                    self.maps[name] = Map.from_pinned(path)
            for name in ("lb_conns", "lb_backends"):
                if name not in self.maps:
                    raise _refusal(instance, version, target, f"no pinned {name} in {self.dir}")
            self._layout(target)
        except BaseException:
            self.close()
            raise

    def _layout(self, target: int) -> None:
        def refuse(name: str, cause: str) -> UpgradeRefused:
            return _refusal(self.instance, self.version, target, f"{name}: {cause}")

        conns = self.maps["lb_conns"]
        try:
            btf, tid = layout.map_btf(conns)
            self.ways = WayFields.find(btf, tid)
        except (LayoutError, BtfError, XdplbError) as e:
            raise refuse("lb_conns", str(e)) from None
        # enum xdplb_sess_state of the old program, to carry states by name.
        try:
            names = btf.enum_values("xdplb_sess_state")
            self.states = {
                v: abi.SessState[n.removeprefix("XDPLB_SESS_")]
                for n, v in names.items()
                if n.removeprefix("XDPLB_SESS_") in abi.SessState.__members__
            }
        except BtfError:
            self.states = {int(s): s for s in abi.SessState}
        needed: dict[str, Field] = {}
        for name, per_way in self.ways.by_name.items():
            for w, elems in enumerate(per_way):
                for i, f in enumerate(elems):
                    needed[f"{name}.{w}.{i}"] = f
        if self.ways.seq is not None:
            needed["seq"] = self.ways.seq
        self.dtype = _dtype(needed, conns.value_size)
        #: Fields compared between two copies of a set (last_seen moves without a claim).
        self.stable = [n for n in needed if not n.startswith("last_seen.")]
        backends = self.maps["lb_backends"]
        try:
            bbtf, btid = layout.map_btf(backends)
            bfields = {f.name: f for f in bbtf.fields(btid)}
        except (BtfError, XdplbError) as e:
            raise refuse("lb_backends", str(e)) from None
        missing = [n for n in ("addr[0]", "addr[3]", "family") if n not in bfields]
        if missing:
            raise refuse("lb_backends", f"no field {missing[0].split('[')[0]}")
        want = {f"addr{i}": bfields[f"addr[{i}]"] for i in range(4)} | {"family": bfields["family"]}
        if "gen" in bfields:
            want["gen"] = bfields["gen"]
        self.backend_dtype = _dtype(want, backends.value_size)
        #: The old table's generation (``lb_config.conn_gen``), if it has one.
        self.conn_gen: int | None = None
        cfg = self.maps.get("lb_config")
        if cfg is not None:
            with_gen = self._config_field(cfg, "conn_gen")
            raw = cfg.lookup(_U32.pack(0))
            if with_gen is not None and raw is not None:
                self.conn_gen = int.from_bytes(
                    raw[with_gen.offset : with_gen.offset + with_gen.size], "little"
                )

    @staticmethod
    def _config_field(cfg: Map, name: str) -> Field | None:
        try:
            btf, tid = layout.map_btf(cfg)
            return next((f for f in btf.fields(tid) if f.name == name), None)
        except (BtfError, XdplbError):
            return None

    def close(self) -> None:
        for m in self.maps.values():
            m.close()

    # -- reading ------------------------------------------------------------------------

    def backends(self) -> dict[int, OldBackend]:
        """Old backend id -> address (and slot generation), every slot ever used."""
        m = self.maps["lb_backends"]
        rows = np.frombuffer(m.lookup_array(), dtype=self.backend_dtype)
        out = {}
        for bid in np.nonzero(rows["family"])[0]:
            r = rows[bid]
            raw = b"".join(int(r[f"addr{i}"]).to_bytes(4, "little") for i in range(4))
            family = int(r["family"])
            if family == abi.Family.V4:
                addr: IPAddress = ipaddress.IPv4Address(raw[:4])
            elif family == abi.Family.V6:
                addr = ipaddress.IPv6Address(raw)
            else:
                continue
            gen = int(r["gen"]) if "gen" in self.backend_dtype.names else None  # type: ignore[operator]
            out[int(bid)] = OldBackend(addr, gen)
        return out

    def _copies(self, start: int, count: int) -> tuple[npt.NDArray[np.void], npt.NDArray[np.bool_]]:
        """Sets ``start`` .. ``start + count - 1``, and which of them were read whole: two
        copies agree (the set's seq even and unchanged, every field but last_seen
        equal); sets that do not are read again one by one."""
        m = self.maps["lb_conns"]
        a = np.frombuffer(m.lookup_array_range(start, count), dtype=self.dtype).copy()
        b = np.frombuffer(m.lookup_array_range(start, count), dtype=self.dtype)
        ok = self._agree(a, b)
        for i in np.nonzero(~ok)[0]:
            key = _U32.pack(start + int(i))
            for _ in range(_TRIES):
                ra, rb = m.lookup(key), m.lookup(key)
                if ra is None or rb is None:
                    break
                one_a = np.frombuffer(ra, dtype=self.dtype)
                if self._agree(one_a, np.frombuffer(rb, dtype=self.dtype))[0]:
                    a[i] = one_a[0]
                    ok[i] = True
                    break
        return a, ok

    def _agree(self, a: npt.NDArray[np.void], b: npt.NDArray[np.void]) -> npt.NDArray[np.bool_]:
        ok = np.ones(len(a), dtype=bool)
        for n in self.stable:
            ok &= a[n] == b[n]
        if self.ways.seq is not None:
            ok &= (a["seq"] & 1) == 0
        return ok

    def sessions(self) -> Iterator[OldSession | None]:
        """Every session in use, read whole; None for each set given up on (busy)."""
        m = self.maps["lb_conns"]
        for start in range(0, m.max_entries, CHUNK_SETS):
            rows, ok = self._copies(start, CHUNK_SETS)
            for _ in range(int(np.count_nonzero(~ok))):
                yield None
            rows = rows[ok]
            for w in range(self.ways.ways):
                used = self._used(rows, w)
                for r in rows[used]:
                    yield self._session(r, w)

    def _col(
        self, rows: npt.NDArray[np.void], name: str, w: int, i: int = 0
    ) -> npt.NDArray[np.int64]:
        return rows[f"{name}.{w}.{i}"].astype(np.int64)

    def _used(self, rows: npt.NDArray[np.void], w: int) -> npt.NDArray[np.bool_]:
        if "flags" in self.ways.by_name:
            used: npt.NDArray[np.bool_] = (self._col(rows, "flags", w) & abi.SESS_F_USED) != 0
            return used
        name = "hop" if "hop" in self.ways.by_name else "backend_id"
        named: npt.NDArray[np.bool_] = self._col(rows, name, w) != 0
        return named

    def _session(self, r: np.void, w: int) -> OldSession:
        by = self.ways.by_name

        def val(name: str, i: int = 0) -> int:
            return int(r[f"{name}.{w}.{i}"])

        def vals(name: str) -> list[int]:
            return [val(name, i) for i in range(len(by[name][w]))]

        key = bytearray(FLOW_KEY_SIZE)
        for i, word in enumerate(vals("src")[:4]):
            key[4 * i : 4 * i + 4] = word.to_bytes(4, "little")
        for i, word in enumerate(vals("dst")[:4]):
            key[16 + 4 * i : 20 + 4 * i] = word.to_bytes(4, "little")
        key[32:34] = val("sport").to_bytes(2, "little")
        key[34:36] = val("dport").to_bytes(2, "little")
        key[36] = val("proto") & 0xFF
        hops = tuple(h for h in vals("hop" if "hop" in by else "backend_id") if h)
        proto = key[36]
        if "state" in by:
            state = self.states.get(val("state"), abi.SessState.TCP_EST)
        else:
            state = abi.SessState.TCP_EST if proto == abi.IPPROTO_TCP else abi.SessState.UDP
        return OldSession(
            bytes(key),
            hops,
            val("hash") if "hash" in by else 0,
            state,
            val("last_seen") if "last_seen" in by else -1,
            val("gen") if "gen" in by else None,
            val("be_gen") if "be_gen" in by else None,
        )


#: Counters carried across by name: map -> (its enum in the old BTF, the enumerators'
#: prefix, today's enum).
COUNTERS: dict[str, tuple[str, str, type[enum.IntEnum]]] = {
    "lb_events": ("xdplb_event", "XDPLB_EV_", abi.Event),
    "lb_drops": ("xdplb_drop_reason", "XDPLB_DROP_", abi.DropReason),
}


def carry_counters(old: OldTable, new: Mapping[str, Map]) -> int:
    """Add the old program's per-CPU event and drop counters to the new maps', matched by
    enumerator name (a counter only one layout has is left). Only before the new program
    runs: the writes are not atomic against it. Returns how many counters it carried."""
    try:
        btf, _ = layout.map_btf(old.maps["lb_conns"])
    except (BtfError, XdplbError):
        return 0
    carried = 0
    for name, (enum_name, prefix, today) in COUNTERS.items():
        path = old.dir / name
        if name not in new or not path.exists():
            continue
        try:
            values = btf.enum_values(enum_name)
        except BtfError:
            continue
        with Map.from_pinned(path) as src:
            dst = new[name]
            if not src.type.percpu or src.value_size != 8 or dst.value_size != 8:
                continue
            for ename, old_idx in values.items():
                member = today.__members__.get(ename.removeprefix(prefix))
                if member is None or not 0 <= old_idx < src.max_entries:
                    continue
                got = src.lookup_percpu(_U32.pack(old_idx))
                have = dst.lookup_percpu(_U32.pack(int(member)))
                if not got or not have or len(got) != len(have):
                    continue
                sums = [
                    int.from_bytes(a, "little") + int.from_bytes(b, "little")
                    for a, b in zip(got, have, strict=True)
                ]
                raw = b"".join(v.to_bytes(8, "little") for v in sums)
                dst.update(_U32.pack(int(member)), raw)
                carried += 1
    return carried


def copy_sessions(old: OldTable, new_conns: ConnTable, new_maps: NewMaps) -> CopyResult:
    """Import every live session of ``old`` into ``new_conns`` (replace=False), its
    backends mapped to the new maps' ids by address."""
    out = CopyResult()
    old_backends = old.backends()
    by_addr = new_maps.ids_by_address
    sessions = list(old.sessions())
    # After the read: a session the old program refreshed meanwhile is not from the future.
    now = now_ticks()
    todo: list[abi.Session] = []
    for s in sessions:
        if s is None:
            out.busy += 1
            continue
        out.found += 1
        if s.gen is not None and old.conn_gen is not None and s.gen != old.conn_gen:
            out.stale += 1
            continue
        last_seen = now if s.last_seen < 0 else s.last_seen
        age = (now - last_seen) & 0xFFFFFFFF
        if age < 1 << 31 and age > new_maps.timeouts[s.state]:  # ahead of now: just seen
            out.expired += 1
            continue
        first = old_backends.get(s.hops[0]) if s.hops else None
        if first is None or first.addr not in by_addr:
            out.no_backend += 1
            continue
        if s.be_gen is not None and first.gen is not None and s.be_gen != first.gen:
            out.stale += 1  # the old slot was given to another address since
            continue
        hops = []
        for h in s.hops[: abi.MAX_HOPS]:
            b = old_backends.get(h)
            if b is not None and b.addr in by_addr:
                hops.append(by_addr[b.addr][0])
        todo.append(session(s.key, hops, s.hash, s.state, last_seen, be_gen=by_addr[first.addr][1]))
    results = new_conns.import_sessions(
        todo, seed=new_maps.seed, gen=new_maps.gen, timeouts=new_maps.timeouts, now=now
    )
    for r in results:
        match r:
            case ImportResult.WRITTEN | ImportResult.REPLACED:
                out.copied += 1
            case ImportResult.EVICTED:
                out.copied += 1
                out.evicted += 1
            case ImportResult.PRESENT:
                out.present += 1
            case ImportResult.BUSY:
                out.busy += 1
    return out


@dataclass(frozen=True)
class NewMaps:
    """What a copy needs of the new maps: backend ids by address (with their slot
    generation) and the table's seed, generation and timeouts."""

    ids_by_address: dict[IPAddress, tuple[int, int]]
    seed: int
    gen: int
    timeouts: Sequence[int]


class Upgrade(Closing):
    """Every other layout an instance has pinned, opened and checked, to be copied into
    this daemon's maps and then removed."""

    def __init__(self, instance: str, version: int, olds: list[OldTable]) -> None:
        self.instance = instance
        self.version = version
        self.olds = olds
        #: One line per pass, for the log and the status.
        self.passes: list[tuple[str, int, CopyResult]] = []

    @classmethod
    def prepare(cls, instance: str, version: int) -> Upgrade | None:
        """None if ``instance`` has no pins of another layout than ``version``; else
        every such layout opened (the newest first) and checked: UpgradeRefused naming
        the cause if one cannot be migrated."""
        others = [v for v in layout.pinned_layouts(instance) if v != version]
        if not others:
            return None
        olds: list[OldTable] = []
        try:
            for v in sorted(others, reverse=True):
                olds.append(OldTable(instance, v, version))
        except BaseException:
            for o in olds:
                o.close()
            raise
        return cls(instance, version, olds)

    @property
    def from_versions(self) -> list[int]:
        return [o.version for o in self.olds]

    def copy(self, conns: ConnTable, new: NewMaps, what: str) -> CopyResult:
        """Copy every old layout's sessions into ``conns`` (``what``: "pass 1", ...)."""
        total = CopyResult()
        for o in self.olds:
            r = copy_sessions(o, conns, new)
            self.passes.append((what, o.version, r))
            log.info(
                "upgrade %s: %s -> %s: %s",
                what,
                paths.layout_name(o.version),
                paths.layout_name(self.version),
                r,
                extra={"upgrade_pass": what, **dataclasses.asdict(r)},
            )
            for f in dataclasses.fields(CopyResult):
                setattr(total, f.name, getattr(total, f.name) + getattr(r, f.name))
        return total

    def carry_counters(self, new: Mapping[str, Map]) -> int:
        """:func:`carry_counters` from every old layout."""
        return sum(carry_counters(o, new) for o in self.olds)

    def remove_old(self) -> int:
        """Close and remove every old layout's pins (never the links); how many."""
        removed = 0
        for o in self.olds:
            o.close()
            removed += layout.remove_layout(self.instance, o.version)
        return removed

    def close(self) -> None:
        for o in self.olds:
            o.close()


def new_maps_of(snap_backends: dict[int, tuple[IPAddress, bool, int]], seed: int, gen: int,
                timeouts: Sequence[int]) -> NewMaps:  # fmt: skip
    """:class:`NewMaps` from the new maps' backends (id -> address, active, gen): an
    address held by several slots maps to an active one, the lowest id first."""
    by_addr: dict[IPAddress, tuple[int, int]] = {}
    for bid in sorted(snap_backends, key=lambda i: (not snap_backends[i][1], i)):
        addr, _, g = snap_backends[bid]
        by_addr.setdefault(addr, (bid, g))
    return NewMaps(by_addr, seed, gen, timeouts)


def describe(passes: Sequence[tuple[str, int, CopyResult]]) -> list[str]:
    return [f"{what} from {paths.layout_name(v)}: {r}" for what, v, r in passes]


__all__ = [
    "CopyResult",
    "NewMaps",
    "OldTable",
    "Upgrade",
    "UpgradeRefused",
    "WayFields",
    "copy_sessions",
    "describe",
    "new_maps_of",
]
