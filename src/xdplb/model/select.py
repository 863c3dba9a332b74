"""Steps 8-9 (bpf/lib/lb_select.h): the backend of a flow, from the connection table
or by hashing into the VIP's lookup table, with the hops of a Beamer bucket."""

from __future__ import annotations

from dataclasses import replace

from xdplb.core import abi, hashing
from xdplb.core.state import ConnEntry, VipParams, session_age
from xdplb.model.parse import IPPROTO_TCP, TCP_FIN, TCP_RST
from xdplb.model.state import DataplaneState, Flow

#: (events, drop, hash, bucket, hops, the session inserted, the session a hit moved on)
_Choice = tuple[
    tuple[abi.Event, ...],
    abi.DropReason | None,
    int | None,
    int | None,
    tuple[int, ...],
    tuple[bytes, ConnEntry] | None,
    tuple[bytes, ConnEntry] | None,
]


_LIVE_MEMBERS = (abi.MemberState.ACTIVE, abi.MemberState.DRAINING)


def session(
    state: DataplaneState, params: VipParams, key: bytes, proto: int
) -> tuple[tuple[abi.Event, ...], ConnEntry | None, tuple[int, ...]]:
    """Step 8: the flow's live session and its hops (the backend, then its usable later
    hops), or None with the event that says why it is not used (none if it has none).
    Live: this generation, not idle past its state's timeout, its slot still given to
    the same address, and for UDP its backend ACTIVE or DRAINING in the VIP."""
    conn = state.conns.get(key)
    if conn is None:
        return (), None, ()
    cfg = state.config
    if conn.gen != cfg.conn_gen:
        return (abi.Event.CONN_GEN_MISS,), None, ()
    if (
        state.now is not None
        and conn.last_seen is not None
        and session_age(conn.last_seen, state.now) > cfg.conn_timeouts[conn.state]
    ):
        return (abi.Event.CONN_EXPIRED,), None, ()
    first = conn.backend_id
    if not state.slot_holds(first, conn.be_gen) or (
        proto != IPPROTO_TCP and state.member_state(params.vip_id, first) not in _LIVE_MEMBERS
    ):
        return (abi.Event.CONN_STALE,), None, ()
    hops = (first, *(h for h in conn.later if h != 0 and _later_hop_ok(state, first, h)))
    return (abi.Event.CONN_HIT,), conn, hops


def touched(state: DataplaneState, conn: ConnEntry, proto: int, tcp_flags: int) -> ConnEntry | None:
    """A hit's session as the packet leaves it (lb_conn_lookup with touch): last_seen
    refreshed to now, and for TCP a FIN or RST closes it (TCP_FIN), any other packet
    moves a SYN's session to TCP_EST. None when nothing changes."""
    st = conn.state
    if proto == IPPROTO_TCP:
        if tcp_flags & (TCP_FIN | TCP_RST):
            st = abi.SessState.TCP_FIN
        elif st == abi.SessState.TCP_SYN:
            st = abi.SessState.TCP_EST
    last_seen = conn.last_seen if state.now is None else state.now
    if st == conn.state and last_seen == conn.last_seen:
        return None
    return replace(conn, state=st, last_seen=last_seen)


def choose(
    state: DataplaneState,
    params: VipParams,
    key: bytes,
    flow: Flow,
    starts: bool = True,
    tcp_flags: int = 0,
) -> _Choice:
    """Steps 8-9: the hops, or the drop reason; with the events counted on the way.

    ``starts``: the packet may start its connection (not TCP, or a SYN without ACK).
    ``tcp_flags``: the packet's, which move a TCP session's state on a hit.
    """
    events: tuple[abi.Event, ...] = ()
    syn = flow.proto == IPPROTO_TCP and starts
    # 8. Sessions; a TCP SYN starts a new connection and follows the table.
    if not syn:
        events, conn, hops = session(state, params, key, flow.proto)
        if conn is not None:
            moved = touched(state, conn, flow.proto, tcp_flags)
            update = (key, moved) if moved is not None else None
            return (events, None, conn.hash, None, hops, None, update)
    # 9. Table.
    drop, flow_hash, bucket, hops = pick(state, params, flow)
    if drop is not None:
        return (events, drop, flow_hash, bucket, (), None, None)
    # A mid-connection TCP flow of a Beamer VIP may be any hop's: its session keeps
    # them all. A SYN starts at the first hop, and host_tc takes other protocols there.
    beamer = params.table_kind == abi.TableKind.BEAMER
    tcp = flow.proto == IPPROTO_TCP
    if not tcp:
        st = abi.SessState.UDP
    elif starts:
        st = abi.SessState.TCP_SYN
    else:
        # Met mid-connection; already closing if this is the client's FIN or RST.
        st = abi.SessState.TCP_FIN if tcp_flags & (TCP_FIN | TCP_RST) else abi.SessState.TCP_EST
    entry = ConnEntry(
        hops[0],
        flow_hash,
        later=hops[1:] if beamer and tcp and not starts else (),
        state=st,
        be_gen=state.backends[hops[0]].gen,
        gen=state.config.conn_gen,
        last_seen=state.now,
    )
    return (
        (*events, abi.Event.CONN_MISS, abi.Event.CONN_INSERT),
        None,
        flow_hash,
        bucket,
        hops,
        (key, entry),
        None,
    )


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
