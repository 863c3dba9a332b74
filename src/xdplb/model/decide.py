"""The reference model of ``lb_xdp``: what the XDP program must do with one frame.

docs/datapath.md is the contract; this module is that page as executable Python,
step by step (the step numbers in comments are the page's).  The tests run the
same packets through the real program (BPF_PROG_TEST_RUN) and through
:func:`decide` and compare verdicts, counters and output bytes, so a bug on
either side shows up as a disagreement rather than as a lost connection.

The model is pure: a frozen :class:`DataplaneState` (what the maps hold) and a
frame go in, a frozen :class:`Decision` comes out, no I/O.  It stops where
the program starts depending on the kernel's neighbour and route tables
(``bpf_fib_lookup``): a forwarded packet is :attr:`Outcome.FORWARD` with the
exact encapsulated packet from the outer IP header on; whether it then leaves
by ``XDP_TX``, ``XDP_REDIRECT`` or ``XDP_PASS`` is the FIB's business.

Packets are parsed with ``struct`` and slicing, not scapy: the tests push
hundreds of thousands of frames through here, and a parser that "fixes" a
malformed packet on the way in would hide exactly the cases that matter.

For bulk questions ("which backend gets each of these 10^6 flows?") use
:func:`predict_many`, which hashes with numpy.
"""

from __future__ import annotations

import enum
import ipaddress
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import numpy.typing as npt

from xdplb.core import abi, hashing
from xdplb.core.acl import AclIndex, AclKey, rate_key
from xdplb.core.addresses import IPAddress, IPNetwork
from xdplb.core.state import (
    BackendState,
    ConnEntry,
    LbConfig,
    LookupTable,
    Snapshot,
    Vip,
    VipAddrInfo,
    VipParams,
    vip_addr_infos,
)

U32Array = npt.NDArray[np.uint32]

ETH_HLEN = 14
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
#: The tags lb_xdp skips (one of them, once): 802.1Q and 802.1ad.
ETH_P_8021Q = 0x8100
ETH_P_8021AD = 0x88A8
VLAN_HLEN = 4

IPPROTO_IPIP = 4
IPPROTO_IPV6 = 41
IPPROTO_TCP = abi.IPPROTO_TCP
IPPROTO_UDP = abi.IPPROTO_UDP

#: Outer header constants of step 11.
OUTER_TTL = 64
IP_DF = 0x4000
UDP_HLEN = 8
GUE_HLEN = 4
#: GUE private data before the hops: ``__be16`` type, next hop index, hop count.
GUE_PRIV_HLEN = 4

_IPV4_MF_OFFSET = 0x3FFF  # MF flag and the 13-bit fragment offset
_IPV4_OFFSET = 0x1FFF
_TCP_SYN, _TCP_ACK = 0x02, 0x10

IPPROTO_ICMP = 1
IPPROTO_ICMPV6 = 58
#: IPv6 extension headers walked in step 2: hop-by-hop, routing, destination options,
#: fragment.
IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT = 0, 43, 60, 44
_EXTHDRS = frozenset((IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT))
_IPV6_FRAG_OFFSET_MF = 0xFFF9
ICMP_ECHOREPLY, ICMP_DEST_UNREACH, ICMP_ECHO, ICMP_TIME_EXCEEDED = 0, 3, 8, 11
ICMPV6_DEST_UNREACH, ICMPV6_PKT_TOOBIG, ICMPV6_TIME_EXCEED = 1, 2, 3
ICMPV6_ECHO_REQUEST, ICMPV6_ECHO_REPLY = 128, 129
#: TTL / hop limit of the packets lb_xdp answers itself (echo replies, too-big).
REPLY_TTL = 64


class XdpAction(enum.IntEnum):
    """The program's return value (``enum xdp_action`` of the kernel UAPI)."""

    ABORTED = 0
    DROP = 1
    PASS = 2
    TX = 3
    REDIRECT = 4


class Outcome(enum.Enum):
    """What the model can decide without the kernel's FIB."""

    #: ``XDP_DROP``; :attr:`Decision.drop` says why.
    DROP = "drop"
    #: ``XDP_PASS`` of the frame untouched; :attr:`Decision.events` says why.
    PASS = "pass"
    #: Encapsulated to :attr:`Decision.backend_id`.  The program then returns
    #: ``XDP_TX`` / ``XDP_REDIRECT`` / ``XDP_PASS`` (no neighbour yet) or drops with
    #: reason ``FIB``, by ``bpf_fib_lookup`` (step 12), which the model cannot know.
    FORWARD = "forward"
    #: Answered in place and sent back out (``XDP_TX``): an echo reply (step 4c);
    #: :attr:`Decision.packet` is the whole frame, Ethernet header included.
    REPLY = "reply"


# ---------------------------------------------------------------------------
# Flows and the model's state (the map types themselves are in xdplb.core.state)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Flow:
    """A 5-tuple as lb_xdp sees it; ports in host order."""

    src: IPAddress
    dst: IPAddress
    sport: int
    dport: int
    proto: int

    def __post_init__(self) -> None:
        if self.src.version != self.dst.version:
            raise ValueError(f"mixed families: {self.src} -> {self.dst}")

    def key(self) -> bytes:
        """The 40 bytes of ``struct xdplb_flow_key`` (the ``lb_conns`` key)."""
        return flow_key(self.src.packed, self.dst.packed, self.sport, self.dport, self.proto)

    def hash_key(self, src_only: bool = False) -> bytes:
        """The bytes that are hashed: the key, or with ``VIP_F_SRC_HASH`` the source only."""
        if src_only:
            return self.src.packed.ljust(hashing.FLOW_KEY_SIZE, b"\0")
        return self.key()


