"""Steps 10-11 (bpf/lib/encap.h): the stats of a packet whose hops are chosen and
the outer IP [+ UDP + GUE] headers it leaves with."""

from __future__ import annotations

import struct

from xdplb.core import abi
from xdplb.core.state import ConnEntry, Vip, VipParams
from xdplb.model.checksum import ipv4_checksum
from xdplb.model.decision import Decision, Outcome
from xdplb.model.parse import IPPROTO_UDP, Parsed
from xdplb.model.state import DataplaneState, Flow

IPPROTO_IPIP = 4
IPPROTO_IPV6 = 41
#: Outer header constants of step 11.
OUTER_TTL = 64
IP_DF = 0x4000
UDP_HLEN = 8


def gue_sport(flow_hash: int) -> int:
    """The outer UDP source port: high half of the ephemeral range, for ECMP and RSS."""
    return 0x8000 | (flow_hash & 0x7FFF)


def forward(
    state: DataplaneState,
    frame: bytes,
    p: Parsed,
    flow: Flow,
    vip: Vip,
    params: VipParams,
    flow_hash: int,
    bucket: int | None,
    hops: tuple[int, ...],
    events: tuple[abi.Event, ...],
    acl_hits: tuple[tuple[int, abi.AclList], ...],
    conn_insert: tuple[bytes, ConnEntry] | None = None,
    conn_update: tuple[bytes, ConnEntry] | None = None,
) -> Decision:
    """Steps 10-11 for a packet whose hops are chosen: encapsulated (the stats move
    before encapsulation can fail), or dropped ``NO_CONFIG`` without an outer source."""
    outer = _outer_headers(state, params, p, hops, flow_hash)
    return Decision(
        Outcome.FORWARD if outer is not None else Outcome.DROP,
        events=events,
        drop=None if outer is not None else abi.DropReason.NO_CONFIG,
        flow=flow,
        vip=vip,
        vip_params=params,
        flow_hash=flow_hash,
        bucket=bucket,
        backend_id=hops[0],
        hops=hops,
        gue_sport=gue_sport(flow_hash) if outer is not None else None,
        packet=outer + frame[p.l3 :] if outer is not None else None,
        conn_insert=conn_insert,
        conn_update=conn_update,
        stats_bytes=p.ip_len,
        acl_hits=acl_hits,
    )


def _outer_headers(
    state: DataplaneState,
    params: VipParams,
    p: Parsed,
    hops: tuple[int, ...],
    flow_hash: int,
) -> bytes | None:
    """Step 11's outer IP [+ UDP + GUE] header, or None without a source address."""
    cfg = state.config
    target = state.backends[hops[0]].addr
    inner_proto = IPPROTO_IPIP if p.version == 4 else IPPROTO_IPV6
    tunnel: bytes = b""
    if params.encap == abi.Encap.GUE:
        hop_addrs = b"".join(state.backends[h].addr.packed for h in hops)
        w = 1 if target.version == 4 else 4
        hlen = 1 + len(hops) * w
        gue = bytes((hlen, inner_proto, 0, 0)) + struct.pack("!HBB", 0, 0, len(hops)) + hop_addrs
        udp_len = UDP_HLEN + len(gue) + p.ip_len
        tunnel = struct.pack("!HHHH", gue_sport(flow_hash), cfg.gue_port, udp_len, 0) + gue
        next_proto = IPPROTO_UDP
    else:
        next_proto = inner_proto
    payload_len = len(tunnel) + p.ip_len
    if target.version == 4:
        if cfg.src4 is None or int(cfg.src4) == 0:
            return None
        hdr = struct.pack(
            "!BBHHHBBH4s4s",
            0x45,
            p.tos,
            20 + payload_len,
            0,
            IP_DF,
            OUTER_TTL,
            next_proto,
            0,
            cfg.src4.packed,
            target.packed,
        )
        csum = ipv4_checksum(hdr)
        hdr = hdr[:10] + csum.to_bytes(2, "big") + hdr[12:]
    else:
        if cfg.src6 is None or int(cfg.src6) == 0:
            return None
        hdr = struct.pack(
            "!IHBB16s16s",
            (6 << 28) | (p.tos << 20),
            payload_len,
            next_proto,
            OUTER_TTL,
            cfg.src6.packed,
            target.packed,
        )
    return hdr + tunnel
