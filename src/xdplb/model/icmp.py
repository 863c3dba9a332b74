"""Steps 4a-4c (bpf/lib/lb_icmp.h): the packets to a VIP address whose ports are not
in their own header.  TCP/UDP fragments go to the address's fragment VIP hashed without
ports, ICMP errors where the flow they quote goes, echo requests are answered."""

from __future__ import annotations

from dataclasses import replace

from xdplb.core import abi
from xdplb.model.checksum import csum_replace16
from xdplb.model.decision import PASS_NOT_VIP, Decision, Outcome, dropped, table_drop
from xdplb.model.encap import forward
from xdplb.model.parse import IPPROTO_TCP, IPPROTO_UDP, Parsed, address
from xdplb.model.policy import check_acl
from xdplb.model.select import pick, session
from xdplb.model.state import DataplaneState, Flow

ICMP_ECHOREPLY, ICMP_DEST_UNREACH, ICMP_ECHO, ICMP_TIME_EXCEEDED = 0, 3, 8, 11
ICMPV6_DEST_UNREACH, ICMPV6_PKT_TOOBIG, ICMPV6_TIME_EXCEED = 1, 2, 3
ICMPV6_ECHO_REQUEST, ICMPV6_ECHO_REPLY = 128, 129
#: TTL / hop limit of the packets lb_xdp answers itself (echo replies, too-big).
REPLY_TTL = 64
_IPV4_OFFSET = 0x1FFF  # the 13-bit fragment offset


def _word(buf: bytes | bytearray, off: int) -> int:
    return int.from_bytes(buf[off : off + 2], "big")


def _echo_reply(frame: bytes, p: Parsed) -> Decision:
    """4c: the echo request answered in place (lb_icmp_echo)."""
    out = bytearray(frame)
    out[0:6], out[6:12] = frame[6:12], frame[0:6]
    l3, l4 = p.l3, p.l4
    alen = 4 if p.version == 4 else 16
    a = l3 + (12 if p.version == 4 else 8)
    out[a : a + alen], out[a + alen : a + 2 * alen] = (
        frame[a + alen : a + 2 * alen],
        frame[a : a + alen],
    )
    if p.version == 4:
        old = _word(out, l3 + 8)
        out[l3 + 8] = REPLY_TTL
        out[l3 + 10 : l3 + 12] = csum_replace16(
            _word(out, l3 + 10), old, _word(out, l3 + 8)
        ).to_bytes(2, "big")
        reply_type = ICMP_ECHOREPLY
    else:
        out[l3 + 7] = REPLY_TTL
        reply_type = ICMPV6_ECHO_REPLY
    old = _word(out, l4)
    out[l4] = reply_type
    out[l4 + 2 : l4 + 4] = csum_replace16(_word(out, l4 + 2), old, _word(out, l4)).to_bytes(
        2, "big"
    )
    return Decision(Outcome.REPLY, events=(abi.Event.ICMP_ECHO,), packet=bytes(out))


def _quoted_flow(frame: bytes, p: Parsed) -> Flow | None:
    """4b: the client's flow from an ICMP error's quote (lb_icmp_quote), or None."""
    q, left = p.l4 + 8, p.l4_len - 8
    if p.version == 4:
        if left < 20 or frame[q] >> 4 != 4:
            return None
        hl = (frame[q] & 0xF) * 4
        proto = frame[q + 9]
        if (
            hl < 20
            or left < hl + 4
            or _word(frame, q + 6) & _IPV4_OFFSET
            or proto not in (IPPROTO_TCP, IPPROTO_UDP)
            or frame[q + 12 : q + 16] != p.dst
        ):
            return None
        client, ports = frame[q + 16 : q + 20], q + hl
    else:
        if left < 44:
            return None
        proto = frame[q + 6]
        if (
            frame[q] >> 4 != 6
            or proto not in (IPPROTO_TCP, IPPROTO_UDP)
            or frame[q + 8 : q + 24] != p.dst
        ):
            return None
        client, ports = frame[q + 24 : q + 40], q + 40
    qsport, qdport = _word(frame, ports), _word(frame, ports + 2)
    return Flow(address(p.version, client), address(p.version, p.dst), qdport, qsport, proto)