def flow_key(src: bytes, dst: bytes, sport: int, dport: int, proto: int) -> bytes:
    """``struct xdplb_flow_key`` from raw addresses (4 or 16 bytes), every other byte 0."""
    return src.ljust(16, b"\0") + dst.ljust(16, b"\0") + struct.pack("!HHB3x", sport, dport, proto)


def _addr_key(addr: IPAddress) -> tuple[int, bytes]:
    return (addr.version, addr.packed)


@dataclass(frozen=True)
class DataplaneState:
    """Everything lb_xdp reads from its maps, as plain values.

    ``conns`` is read, never written, by :func:`decide`: a decision reports the entry
    it would insert (:attr:`Decision.conn_insert`) and the caller applies it (see
    :func:`apply`), so one state can answer many "what if" questions.
    """

    #: ``lb_vips``.
    vips: Mapping[Vip, VipParams]
    #: ``lb_backends``: id -> slot; ids absent here are empty (all-zero) slots.
    backends: Mapping[int, BackendState]
    #: ``lb_tables`` and ``lb_btables`` (by the VIP's kind): vip id -> inner table; a VIP
    #: without one drops ``NO_TABLE``.
    tables: Mapping[int, LookupTable]
    #: ``lb_config[0]``.
    config: LbConfig
    #: ``lb_conns``: flow key bytes (:meth:`Flow.key`) -> entry.
    conns: Mapping[bytes, ConnEntry] = field(default_factory=dict)
    #: ``lb_vip_addrs``; None means what the control plane keeps it at for ``vips``
    #: without options (``state.vip_addr_infos``: fragments to the port-0 or only VIP,
    #: no echo).  A set of addresses means those addresses with the default infos of
    #: the VIPs on them.  Give it explicitly to model options or a map out of step.
    vip_addrs: Mapping[IPAddress, VipAddrInfo] | frozenset[IPAddress] | None = None
    #: ``lb_backends``' max_entries (``limits.backends``): an id at or beyond it has no
    #: slot, as ``bpf_map_lookup_elem`` on an array finds none.
    max_backends: int = abi.MAX_BACKENDS
    #: ``lb_acl4`` and ``lb_acl6``: every scope's rules (steps 5a, 6a).
    acl: Mapping[AclKey, abi.AclList] = field(default_factory=dict)
    #: Step 8a: the source prefixes (as ``acl.rate_key`` masks them) whose token bucket
    #: is empty now; the caller keeps the clock and the buckets.
    rate_limited: frozenset[IPNetwork] = frozenset()
    #: Step 9: this CPU's connection-table insert budget for the window is used up
    #: (matters only while ``config.flood_max`` is not 0).
    over_budget: bool = False

    # Indexes by raw bytes, built once: decide() runs per packet, hundreds of
    # thousands of times in the tests.  cached_property writes to __dict__, which
    # a frozen dataclass allows.
    @cached_property
    def _vip_index(self) -> dict[tuple[int, bytes, int, int], tuple[Vip, VipParams]]:
        return {(*_addr_key(v.addr), v.port, v.proto): (v, p) for v, p in self.vips.items()}

    @cached_property
    def acl_index(self) -> AclIndex:
        return AclIndex(self.acl)

    @cached_property
    def _vip_addr_index(self) -> dict[tuple[int, bytes], VipAddrInfo]:
        infos: Mapping[IPAddress, VipAddrInfo]
        if isinstance(self.vip_addrs, Mapping):
            infos = self.vip_addrs
        else:
            derived = vip_addr_infos(self.vips)
            addrs = derived.keys() if self.vip_addrs is None else self.vip_addrs
            infos = {a: derived.get(a, VipAddrInfo(0)) for a in addrs}
        return {_addr_key(a): info for a, info in infos.items()}

    def backend_usable(self, backend_id: int) -> bool:
        """A backend the program may send to: id ≠ 0, in range, slot active."""
        if backend_id == 0 or backend_id >= self.max_backends:
            return False
        slot = self.backends.get(backend_id)
        return slot is not None and slot.active

    def find_vip(self, dst: IPAddress, dport: int, proto: int) -> tuple[Vip, VipParams] | None:
        """Step 6: the exact ``(dst, dport, proto)`` entry, else the port-0 wildcard."""
        return self._find_vip(dst.version, dst.packed, dport, proto)

    def _find_vip(
        self, version: int, dst: bytes, dport: int, proto: int
    ) -> tuple[Vip, VipParams] | None:
        index = self._vip_index
        hit = index.get((version, dst, dport, proto))
        if hit is None:
            hit = index.get((version, dst, 0, proto))
        return hit

    def is_vip_addr(self, version: int, addr: bytes) -> bool:
        """``lb_vip_addrs`` membership (steps 4 and 5, where the port is unknown)."""
        return (version, addr) in self._vip_addr_index

    def vip_addr_info(self, version: int, addr: bytes) -> VipAddrInfo | None:
        """``lb_vip_addrs[addr]``, or None."""
        return self._vip_addr_index.get((version, addr))


