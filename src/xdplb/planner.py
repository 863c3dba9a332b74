"""The planner: desired configuration + what the maps hold -> map operations.

Sans-I/O: it reads no map and makes no syscall. The datapath layer takes a
:class:`Snapshot` of the maps, :func:`plan` returns the operations, and the datapath
applies them in the order given. Applying the plan to the snapshot yields the desired
state (``apply_to_snapshot`` does exactly that, and the unit tests use it).

Identities are kept stable so that a restarted daemon (or a reload) moves nothing it
does not have to: a VIP keeps its id, a backend (by address) keeps its id, and a table
is rewritten only when its contents change. Backend id 0 is never allocated: 0 means
"no backend" in a bucket.

Ordering makes every intermediate state safe for the data path: backends exist before a
table names them, a table exists before its VIP points at it, and removals go the other
way round. A VIP whose table size changes moves to a fresh id, so its new size and new
table appear in one ``lb_vips`` update instead of two racing ones.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from xdplb import abi, maglev
from xdplb.config import Config, HashFields, VipConfig

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
VipKey = tuple[IPAddress, int, int]  # address, port (0: wildcard), IP protocol number
Buckets = npt.NDArray[np.uint32]  # shape (table_size, MAX_HOPS): hop ids per bucket


@dataclass(frozen=True)
class VipState:
    """One lb_vips entry."""

    vip_id: int
    table_size: int
    encap: abi.Encap
    flags: int = 0
    table_kind: abi.TableKind = abi.TableKind.MAGLEV


@dataclass(frozen=True)
class BackendState:
    """One lb_backends slot."""

    address: IPAddress
    active: bool = True


@dataclass(frozen=True)
class TunnelState:
    """lb_config."""

    src4: ipaddress.IPv4Address | None = None
    src6: ipaddress.IPv6Address | None = None
    gue_port: int = abi.GUE_PORT
    hash_seed: int = 0


@dataclass
class Snapshot:
    """What the maps hold (or, for the planner's output check, should hold)."""

    vips: dict[VipKey, VipState] = field(default_factory=dict)
    backends: dict[int, BackendState] = field(default_factory=dict)
    tables: dict[int, Buckets] = field(default_factory=dict)
    vip_addrs: dict[IPAddress, int] = field(default_factory=dict)
    tunnel: TunnelState = field(default_factory=TunnelState)


# --- operations, applied in the order the plan lists them -------------------------------


@dataclass(frozen=True)
class SetTunnel:
    tunnel: TunnelState


@dataclass(frozen=True)
class PutBackend:
    backend_id: int
    backend: BackendState


@dataclass(frozen=True)
class PutTable:
    """Fill a new inner map and swap it in at ``vip_id`` (never an in-place rewrite)."""

    vip_id: int
    buckets: Buckets = field(compare=False)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PutTable)
            and other.vip_id == self.vip_id
            and np.array_equal(other.buckets, self.buckets)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class PutVipAddr:
    address: IPAddress
    count: int


@dataclass(frozen=True)
class PutVip:
    key: VipKey
    state: VipState


@dataclass(frozen=True)
class DeleteVip:
    key: VipKey


@dataclass(frozen=True)
class DeleteVipAddr:
    address: IPAddress


@dataclass(frozen=True)
class DeleteTable:
    vip_id: int


@dataclass(frozen=True)
class DeleteBackend:
    """Mark the slot inactive: connection-table entries naming it are re-hashed."""

    backend_id: int


Op = (
    SetTunnel
    | PutBackend
    | PutTable
    | PutVipAddr
    | PutVip
    | DeleteVip
    | DeleteVipAddr
    | DeleteTable
    | DeleteBackend
)


def vip_key(vip: VipConfig) -> VipKey:
    return (vip.address, vip.port, vip.protocol.number)


def build_buckets(
    weights: dict[IPAddress, int], ids: dict[IPAddress, int], size: int
) -> Buckets | None:
    """The Maglev table of one VIP as hop ids; None when no backend has a weight."""
    live = {str(a): w for a, w in weights.items() if w > 0}
    if not live:
        return None
    table = maglev.build(live, size)
    buckets = np.zeros((size, abi.MAX_HOPS), dtype=np.uint32)
    buckets[:, 0] = table.map_ids({str(a): ids[a] for a in weights})
    return buckets


def _lowest_free(used: Iterable[int], start: int, stop: int) -> Iterable[int]:
    taken = set(used)
    return (i for i in range(start, stop) if i not in taken)


def desired_tunnel(cfg: Config) -> TunnelState:
    return TunnelState(
        src4=cfg.tunnel.source_v4,
        src6=cfg.tunnel.source_v6,
        gue_port=cfg.tunnel.gue_port,
        hash_seed=cfg.hash_seed,
    )