def decide_slow(
    state: DataplaneState,
    frame: bytes,
    p: Parsed,
    acl_hits: tuple[tuple[int, abi.AclList], ...] = (),
) -> Decision:
    """Steps 4a-4c: a TCP/UDP fragment or an ICMP message (lb_icmp_frag), after the
    global ACL counted ``acl_hits``."""
    decision = _decide_slow_acl(state, frame, p, acl_hits)
    if acl_hits and not decision.acl_hits:
        decision = replace(decision, acl_hits=acl_hits)
    return decision


def _decide_slow_acl(
    state: DataplaneState,
    frame: bytes,
    p: Parsed,
    acl_hits: tuple[tuple[int, abi.AclList], ...],
) -> Decision:
    info = state.vip_addr_info(p.version, p.dst)
    if info is None:
        return PASS_NOT_VIP
    if p.frag:
        # 4a. The address's fragment VIP for the protocol; hashed with the ports zero.
        port = info.frag_port(p.proto)
        hit = None if port is None else state.vip_index.get((p.version, p.dst, port, p.proto))
        if hit is None:
            return dropped(abi.DropReason.FRAGMENT)
        # 6a. The VIP's ACL holds for its fragments (not for routers' ICMP errors).
        acl_hits, denied = check_acl(
            state, hit[1].vip_id, address(p.version, p.src), p, acl_hits, hit[1]
        )
        if denied is not None:
            return denied
        flow = Flow(address(p.version, p.src), address(p.version, p.dst), 0, 0, p.proto)
        event = abi.Event.FRAGMENT
    else:
        if p.l4_len < 8:
            return dropped(abi.DropReason.ICMP)
        icmp_type = frame[p.l4]
        if p.version == 4:
            if icmp_type == ICMP_ECHO and info.echo:
                return _echo_reply(frame, p)
            errors: tuple[int, ...] = (ICMP_DEST_UNREACH, ICMP_TIME_EXCEEDED)
        else:
            # Answered only without extension headers (a routing header...).
            if icmp_type == ICMPV6_ECHO_REQUEST and info.echo and p.l4_len == p.ip_len - 40:
                return _echo_reply(frame, p)
            errors = (ICMPV6_DEST_UNREACH, ICMPV6_PKT_TOOBIG, ICMPV6_TIME_EXCEED)
        if icmp_type not in errors:
            return PASS_NOT_VIP
        # 4b. The quoted reply, reversed: the client's flow, its VIP.
        quoted = _quoted_flow(frame, p)
        hit = None if quoted is None else state.find_vip(quoted.dst, quoted.dport, quoted.proto)
        if quoted is None or hit is None:
            return dropped(abi.DropReason.ICMP)
        flow = quoted
        event = abi.Event.ICMP_ERROR
    vip, params = hit
    key = flow.key()
    events: tuple[abi.Event, ...] = ()
    hops: tuple[int, ...] = ()
    flow_hash: int | None = None
    bucket: int | None = None
    # The flow's own packets would go: connection table (not for fragments), then
    # the VIP's table; nothing is recorded and no new flow is counted.
    conn = None
    if event is abi.Event.ICMP_ERROR:
        events, conn, hops = session(state, params, key, flow.proto)
    if conn is not None:
        flow_hash = conn.hash
    else:
        drop, flow_hash, bucket, hops = pick(state, params, flow)
        if drop is not None:
            return table_drop(drop, events, flow, vip, params, flow_hash, bucket, acl_hits)
    assert flow_hash is not None
    return forward(
        state, frame, p, flow, vip, params, flow_hash, bucket, hops, (*events, event), acl_hits
    )