# ---------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What lb_xdp does with one frame, up to (not including) the FIB lookup."""

    outcome: Outcome
    #: Events counted in ``lb_events``, in order.  For FORWARD this stops before
    #: step 12's TX / REDIRECT / FIB_PASS, which depends on the FIB.
    events: tuple[abi.Event, ...] = ()
    #: The ``lb_drops`` index counted, for DROP.
    drop: abi.DropReason | None = None
    #: The parsed 5-tuple, from step 7 on.
    flow: Flow | None = None
    #: The VIP matched in step 6 and its value.
    vip: Vip | None = None
    vip_params: VipParams | None = None
    #: The flow hash used (stored one on a connection-table hit).
    flow_hash: int | None = None
    #: The table bucket, when the table was consulted.
    bucket: int | None = None
    #: The chosen backend (first hop = outer destination).
    backend_id: int | None = None
    #: Every hop written into the GUE hop list, first hop first.
    hops: tuple[int, ...] = ()
    #: ``0x8000 | (hash & 0x7fff)``: the GUE (outer UDP) source port.
    gue_sport: int | None = None
    #: FORWARD: the frame from the outer IP header to its end (outer IP [+ UDP + GUE] +
    #: the original IP packet + any trailing bytes the frame had).  The Ethernet header
    #: in front of it is the FIB's (step 12).
    packet: bytes | None = None
    #: The entry inserted into ``lb_conns`` (key, value), on a table lookup that chose
    #: a backend (also when a later step drops the packet).
    conn_insert: tuple[bytes, ConnEntry] | None = None
    #: Inner IP length, added to ``bytes`` of the VIP's and the backend's stats (step
    #: 10) whenever a backend was chosen; None when no stats move.
    stats_bytes: int | None = None
    #: The ACL hit counted (``lb_acl_hits``): (scope, list); the scope is a vip id or
    #: ``abi.ACL_GLOBAL``.  Several scopes may count (global allow, then the VIP's).
    acl_hits: tuple[tuple[int, abi.AclList], ...] = ()

    @property
    def new_flow(self) -> bool:
        """Whether ``new_flows`` of the VIP and backend stats moves: the flow was
        balanced by the table (recorded or not)."""
        return abi.Event.CONN_MISS in self.events

    def allows(self, action: int) -> bool:
        """Whether the program's return value is consistent with this decision.

        FORWARD admits every step-12 outcome (including a FIB drop); callers that
        know the FIB should check the exact action themselves.
        """
        if self.outcome is Outcome.DROP:
            return action == XdpAction.DROP
        if self.outcome is Outcome.PASS:
            return action == XdpAction.PASS
        if self.outcome is Outcome.REPLY:
            return action == XdpAction.TX
        return action in (XdpAction.TX, XdpAction.REDIRECT, XdpAction.PASS, XdpAction.DROP)

    def describe(self) -> str:
        """One line for test failures."""
        parts = [self.outcome.value]
        if self.drop is not None:
            parts.append(f"drop={self.drop.name}")
        if self.events:
            parts.append("events=" + ",".join(e.name for e in self.events))
        if self.flow is not None:
            f = self.flow
            parts.append(f"flow={f.src}:{f.sport}->{f.dst}:{f.dport}/{f.proto}")
        if self.backend_id is not None:
            parts.append(f"backend={self.backend_id} hops={list(self.hops)}")
        if self.flow_hash is not None:
            parts.append(f"hash={self.flow_hash:#010x}")
        return " ".join(parts)


def _pass(event: abi.Event) -> Decision:
    return Decision(Outcome.PASS, events=(event,))


def _drop(reason: abi.DropReason) -> Decision:
    return Decision(Outcome.DROP, drop=reason)


_PASS_NOT_IP = _pass(abi.Event.PASS_NOT_IP)
_PASS_MALFORMED = _pass(abi.Event.PASS_MALFORMED)
_PASS_NOT_VIP = _pass(abi.Event.PASS_NOT_VIP)


def gue_sport(flow_hash: int) -> int:
    """The outer UDP source port: high half of the ephemeral range, for ECMP and RSS."""
    return 0x8000 | (flow_hash & 0x7FFF)


def ipv4_checksum(header: bytes) -> int:
    """RFC 1071 one's-complement sum of a header whose checksum field is zero."""
    total: int = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


@dataclass(frozen=True)
class _Parsed:
    """The frame as steps 1-5 leave it."""

    l3: int  # offset of the IP header
    version: int
    ip_len: int  # tot_len, or 40 + payload_len
    tos: int  # TOS / traffic class
    src: bytes
    dst: bytes
    proto: int  # the upper-layer protocol (after IPv6 extension headers)
    sport: int  # 0 for fragments and ICMP
    dport: int
    tcp_flags: int  # 0 for UDP
    l4: int = 0  # offset of the upper-layer header
    l4_len: int = 0  # IP payload from l4 on
    frag: bool = False  # IPv4 MF/offset, IPv6 fragment header with either
    #: Steps 4a-4c take it (a TCP/UDP fragment, or ICMP): :func:`_decide_slow`.
    slow: bool = False


