"""Steps 8-9 (bpf/lib/lb_select.h): the backend of a flow, from the connection table
or by hashing into the VIP's lookup table, with the hops of a Beamer bucket."""

from __future__ import annotations

from xdplb.core import abi, hashing
from xdplb.core.state import ConnEntry, VipParams
from xdplb.model.parse import IPPROTO_TCP
from xdplb.model.state import DataplaneState, Flow

_Choice = tuple[
    tuple[abi.Event, ...],
    abi.DropReason | None,
    int | None,
    int | None,
    tuple[int, ...],
    tuple[bytes, ConnEntry] | None,
]


def choose(
    state: DataplaneState, params: VipParams, key: bytes, flow: Flow, starts: bool = True
) -> _Choice:
    """Steps 8-9: the hops, or the drop reason; with the events counted on the way.

    ``starts``: the packet may start its connection (not TCP, or a SYN without ACK).
    """
    events: tuple[abi.Event, ...] = ()
    # 8. Connection table; a TCP SYN starts a new connection and follows the table.
    conn = None if flow.proto == IPPROTO_TCP and starts else state.conns.get(key)
    if conn is not None:
        if state.backend_usable(conn.backend_id):
            return ((abi.Event.CONN_HIT,), None, conn.hash, None, (conn.backend_id,), None)
        events = (abi.Event.CONN_STALE,)
    # 9. Table.
    drop, flow_hash, bucket, hops = pick(state, params, flow)
    if drop is not None:
        return (events, drop, flow_hash, bucket, (), None)
    beamer = params.table_kind == abi.TableKind.BEAMER
    # Beamer records only connections sure to start on the first hop: a mid-flow TCP
    # packet may be a later hop's, and a record would drop those hops from its list.
    insert = (key, ConnEntry(hops[0], flow_hash)) if starts or not beamer else None
    return ((*events, abi.Event.CONN_MISS), None, flow_hash, bucket, hops, insert)


def pick(
    state: DataplaneState, params: VipParams, flow: Flow
) -> tuple[abi.DropReason | None, int, int | None, tuple[int, ...]]:
    """Step 9 without its bookkeeping (lb_table_pick): (drop, hash, bucket, hops)."""
    src_only = bool(params.flags & abi.VIP_F_SRC_HASH)
    flow_hash = hashing.flow_hash(flow.hash_key(src_only), state.config.seed)
    table = state.tables.get(params.vip_id)
    # A zero table_size counts as no table (BPF's x % 0 == x would pick a random bucket).
    if table is None or params.table_size == 0:
        return (abi.DropReason.NO_TABLE, flow_hash, None, ())
    bucket = flow_hash % params.table_size
    if bucket >= len(table):
        return (abi.DropReason.NO_BACKEND, flow_hash, bucket, ())
    first = int(table.first[bucket])
    if not state.backend_usable(first):
        return (abi.DropReason.NO_BACKEND, flow_hash, bucket, ())
    hops: tuple[int, ...] = (first,)
    if params.table_kind == abi.TableKind.BEAMER and table.rest is not None:
        later = (int(h) for h in table.rest[bucket])
        hops = (first, *(h for h in later if h != 0 and _later_hop_ok(state, first, h)))
    return (None, flow_hash, bucket, hops)


def _later_hop_ok(state: DataplaneState, first: int, hop: int) -> bool:
    """A later hop rides along when it is usable and of the first hop's family.

    A hop list holds addresses of one (the outer) family only; an inactive
    hop has no connections left to daisy-chain to.  The usable later hops go in
    the bucket's order, the unusable ones are skipped (lb_select.h packs them).
    """
    return (
        state.backend_usable(hop)
        and state.backends[hop].addr.version == state.backends[first].addr.version
    )