def plan(cfg: Config, current: Snapshot) -> list[Op]:
    """The operations that turn ``current`` into the state ``cfg`` describes."""
    ops_put: list[Op] = []
    ops_del: list[Op] = []

    tunnel = desired_tunnel(cfg)
    if tunnel != current.tunnel:
        ops_put.append(SetTunnel(tunnel))

    # Backends: active ones keep their ids; new ones take the lowest free id >= 1.
    wanted = cfg.backend_addresses()
    by_addr = {b.address: i for i, b in current.backends.items() if b.active}
    ids: dict[IPAddress, int] = {a: i for a, i in by_addr.items() if a in wanted}
    # Never hand out an id that is active now, even one this plan frees: tables and
    # connection entries still name it until the plan's deletions run.
    free = iter(_lowest_free(by_addr.values(), 1, abi.MAX_BACKENDS))
    for addr in sorted(wanted - ids.keys(), key=lambda a: (a.version, a)):
        ids[addr] = next(free)
    for addr, bid in sorted(ids.items(), key=lambda kv: kv[1]):
        backend = BackendState(addr, True)
        if current.backends.get(bid) != backend:
            ops_put.append(PutBackend(bid, backend))
    for bid, b in sorted(current.backends.items()):
        if b.active and bid not in ids.values():
            ops_del.append(DeleteBackend(bid))

    # VIPs and their tables.
    desired_keys = {vip_key(v) for v in cfg.vips}
    # A fresh id is one no current VIP or table uses, so nothing live is overwritten
    # before the deletions at the end of the plan.
    used_ids = {s.vip_id for s in current.vips.values()} | set(current.tables)
    fresh_ids = iter(_lowest_free(used_ids, 0, abi.MAX_VIPS))
    vip_puts: list[Op] = []
    live_tables: set[int] = set()
    for vip in cfg.vips:
        key = vip_key(vip)
        size = cfg.vip_table_size(vip)
        old = current.vips.get(key)
        vip_id = old.vip_id if old is not None and old.table_size == size else next(fresh_ids)
        state = VipState(
            vip_id=vip_id,
            table_size=size,
            encap=vip.encap.abi,
            flags=abi.VIP_F_SRC_HASH if vip.hash is HashFields.SOURCE else 0,
        )
        buckets = build_buckets({b.address: b.weight for b in vip.backends}, ids, size)
        if buckets is not None:
            live_tables.add(vip_id)
            cur = current.tables.get(vip_id)
            if cur is None or not np.array_equal(cur, buckets):
                ops_put.append(PutTable(vip_id, buckets))
        if old != state:
            vip_puts.append(PutVip(key, state))
    ops_put.extend(vip_puts)

    addr_counts: dict[IPAddress, int] = {}
    for vip in cfg.vips:
        addr_counts[vip.address] = addr_counts.get(vip.address, 0) + 1
    for addr, n in addr_counts.items():
        if current.vip_addrs.get(addr) != n:
            ops_put.append(PutVipAddr(addr, n))

    for key in sorted(current.vips.keys() - desired_keys, key=_key_order):
        ops_del.insert(0, DeleteVip(key))
    for addr in sorted(current.vip_addrs.keys() - addr_counts.keys(), key=_addr_order):
        ops_del.insert(0, DeleteVipAddr(addr))
    for vip_id in sorted(current.tables.keys() - live_tables):
        ops_del.insert(0, DeleteTable(vip_id))
    # Deletions run VIPs first, then addresses, tables, backends.
    ops_del.sort(key=_del_rank)
    return ops_put + ops_del


def _addr_order(a: IPAddress) -> tuple[int, IPAddress]:
    return (a.version, a)


def _key_order(k: VipKey) -> tuple[int, IPAddress, int, int]:
    return (k[0].version, k[0], k[1], k[2])


def _del_rank(op: Op) -> int:
    order = (DeleteVip, DeleteVipAddr, DeleteTable, DeleteBackend)
    return next(i for i, t in enumerate(order) if isinstance(op, t))


def apply_to_snapshot(snap: Snapshot, ops: Iterable[Op]) -> Snapshot:
    """What the maps hold after ``ops``: the planner's semantics, for tests and dry runs."""
    out = Snapshot(
        vips=dict(snap.vips),
        backends=dict(snap.backends),
        tables=dict(snap.tables),
        vip_addrs=dict(snap.vip_addrs),
        tunnel=snap.tunnel,
    )
    for op in ops:
        match op:
            case SetTunnel(tunnel):
                out.tunnel = tunnel
            case PutBackend(bid, backend):
                out.backends[bid] = backend
            case PutTable(vip_id, buckets):
                out.tables[vip_id] = buckets
            case PutVipAddr(addr, n):
                out.vip_addrs[addr] = n
            case PutVip(key, state):
                out.vips[key] = state
            case DeleteVip(key):
                del out.vips[key]
            case DeleteVipAddr(addr):
                del out.vip_addrs[addr]
            case DeleteTable(vip_id):
                del out.tables[vip_id]
            case DeleteBackend(bid):
                out.backends[bid] = replace(out.backends[bid], active=False)
    return out