def _walk_exthdrs(frame: bytes, pos: int, nexthdr: int, left: int) -> tuple[int, int, int, bool]:
    """Step 2's IPv6 extension headers (parse_ip6_exthdrs in bpf/lib/parsing.h):
    (upper-layer protocol, its offset, IP payload left, fragment), or proto -1."""
    for _ in range(abi.MAX_EXTHDRS):
        if nexthdr not in _EXTHDRS:
            return nexthdr, pos, left, False
        if left < 8:
            return -1, pos, left, False
        hlen = 8 if nexthdr == IPPROTO_FRAGMENT else (frame[pos + 1] + 1) * 8
        if hlen > left:
            return -1, pos, left, False
        left -= hlen
        # A fragment with an offset or MF: payload follows, not headers.
        frag_bits = int.from_bytes(frame[pos + 2 : pos + 4], "big") & _IPV6_FRAG_OFFSET_MF
        if nexthdr == IPPROTO_FRAGMENT and frag_bits:
            return frame[pos], pos + hlen, left, True
        nexthdr, pos = frame[pos], pos + hlen
    if nexthdr in _EXTHDRS:
        return -1, pos, left, False
    return nexthdr, pos, left, False


def _parse_ip(frame: bytes) -> _Parsed | Decision:
    """Steps 1-2: addresses, lengths and the upper-layer protocol, or the decision."""
    n = len(frame)
    # 1. Ethernet, one 802.1Q / 802.1ad tag skipped.
    if n < ETH_HLEN:
        return _PASS_NOT_IP
    l3 = ETH_HLEN
    proto = int.from_bytes(frame[12:14], "big")
    if proto in (ETH_P_8021Q, ETH_P_8021AD):
        if n < ETH_HLEN + VLAN_HLEN:
            return _PASS_NOT_IP
        proto = int.from_bytes(frame[16:18], "big")
        l3 += VLAN_HLEN
    left = n - l3

    # 2. IP header sanity against the frame.
    if proto == ETH_P_IP:
        if left < 20:
            return _PASS_MALFORMED
        vihl = frame[l3]
        ihl = (vihl & 0xF) * 4
        if vihl >> 4 != 4 or ihl < 20 or ihl > left:
            return _PASS_MALFORMED
        ip_len = int.from_bytes(frame[l3 + 2 : l3 + 4], "big")
        if not ihl <= ip_len <= left:
            return _PASS_MALFORMED
        frag = bool(int.from_bytes(frame[l3 + 6 : l3 + 8], "big") & _IPV4_MF_OFFSET)
        return _Parsed(
            l3,
            4,
            ip_len,
            frame[l3 + 1],
            frame[l3 + 12 : l3 + 16],
            frame[l3 + 16 : l3 + 20],
            frame[l3 + 9],
            0,
            0,
            0,
            l3 + ihl,
            ip_len - ihl,
            frag,
        )
    if proto == ETH_P_IPV6:
        if left < 40:
            return _PASS_MALFORMED
        ip_len = 40 + int.from_bytes(frame[l3 + 4 : l3 + 6], "big")
        if frame[l3] >> 4 != 6 or ip_len > left:
            return _PASS_MALFORMED
        l4proto, l4, l4_len, frag = frame[l3 + 6], l3 + 40, ip_len - 40, False
        # 2. Extension headers, unless TCP or UDP comes first (the fast path).
        if l4proto != IPPROTO_TCP and l4proto != IPPROTO_UDP:
            l4proto, l4, l4_len, frag = _walk_exthdrs(frame, l4, l4proto, l4_len)
            if l4proto < 0:
                return _PASS_MALFORMED
        return _Parsed(
            l3,
            6,
            ip_len,
            (int.from_bytes(frame[l3 : l3 + 2], "big") >> 4) & 0xFF,
            frame[l3 + 8 : l3 + 24],
            frame[l3 + 24 : l3 + 40],
            l4proto,
            0,
            0,
            0,
            l4,
            l4_len,
            frag,
        )
    return _PASS_NOT_IP


def _parse_l4(frame: bytes, p: _Parsed, state: DataplaneState) -> _Parsed | Decision:
    """Steps 3-5: fragments and ICMP to the slow path, other protocols pass, ports."""
    # 3. TCP and UDP are balanced; ICMP (not a fragment) and TCP/UDP fragments take 4a-4c.
    if p.proto != IPPROTO_TCP and p.proto != IPPROTO_UDP:
        icmp = IPPROTO_ICMP if p.version == 4 else IPPROTO_ICMPV6
        if not p.frag and p.proto == icmp:
            return replace(p, slow=True)
        return _PASS_NOT_VIP
    # 4. Fragments: only the first has ports; every one is balanced without them.
    if p.frag:
        return replace(p, slow=True)
    # 5. The L4 header must lie inside the IP packet (not merely inside the frame:
    #    Ethernet padding is not payload).
    l4, l4_len = p.l4, p.l4_len
    if p.proto == IPPROTO_TCP:
        ok = l4_len >= 20 and 5 * 4 <= (frame[l4 + 12] >> 4) * 4 <= l4_len
    else:
        ok = l4_len >= 8
    if not ok:
        if state.is_vip_addr(p.version, p.dst):
            return _drop(abi.DropReason.MALFORMED_L4)
        return _PASS_NOT_VIP
    sport = int.from_bytes(frame[l4 : l4 + 2], "big")
    dport = int.from_bytes(frame[l4 + 2 : l4 + 4], "big")
    flags = frame[l4 + 13] if p.proto == IPPROTO_TCP else 0
    return replace(p, sport=sport, dport=dport, tcp_flags=flags)


