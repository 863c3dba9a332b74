"""Steps 1-11 for one frame: :func:`decide` takes it through the steps of the other
modules in the program's order (lb_xdp.bpf.c); :func:`apply` records what a decision
inserts into the connection table."""

from __future__ import annotations

from dataclasses import replace

from xdplb.core import abi
from xdplb.model.decision import PASS_NOT_VIP, Decision, Outcome, table_drop
from xdplb.model.encap import forward
from xdplb.model.icmp import decide_slow
from xdplb.model.parse import IPPROTO_TCP, TCP_ACK, TCP_SYN, address, parse_ip, parse_l4
from xdplb.model.policy import check_acl, rate_limited
from xdplb.model.select import choose
from xdplb.model.state import DataplaneState, Flow, flow_key


def decide(state: DataplaneState, frame: bytes) -> Decision:
    """Steps 1-11 of docs/datapath.md for one Ethernet frame."""
    parsed = parse_ip(frame)
    if isinstance(parsed, Decision):
        return parsed
    # 2'. No VIP's address has the destination's lb_vip_filter bit: nothing else to see.
    if not state.maybe_vip_addr(parsed.dst):
        return PASS_NOT_VIP
    # 2a. The global ACL, for every packet to a VIP address.
    src = address(parsed.version, parsed.src)
    acl_hits, denied = check_acl(state, abi.ACL_GLOBAL, src, parsed, ())
    if denied is not None:
        return denied
    parsed = parse_l4(frame, parsed, state)
    if isinstance(parsed, Decision):
        return replace(parsed, acl_hits=acl_hits) if acl_hits else parsed
    p = parsed
    if p.slow:
        return decide_slow(state, frame, p, acl_hits)
    # 6. The VIP: exact port, then the port-0 wildcard.
    hit = state.find_vip_raw(p.version, p.dst, p.dport, p.proto)
    if hit is None:
        return PASS_NOT_VIP
    vip, params = hit
    # 6a. The VIP's ACL.
    acl_hits, denied = check_acl(state, params.vip_id, src, p, acl_hits, params)
    if denied is not None:
        return denied
    # 7. The flow key: the connection table's key whatever the VIP hashes.
    key = flow_key(p.src, p.dst, p.sport, p.dport, p.proto)
    flow = Flow(src, address(p.version, p.dst), p.sport, p.dport, p.proto)
    starts = p.proto != IPPROTO_TCP or p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
    # 8a. The new-flow rate limit.
    limited = rate_limited(state, params, key, flow, starts)
    if limited is not None:
        return Decision(
            Outcome.DROP,
            events=limited,
            drop=abi.DropReason.RATE_LIMIT,
            flow=flow,
            vip=vip,
            vip_params=params,
            acl_hits=acl_hits,
        )
    events, drop, flow_hash, bucket, hops, conn_insert, conn_update = choose(
        state, params, key, flow, starts, p.tcp_flags
    )
    if conn_insert is not None and state.over_budget and state.config.flood_max:
        # 9. Over the insert budget: balanced by the table, not recorded.
        events, conn_insert = (*events[:-1], abi.Event.CONN_FLOOD), None
    if drop is not None:
        return table_drop(drop, events, flow, vip, params, flow_hash, bucket, acl_hits)
    assert flow_hash is not None and hops
    return forward(
        state,
        frame,
        p,
        flow,
        vip,
        params,
        flow_hash,
        bucket,
        hops,
        events,
        acl_hits,
        conn_insert,
        conn_update,
    )


def apply(state: DataplaneState, decision: Decision) -> DataplaneState:
    """The state after a decision: its session-table insert or update applied.

    Copies the session table; for long packet sequences keep a dict and
    write ``decision.conn_insert`` and ``decision.conn_update`` into it yourself.
    """
    written = [w for w in (decision.conn_insert, decision.conn_update) if w is not None]
    if not written:
        return state
    conns = dict(state.conns)
    for key, entry in written:
        conns[key] = entry
    return replace(state, conns=conns)
