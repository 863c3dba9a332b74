"""Tunnel packets as the balancer builds them (docs/datapath.md, lb_xdp step 11).

Used by tests and the demo to craft what lb_xdp would send, so that host_tc can be
exercised on its own. Built with scapy for the IP/UDP layers and by hand for GUE,
whose glb-director variant scapy does not know. scapy is a test dependency (the dev
extra), imported where a packet is built: importing this module does not need it.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from xdplb.core.abi import GUE_PORT
from xdplb.core.addresses import IPAddress

if TYPE_CHECKING:
    from scapy.packet import Packet

IPPROTO_IPIP = 4
IPPROTO_IPV6 = 41


def _inner_proto(inner: Packet) -> int:
    from scapy.layers.inet import IP

    return IPPROTO_IPIP if isinstance(inner, IP) else IPPROTO_IPV6


def gue_header(inner_proto: int, hops: Sequence[IPAddress], next_hop: int = 0) -> bytes:
    """glb-director's GUE header: base word, private word, then the hop list.

    ``hlen`` = 32-bit words of private data = 1 + len(hops) * (1 or 4).
    """
    hop_bytes = b"".join(ipaddress.ip_address(h).packed for h in hops)
    hlen = 1 + len(hop_bytes) // 4
    if hlen > 31:
        raise ValueError(f"{len(hops)} hops do not fit a GUE header (hlen {hlen} > 31)")
    base = struct.pack("!BBH", hlen, inner_proto, 0)
    priv = struct.pack("!HBB", 0, next_hop, len(hops))
    return base + priv + hop_bytes


def _outer_ip(src: IPAddress, dst: IPAddress, proto: int) -> Packet:
    from scapy.layers.inet import IP
    from scapy.layers.inet6 import IPv6

    if ipaddress.ip_address(dst).version == 4:
        return IP(src=str(src), dst=str(dst), proto=proto, flags="DF", ttl=64)
    return IPv6(src=str(src), dst=str(dst), nh=proto, hlim=64)


def gue_encap(
    inner: Packet,
    outer_src: IPAddress,
    outer_dst: IPAddress,
    *,
    sport: int = 0x8000 | 0x1234,
    gue_port: int = GUE_PORT,
    hops: Sequence[IPAddress] | None = None,
    next_hop: int = 0,
) -> Packet:
    """Outer IP + UDP (checksum 0, as lb_xdp sends it) + GUE + ``inner``.

    ``hops`` defaults to ``[outer_dst]``; ``next_hop`` is the index of the hop the packet
    is going to (0 from the balancer, 1 after a host forwarded it, ...).
    """
    from scapy.layers.inet import UDP

    hop_list = list(hops) if hops is not None else [outer_dst]
    gue = gue_header(_inner_proto(inner), hop_list, next_hop)
    return (
        _outer_ip(outer_src, outer_dst, 17)
        / UDP(sport=sport, dport=gue_port, chksum=0)
        / (gue + bytes(inner))
    )


def ipip_encap(inner: Packet, outer_src: IPAddress, outer_dst: IPAddress) -> Packet:
    """IPIP, IP6IP6, 4in6 or 6in4, by the families of ``inner`` and the outer addresses."""
    return _outer_ip(outer_src, outer_dst, _inner_proto(inner)) / bytes(inner)


def ether(pkt: Packet, src: str = "02:00:00:00:00:01", dst: str = "02:00:00:00:00:02") -> bytes:
    """``pkt`` behind an Ethernet header, as bytes (EtherType from the IP version)."""
    from scapy.layers.inet import IP
    from scapy.layers.l2 import Ether

    etype = 0x0800 if isinstance(pkt, IP) else 0x86DD
    return bytes(Ether(src=src, dst=dst, type=etype) / pkt)