def _ip(version: int, raw: bytes) -> IPAddress:
    return ipaddress.IPv4Address(raw) if version == 4 else ipaddress.IPv6Address(raw)


def decide(state: DataplaneState, frame: bytes) -> Decision:
    """Steps 1-11 of docs/datapath.md for one Ethernet frame."""
    parsed = _parse_ip(frame)
    if isinstance(parsed, Decision):
        return parsed
    # 2a. The global ACL, for every packet to a VIP address.
    src = _ip(parsed.version, parsed.src)
    acl_hits, denied = _acl(state, abi.ACL_GLOBAL, src, parsed, ())
    if denied is not None:
        return denied
    parsed = _parse_l4(frame, parsed, state)
    if isinstance(parsed, Decision):
        return replace(parsed, acl_hits=acl_hits) if acl_hits else parsed
    p = parsed
    if p.slow:
        return _decide_slow(state, frame, p, acl_hits)
    # 6. The VIP: exact port, then the port-0 wildcard.
    hit = state._find_vip(p.version, p.dst, p.dport, p.proto)
    if hit is None:
        return _PASS_NOT_VIP
    vip, params = hit
    # 6a. The VIP's ACL.
    acl_hits, denied = _acl(state, params.vip_id, src, p, acl_hits, params)
    if denied is not None:
        return denied
    # 7. The flow key: the connection table's key whatever the VIP hashes.
    key = flow_key(p.src, p.dst, p.sport, p.dport, p.proto)
    flow = Flow(src, _ip(p.version, p.dst), p.sport, p.dport, p.proto)
    starts = p.proto != IPPROTO_TCP or p.tcp_flags & (_TCP_SYN | _TCP_ACK) == _TCP_SYN
    # 8a. The new-flow rate limit.
    limited = _rate_limited(state, key, flow, starts)
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
    events, drop, flow_hash, bucket, hops, conn_insert = _choose(state, params, key, flow, starts)
    if conn_insert is not None and state.over_budget and state.config.flood_max:
        # 9. Over the insert budget: balanced by the table, not recorded.
        events, conn_insert = (*events[:-1], abi.Event.CONN_FLOOD, events[-1]), None
    if drop is not None:
        return Decision(
            Outcome.DROP,
            events=events,
            drop=drop,
            flow=flow,
            vip=vip,
            vip_params=params,
            flow_hash=flow_hash,
            bucket=bucket,
            acl_hits=acl_hits,
        )
    assert flow_hash is not None and hops
    return _forward(
        state, frame, p, flow, vip, params, flow_hash, bucket, hops, events, acl_hits, conn_insert
    )


def _forward(
    state: DataplaneState,
    frame: bytes,
    p: _Parsed,
    flow: Flow,
    vip: Vip,
    params: VipParams,
    flow_hash: int,
    bucket: int | None,
    hops: tuple[int, ...],
    events: tuple[abi.Event, ...],
    acl_hits: tuple[tuple[int, abi.AclList], ...],
    conn_insert: tuple[bytes, ConnEntry] | None = None,
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
        stats_bytes=p.ip_len,
        acl_hits=acl_hits,
    )


def _acl(
    state: DataplaneState,
    scope: int,
    src: IPAddress,
    p: _Parsed,
    hits: tuple[tuple[int, abi.AclList], ...],
    params: VipParams | None = None,
) -> tuple[tuple[tuple[int, abi.AclList], ...], Decision | None]:
    """Steps 5a (``params`` None: the global scope, VIP addresses only) and 6a: the hits
    so far, and the drop when the scope denies the source.  A scope without rules (its
    flags clear) is not looked up at all."""
    if params is None:
        flags = state.config.flags
        on, deny = abi.CFG_F_ACL | abi.CFG_F_ACL_DENY, abi.CFG_F_ACL_DENY
        if not flags & on or not state.is_vip_addr(p.version, p.dst):
            return hits, None
    else:
        flags = params.flags
        on, deny = abi.VIP_F_ACL | abi.VIP_F_ACL_DENY, abi.VIP_F_ACL_DENY
        if not flags & on:
            return hits, None
    lst = state.acl_index.verdict(scope, src, bool(flags & deny))
    if lst is None:
        return hits, None
    hits = (*hits, (scope, lst))
    if lst is abi.AclList.ALLOW:
        return hits, None
    return hits, Decision(Outcome.DROP, drop=abi.DropReason.ACL, acl_hits=hits)


def _rate_limited(
    state: DataplaneState, key: bytes, flow: Flow, starts: bool
) -> tuple[abi.Event, ...] | None:
    """Step 8a: None when the packet goes on, else the events counted before its drop.
    Only a packet on its way to the table as a new flow (a TCP SYN, a UDP packet
    without a usable connection-table entry) draws from its prefix's bucket."""
    cfg = state.config
    if not cfg.rl_rate or not starts:
        return None
    events: tuple[abi.Event, ...] = ()
    if flow.proto != IPPROTO_TCP:
        conn = state.conns.get(key)
        if conn is not None:
            if state.backend_usable(conn.backend_id):
                return None
            events = (abi.Event.CONN_STALE,)
    bucket = rate_key(flow.src, cfg.rl_prefix4, cfg.rl_prefix6)
    if cfg.rl_burst == 0 or bucket in state.rate_limited:
        return events
    return None


