"""Steps 1-5 (bpf/lib/lb_parse.h): a frame's Ethernet and IP headers, IPv6
extension headers and ports, read with ``struct`` and slicing into :class:`Parsed`,
or the decision for a frame that is not to be balanced.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace

from xdplb.core import abi
from xdplb.core.addresses import IPAddress
from xdplb.model.decision import PASS_MALFORMED, PASS_NOT_IP, PASS_NOT_VIP, Decision, dropped
from xdplb.model.state import DataplaneState

ETH_HLEN = 14
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
#: The tags lb_xdp skips (one of them, once): 802.1Q and 802.1ad.
ETH_P_8021Q = 0x8100
ETH_P_8021AD = 0x88A8
VLAN_HLEN = 4

IPPROTO_TCP = abi.IPPROTO_TCP
IPPROTO_UDP = abi.IPPROTO_UDP
IPPROTO_ICMP = 1
IPPROTO_ICMPV6 = 58
#: IPv6 extension headers walked in step 2: hop-by-hop, routing, destination options,
#: fragment.
IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT = 0, 43, 60, 44
_EXTHDRS = frozenset((IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_DSTOPTS, IPPROTO_FRAGMENT))
_IPV6_FRAG_OFFSET_MF = 0xFFF9
_IPV4_MF_OFFSET = 0x3FFF  # MF flag and the 13-bit fragment offset
TCP_FIN, TCP_SYN, TCP_RST, TCP_ACK = 0x01, 0x02, 0x04, 0x10


@dataclass(frozen=True)
class Parsed:
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
    #: Steps 4a-4c take it (a TCP/UDP fragment, or ICMP): :func:`decide_slow`.
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


def parse_ip(frame: bytes) -> Parsed | Decision:
    """Steps 1-2: addresses, lengths and the upper-layer protocol, or the decision."""
    n = len(frame)
    # 1. Ethernet, one 802.1Q / 802.1ad tag skipped.
    if n < ETH_HLEN:
        return PASS_NOT_IP
    l3 = ETH_HLEN
    proto = int.from_bytes(frame[12:14], "big")
    if proto in (ETH_P_8021Q, ETH_P_8021AD):
        if n < ETH_HLEN + VLAN_HLEN:
            return PASS_NOT_IP
        proto = int.from_bytes(frame[16:18], "big")
        l3 += VLAN_HLEN
    left = n - l3

    # 2. IP header sanity against the frame.
    if proto == ETH_P_IP:
        if left < 20:
            return PASS_MALFORMED
        vihl = frame[l3]
        ihl = (vihl & 0xF) * 4
        if vihl >> 4 != 4 or ihl < 20 or ihl > left:
            return PASS_MALFORMED
        ip_len = int.from_bytes(frame[l3 + 2 : l3 + 4], "big")
        if not ihl <= ip_len <= left:
            return PASS_MALFORMED
        frag = bool(int.from_bytes(frame[l3 + 6 : l3 + 8], "big") & _IPV4_MF_OFFSET)
        return Parsed(
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
            return PASS_MALFORMED
        ip_len = 40 + int.from_bytes(frame[l3 + 4 : l3 + 6], "big")
        if frame[l3] >> 4 != 6 or ip_len > left:
            return PASS_MALFORMED
        l4proto, l4, l4_len, frag = frame[l3 + 6], l3 + 40, ip_len - 40, False
        # 2. Extension headers, unless TCP or UDP comes first (the fast path).
        if l4proto != IPPROTO_TCP and l4proto != IPPROTO_UDP:
            l4proto, l4, l4_len, frag = _walk_exthdrs(frame, l4, l4proto, l4_len)
            if l4proto < 0:
                return PASS_MALFORMED
        return Parsed(
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
    return PASS_NOT_IP


def parse_l4(frame: bytes, p: Parsed, state: DataplaneState) -> Parsed | Decision:
    """Steps 3-5: fragments and ICMP to the slow path, other protocols pass, ports."""
    # 3. TCP and UDP are balanced; ICMP (not a fragment) and TCP/UDP fragments take 4a-4c.
    if p.proto != IPPROTO_TCP and p.proto != IPPROTO_UDP:
        icmp = IPPROTO_ICMP if p.version == 4 else IPPROTO_ICMPV6
        if not p.frag and p.proto == icmp:
            return replace(p, slow=True)
        return PASS_NOT_VIP
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
            return dropped(abi.DropReason.MALFORMED_L4)
        return PASS_NOT_VIP
    sport = int.from_bytes(frame[l4 : l4 + 2], "big")
    dport = int.from_bytes(frame[l4 + 2 : l4 + 4], "big")
    flags = frame[l4 + 13] if p.proto == IPPROTO_TCP else 0
    return replace(p, sport=sport, dport=dport, tcp_flags=flags)


def address(version: int, raw: bytes) -> IPAddress:
    """The address in a header's raw bytes (4 or 16 of them)."""
    return ipaddress.IPv4Address(raw) if version == 4 else ipaddress.IPv6Address(raw)
