"""Sessions between this node's table and the wire (docs/sync.md, "The wire").

A session of ``lb_conns`` names its backend and later hops by this node's backend ids and
its last packet by this host's jiffies; neither means anything on another node. On the
wire a session names its hops by address and its last packet by its age in milliseconds.
:class:`TableView` is what the conversion needs of the node's maps (taken from the
runtime's snapshot after every plan): which id is which address, each slot's generation,
the session table's seed, generation and timeouts, and which VIPs sync. Every function
here works on numpy arrays of many sessions at once: a full copy carries millions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from xdplb.config.schema import Config
from xdplb.core import abi
from xdplb.core.addresses import IPAddress
from xdplb.core.state import Snapshot
from xdplb.datapath.conns import SESSION_DTYPE, ImportMode, live_mask
from xdplb.sync import wire

#: How a peer's entry is imported, by its op: a new session never displaces one this node
#: has; a state change is the newest word on the flow; a refresh or a copy only keeps a
#: session alive (or brings one this node lacks).
IMPORT_MODE = {
    wire.Op.NEW: ImportMode.KEEP,
    wire.Op.UPDATE: ImportMode.OVERWRITE,
    wire.Op.REFRESH: ImportMode.NEWER,
    wire.Op.COPY: ImportMode.NEWER,
}


@dataclass(frozen=True)
class VipMatch:
    """A VIP as session records name it: the flow key's destination words, the raw
    (network order) port word, 0 for a wildcard, and the protocol."""

    dst: tuple[int, int, int, int]
    port_raw: int
    proto: int

    @classmethod
    def of(cls, addr: IPAddress, port: int, proto: int) -> VipMatch:
        return cls(abi.addr_words(addr), int.from_bytes(port.to_bytes(2, "big"), "little"), proto)


@dataclass(frozen=True)
class TableView:
    """What converting sessions needs of this node's maps, at one plan."""

    seed: int
    gen: int
    timeouts: tuple[int, ...]
    hz: int
    #: ``lb_backends``: id -> address, and id -> the slot's generation.
    addresses: Mapping[int, IPAddress]
    slot_gen: Mapping[int, int]
    #: The VIPs whose sessions sync (``vips[].sync``).
    synced: tuple[VipMatch, ...]
    ids: Mapping[IPAddress, int] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", {a: i for i, a in self.addresses.items()})


def vip_mask(recs: npt.NDArray[np.void], vips: Iterable[VipMatch]) -> npt.NDArray[np.bool_]:
    """Which records of :data:`SESSION_DTYPE` are flows to one of ``vips``."""
    out = np.zeros(len(recs), dtype=bool)
    if len(recs) == 0:
        return out
    dst = recs["dst"]
    for v in vips:
        m = (dst == np.asarray(v.dst, dtype=np.uint32)).all(axis=1) & (recs["proto"] == v.proto)
        if v.port_raw:
            m &= recs["dport"] == v.port_raw
        out |= m
    return out


def _raw16(words: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint8]:
    """(n, 4) address words as their (n, 16) bytes in memory (network order)."""
    return np.ascontiguousarray(words, dtype="<u4").view(np.uint8).reshape(-1, 16)


def _swap16(a: npt.NDArray[np.uint16]) -> npt.NDArray[np.uint16]:
    """A raw network-order port word as the port number, or back."""
    a = a.astype(np.uint16)
    return ((a >> 8) | (a << 8)).astype(np.uint16)