_Choice = tuple[
    tuple[abi.Event, ...],
    abi.DropReason | None,
    int | None,
    int | None,
    tuple[int, ...],
    tuple[bytes, ConnEntry] | None,
]


def _choose(
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
    drop, flow_hash, bucket, hops = _pick(state, params, flow)
    if drop is not None:
        return (events, drop, flow_hash, bucket, (), None)
    beamer = params.table_kind == abi.TableKind.BEAMER
    # Beamer records only connections sure to start on the first hop: a mid-flow TCP
    # packet may be a later hop's, and a record would drop those hops from its list.
    insert = (key, ConnEntry(hops[0], flow_hash)) if starts or not beamer else None
    return ((*events, abi.Event.CONN_MISS), None, flow_hash, bucket, hops, insert)


def _pick(
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


def _outer_headers(
    state: DataplaneState,
    params: VipParams,
    p: _Parsed,
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


# ---------------------------------------------------------------------------
# Steps 4a-4c: fragments and ICMP to a VIP address (bpf/lib/lb_icmp.h)
# ---------------------------------------------------------------------------


def csum_replace16(csum: int, old: int, new: int) -> int:
    """RFC 1624 eqn. 3: a checksum after one 16-bit word of its data changed."""
    total = (~csum & 0xFFFF) + (~old & 0xFFFF) + new
    total = (total & 0xFFFF) + (total >> 16)
    total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _word(buf: bytes | bytearray, off: int) -> int:
    return int.from_bytes(buf[off : off + 2], "big")


def _echo_reply(frame: bytes, p: _Parsed) -> Decision:
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


def _quoted_flow(frame: bytes, p: _Parsed) -> Flow | None:
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
    return Flow(_ip(p.version, client), _ip(p.version, p.dst), qdport, qsport, proto)


def _decide_slow(
    state: DataplaneState,
    frame: bytes,
    p: _Parsed,
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
    p: _Parsed,
    acl_hits: tuple[tuple[int, abi.AclList], ...],
) -> Decision:
    info = state.vip_addr_info(p.version, p.dst)
    if info is None:
        return _PASS_NOT_VIP
    if p.frag:
        # 4a. The address's fragment VIP for the protocol; hashed with the ports zero.
        port = info.frag_port(p.proto)
        hit = None if port is None else state._vip_index.get((p.version, p.dst, port, p.proto))
        if hit is None:
            return _drop(abi.DropReason.FRAGMENT)
        # 6a. The VIP's ACL holds for its fragments (not for routers' ICMP errors).
        acl_hits, denied = _acl(state, hit[1].vip_id, _ip(p.version, p.src), p, acl_hits, hit[1])
        if denied is not None:
            return denied
        flow = Flow(_ip(p.version, p.src), _ip(p.version, p.dst), 0, 0, p.proto)
        event = abi.Event.FRAGMENT
    else:
        if p.l4_len < 8:
            return _drop(abi.DropReason.ICMP)
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
            return _PASS_NOT_VIP
        # 4b. The quoted reply, reversed: the client's flow, its VIP.
        quoted = _quoted_flow(frame, p)
        hit = None if quoted is None else state.find_vip(quoted.dst, quoted.dport, quoted.proto)
        if quoted is None or hit is None:
            return _drop(abi.DropReason.ICMP)
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
    conn = state.conns.get(key) if event is abi.Event.ICMP_ERROR else None
    if conn is not None and state.backend_usable(conn.backend_id):
        events, flow_hash, hops = (abi.Event.CONN_HIT,), conn.hash, (conn.backend_id,)
    else:
        if conn is not None:
            events = (abi.Event.CONN_STALE,)
        drop, flow_hash, bucket, hops = _pick(state, params, flow)
        if drop is not None:
            return Decision(
                Outcome.DROP,
                events=events,
                drop=drop,
                flow=flow,
                vip=vip,
                vip_params=params,
                flow_hash=flow_hash,
                bucket=bucket,
                acl_hits=acl_hits,
            )
    assert flow_hash is not None
    return _forward(
        state, frame, p, flow, vip, params, flow_hash, bucket, hops, (*events, event), acl_hits
    )


def apply(state: DataplaneState, decision: Decision) -> DataplaneState:
    """The state after a decision: its connection-table insert applied.

    Copies the connection table; for long packet sequences keep a dict and
    insert ``decision.conn_insert`` into it yourself.
    """
    if decision.conn_insert is None:
        return state
    key, entry = decision.conn_insert
    conns = dict(state.conns)
    conns[key] = entry
    return replace(state, conns=conns)


# ---------------------------------------------------------------------------
# Flows without packets
# ---------------------------------------------------------------------------


def predict_backend(state: DataplaneState, flow: Flow) -> int | None:
    """The backend a packet of ``flow`` goes to (steps 6-9), or None if it does not: a
    packet of an open connection (a TCP SYN skips the connection table).

    None covers "not a VIP" as well as the table drops; use :func:`decide` on a
    frame to learn which.
    """
    hit = state.find_vip(flow.dst, flow.dport, flow.proto)
    if hit is None:
        return None
    _vip, params = hit
    starts = flow.proto != IPPROTO_TCP
    _events, drop, _hash, _bucket, hops, _insert = _choose(state, params, flow.key(), flow, starts)
    return None if drop is not None else hops[0]


@dataclass(frozen=True, eq=False)
class FlowBatch:
    """Many flows as columns, for :func:`predict_many`.

    Addresses are the four ``__u32`` words of the C key (IPv4 in word 0), read
    little-endian from network-order bytes, exactly as ``abi.addr_words`` does.
    """

    #: ``(n, 4)`` uint32.
    src: U32Array
    #: ``(n, 4)`` uint32.
    dst: U32Array
    #: ``(n,)`` host-order ports.
    sport: npt.NDArray[np.uint16]
    dport: npt.NDArray[np.uint16]
    #: ``(n,)`` IP protocol numbers.
    proto: npt.NDArray[np.uint8]
    #: ``(n,)`` 4 or 6.
    family: npt.NDArray[np.uint8]

    def __len__(self) -> int:
        return int(self.sport.shape[0])

    @classmethod
    def from_flows(cls, flows: Sequence[Flow]) -> FlowBatch:
        src = np.frombuffer(
            b"".join(f.src.packed.ljust(16, b"\0") for f in flows), dtype="<u4"
        ).reshape(-1, 4)
        dst = np.frombuffer(
            b"".join(f.dst.packed.ljust(16, b"\0") for f in flows), dtype="<u4"
        ).reshape(-1, 4)
        return cls(
            src.astype(np.uint32),
            dst.astype(np.uint32),
            np.array([f.sport for f in flows], dtype=np.uint16),
            np.array([f.dport for f in flows], dtype=np.uint16),
            np.array([f.proto for f in flows], dtype=np.uint8),
            np.array([f.src.version for f in flows], dtype=np.uint8),
        )

    def words(self, src_only: npt.NDArray[np.bool_] | None = None) -> U32Array:
        """The ``(n, 10)`` words of each flow key; rows in ``src_only`` keep the source only."""
        n = len(self)
        words = np.zeros((n, hashing.FLOW_WORDS), dtype=np.uint32)
        words[:, 0:4] = self.src
        words[:, 4:8] = self.dst
        # Ports are __be16 in memory; read little-endian as one word: byte-swapped halves.
        sport_be = self.sport.astype(np.uint16).byteswap().astype(np.uint32)
        dport_be = self.dport.astype(np.uint16).byteswap().astype(np.uint32)
        words[:, 8] = sport_be | (dport_be << np.uint32(16))
        words[:, 9] = self.proto.astype(np.uint32)
        if src_only is not None:
            words[src_only, 4:] = 0
        return words


@dataclass(frozen=True, eq=False)
class Predictions:
    """:func:`predict_many`'s answer, one row per flow."""

    #: The chosen backend, 0 where the flow is not forwarded (no VIP, or a table drop).
    backend: U32Array
    #: The flow hash that chose it (the stored one on a connection-table hit).
    flow_hash: U32Array
    #: ``vip_id`` of the matched VIP, -1 where none matched.
    vip_id: npt.NDArray[np.int64]

    @property
    def gue_sport(self) -> npt.NDArray[np.uint16]:
        return (np.uint32(0x8000) | (self.flow_hash & np.uint32(0x7FFF))).astype(np.uint16)


def predict_many(state: DataplaneState, flows: FlowBatch | Sequence[Flow]) -> Predictions:
    """:func:`predict_backend` for many flows at once, hashing with numpy.

    The VIP lookup runs once per distinct (dst, dport, proto) and the hash once
    per flow in numpy; only connection-table hits (if ``state.conns`` is not
    empty) cost a Python dict lookup per flow.
    """
    batch = flows if isinstance(flows, FlowBatch) else FlowBatch.from_flows(flows)
    n = len(batch)
    backend = np.zeros(n, dtype=np.uint32)
    out_hash = np.zeros(n, dtype=np.uint32)
    vip_id = np.full(n, -1, dtype=np.int64)
    src_only = np.zeros(n, dtype=bool)

    # Step 6 per distinct destination, not per flow.
    dst_bytes = batch.dst.astype("<u4").view(np.uint8).reshape(n, 16)
    groups: dict[tuple[bytes, int, int, int], list[int]] = {}
    for i in range(n):
        fam = int(batch.family[i])
        raw = dst_bytes[i, : 4 if fam == 4 else 16].tobytes()
        groups.setdefault((raw, fam, int(batch.dport[i]), int(batch.proto[i])), []).append(i)
    params_of: dict[int, VipParams] = {}
    for (raw, fam, dport, proto), members in groups.items():
        hit = state._find_vip(fam, raw, dport, proto)
        if hit is None:
            continue
        params = hit[1]
        params_of[params.vip_id] = params
        idx = np.array(members, dtype=np.int64)
        vip_id[idx] = params.vip_id
        src_only[idx] = bool(params.flags & abi.VIP_F_SRC_HASH)

    # Step 9, vectorised over every matched flow.
    matched = vip_id >= 0
    hashes = hashing.flow_hash_many(batch.words(src_only), state.config.seed)
    for vid, params in params_of.items():
        rows = np.flatnonzero(vip_id == vid)
        table = state.tables.get(vid)
        if table is None or rows.size == 0 or params.table_size == 0:
            continue
        h = hashes[rows].astype(np.uint64)
        bucket = h % np.uint64(params.table_size)
        inside = bucket < len(table)
        chosen = np.zeros(rows.size, dtype=np.uint32)
        chosen[inside] = table.first[bucket[inside].astype(np.int64)]
        usable = _usable_mask(state, chosen)
        backend[rows[usable]] = chosen[usable]
        out_hash[rows] = hashes[rows]

    # Step 8 overrides where the connection table has a live entry.
    if state.conns:
        keys = np.zeros((n, hashing.FLOW_WORDS), dtype="<u4")
        keys[:] = batch.words()
        raw_keys = keys.tobytes()
        for row in np.flatnonzero(matched).tolist():
            conn = state.conns.get(raw_keys[row * 40 : row * 40 + 40])
            if conn is not None and state.backend_usable(conn.backend_id):
                backend[row] = conn.backend_id
                out_hash[row] = conn.hash
    return Predictions(backend, out_hash, vip_id)


def _usable_mask(state: DataplaneState, ids: U32Array) -> npt.NDArray[np.bool_]:
    """Per id: :meth:`DataplaneState.backend_usable`, looked up once per distinct id."""
    mask = np.zeros(ids.shape, dtype=bool)
    for bid in np.unique(ids):
        if state.backend_usable(int(bid)):
            mask[ids == bid] = True
    return mask


# ---------------------------------------------------------------------------
# Frames, for tests and benchmarks
# ---------------------------------------------------------------------------

#: Locally administered MACs: the model never looks at them.
MAC_DST = bytes.fromhex("02000000000b")
MAC_SRC = bytes.fromhex("02000000000a")


def l4_header(
    proto: int, sport: int, dport: int, payload: bytes = b"", tcp_flags: int = _TCP_SYN
) -> bytes:
    """A minimal TCP (SYN unless ``tcp_flags`` says otherwise, data offset 5) or UDP
    header for ``payload``; checksums 0.

    lb_xdp never reads L4 checksums, so the builders do not compute them.
    """
    if proto == IPPROTO_TCP:
        return struct.pack("!HHIIBBHHH", sport, dport, 1, 0, 5 << 4, tcp_flags, 65535, 0, 0)
    if proto == IPPROTO_UDP:
        return struct.pack("!HHHH", sport, dport, UDP_HLEN + len(payload), 0)
    return b""


def ip_packet(
    src: IPAddress,
    dst: IPAddress,
    proto: int,
    l4: bytes,
    *,
    tos: int = 0,
    ttl: int = 64,
    frag: int = 0,
    options: bytes = b"",
) -> bytes:
    """An IPv4 or IPv6 header in front of ``l4`` (``frag``/``options``: IPv4 only)."""
    if src.version == 4:
        ihl = 5 + len(options) // 4
        hdr = struct.pack(
            "!BBHHHBBH4s4s",
            (4 << 4) | ihl,
            tos,
            ihl * 4 + len(l4),
            0x1234,
            frag,
            ttl,
            proto,
            0,
            src.packed,
            dst.packed,
        )
        hdr += options
        csum = ipv4_checksum(hdr)
        return hdr[:10] + csum.to_bytes(2, "big") + hdr[12:] + l4
    hdr = struct.pack(
        "!IHBB16s16s", (6 << 28) | (tos << 20), len(l4), proto, ttl, src.packed, dst.packed
    )
    return hdr + l4


def ethernet(ip: bytes, version: int, *, vlan: int | None = None, tpid: int = ETH_P_8021Q) -> bytes:
    """An Ethernet header (with one tag if ``vlan`` is given) in front of an IP packet."""
    ethertype = (ETH_P_IP if version == 4 else ETH_P_IPV6).to_bytes(2, "big")
    tag = b"" if vlan is None else tpid.to_bytes(2, "big") + (vlan & 0xFFF).to_bytes(2, "big")
    return MAC_DST + MAC_SRC + tag + ethertype + ip


def frame(
    flow: Flow,
    payload: bytes = b"",
    *,
    vlan: int | None = None,
    tos: int = 0,
    tcp_flags: int = _TCP_SYN,
) -> bytes:
    """A well-formed Ethernet frame of ``flow`` carrying ``payload`` (a TCP SYN unless
    ``tcp_flags`` says otherwise)."""
    l4 = l4_header(flow.proto, flow.sport, flow.dport, payload, tcp_flags) + payload
    return ethernet(
        ip_packet(flow.src, flow.dst, flow.proto, l4, tos=tos), flow.src.version, vlan=vlan
    )


def frames(flows: Iterable[Flow], payload: bytes = b"") -> list[bytes]:
    """:func:`frame` for each flow."""
    return [frame(f, payload) for f in flows]


def state_from_snapshot(
    snap: Snapshot, conns: Mapping[bytes, ConnEntry] | None = None
) -> DataplaneState:
    """The model's input from a snapshot of the real maps (``LbMaps.snapshot()``)."""
    return DataplaneState(
        snap.vips,
        snap.backends,
        snap.tables,
        snap.config,
        dict(conns or {}),
        dict(snap.vip_addrs),
        acl=dict(snap.acl),
    )