def to_wire(
    recs: npt.NDArray[np.void], ops: wire.Op | npt.NDArray[np.uint8], view: TableView, now: int
) -> list[wire.Entries]:
    """Records of :data:`SESSION_DTYPE` as ENTRIES messages (``ops``: one for all, or one
    each) at tick ``now``. A session naming a backend id that is not in ``lb_backends``
    (stale here) is left out."""
    n = len(recs)
    hops = recs["hop"].astype(np.int64) if n else np.zeros((0, abi.MAX_HOPS), np.int64)
    ids = sorted(view.addresses)
    lookup = np.full(max([*ids, int(hops.max(initial=0))]) + 1, -2, dtype=np.int64)
    lookup[0] = -1  # no hop
    lookup[ids] = np.arange(len(ids))
    idx = lookup[hops]
    ok = (idx != -2).all(axis=1) & (hops[:, 0] != 0)
    recs, idx = recs[ok], idx[ok]
    out = np.zeros(len(recs), dtype=wire.ENTRY_DTYPE)
    out["op"] = ops if isinstance(ops, wire.Op) else np.asarray(ops)[ok]
    out["state"] = recs["state"]
    out["proto"] = recs["proto"]
    out["src"] = _raw16(recs["src"])
    out["dst"] = _raw16(recs["dst"])
    out["sport"] = _swap16(recs["sport"])
    out["dport"] = _swap16(recs["dport"])
    out["hash"] = recs["hash"]
    age = (np.uint32(now) - recs["last_seen"]).astype(np.uint32).view(np.int32)
    age = np.maximum(age, 0).astype(np.uint64)
    out["age_ms"] = np.minimum(age * 1000 // max(view.hz, 1), 0xFFFFFFFF)
    addrs = [view.addresses[i] for i in ids]
    return list(wire.entries_messages(addrs, out, idx))


@dataclass
class Imported:
    """Entries of one message made ready for ``ConnTable.import_records``, by mode."""

    #: mode -> records of :data:`SESSION_DTYPE`.
    batches: dict[ImportMode, npt.NDArray[np.void]]
    #: Entries left out: a hop whose address this node has no backend of, or a flow to
    #: no VIP of this node that syncs.
    unknown_backend: int = 0
    not_synced: int = 0


def from_wire(msg: wire.Entries, view: TableView, now: int) -> Imported:
    """A peer's entries as this node's session records, at tick ``now``."""
    e = msg.entries
    ids, known = wire.resolve_hops(msg, view.ids)
    recs = np.zeros(len(e), dtype=SESSION_DTYPE)
    recs["src"] = np.ascontiguousarray(e["src"]).view("<u4").reshape(-1, 4)
    recs["dst"] = np.ascontiguousarray(e["dst"]).view("<u4").reshape(-1, 4)
    recs["sport"] = _swap16(e["sport"])
    recs["dport"] = _swap16(e["dport"])
    recs["proto"] = e["proto"]
    recs["state"] = e["state"]
    recs["hop"] = ids
    recs["hash"] = e["hash"]
    gens = np.zeros(abi.MAX_BACKENDS + 1, dtype=np.uint8)
    for bid, g in view.slot_gen.items():
        gens[bid] = g
    recs["be_gen"] = gens[np.minimum(ids[:, 0], abi.MAX_BACKENDS)]
    ticks = e["age_ms"].astype(np.uint64) * max(view.hz, 1) // 1000
    recs["last_seen"] = (np.uint64(now) - ticks).astype(np.uint32)
    synced = vip_mask(recs, view.synced)
    keep = known & synced
    ops = e["op"]
    batches: dict[ImportMode, npt.NDArray[np.void]] = {}
    for op, mode in IMPORT_MODE.items():
        sel = keep & (ops == op)
        if sel.any():
            batches[mode] = (
                recs[sel] if mode not in batches else np.concatenate([batches[mode], recs[sel]])
            )
    return Imported(
        batches,
        unknown_backend=int(np.count_nonzero(~known)),
        not_synced=int(np.count_nonzero(known & ~synced)),
    )


def live_synced(
    recs: npt.NDArray[np.void], view: TableView, now: int, used_within: int | None = None
) -> npt.NDArray[np.void]:
    """The records that are live sessions of a VIP that syncs; with ``used_within``
    (ticks), only those this node used that recently: lb_xdp's, and peers' it has seen a
    packet of since (lb_xdp clears their SESS_F_IMPORTED), never one only a peer moved."""
    keep = live_mask(recs, view.gen, view.timeouts, now) & vip_mask(recs, view.synced)
    if used_within is not None:
        age = (np.uint32(now) - recs["last_seen"]).astype(np.uint32).view(np.int32)
        keep &= (age <= used_within) & (recs["flags"] & abi.SESS_F_IMPORTED == 0)
    return recs[keep]


class ViewCache:
    """:func:`view_from` of a runtime's last plan, built again only after another plan:
    ``snapshot()`` and ``config()`` give the snapshot it applied (None before the first)
    and the configuration running."""

    def __init__(
        self, snapshot: Callable[[], Snapshot | None], config: Callable[[], Config]
    ) -> None:
        self._snapshot, self._config = snapshot, config
        self._last: tuple[Snapshot, Config, TableView] | None = None

    def __call__(self) -> TableView | None:
        snap, cfg = self._snapshot(), self._config()
        if snap is None:
            return None
        if self._last is None or self._last[0] is not snap or self._last[1] is not cfg:
            self._last = (snap, cfg, view_from(snap, cfg))
        return self._last[2]


def view_from(snap: Snapshot, cfg: Config) -> TableView:
    """The view of maps that hold ``snap`` and serve ``cfg``."""
    return view_of(
        seed=snap.config.seed,
        gen=snap.config.conn_gen,
        timeouts=snap.config.conn_timeouts,
        hz=snap.config.hz,
        backends={i: (b.addr, b.gen) for i, b in snap.backends.items()},
        synced=[VipMatch.of(v.address, v.port, v.protocol.number) for v in cfg.vips if v.sync],
    )


def view_of(
    *,
    seed: int,
    gen: int,
    timeouts: Sequence[int],
    hz: int,
    backends: Mapping[int, tuple[IPAddress, int]],
    synced: Iterable[VipMatch],
) -> TableView:
    """A :class:`TableView` from plain values (``backends``: id -> (address, slot gen))."""
    return TableView(
        seed=seed,
        gen=gen,
        timeouts=tuple(timeouts),
        hz=hz,
        addresses={i: a for i, (a, _) in backends.items()},
        slot_gen={i: g for i, (_, g) in backends.items()},
        synced=tuple(synced),
    )
