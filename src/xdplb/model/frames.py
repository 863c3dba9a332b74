"""Well-formed frames for tests and benchmarks, built with ``struct``: an L4 header,
an IP packet, an Ethernet frame, a flow's frame.  Nothing in the model uses them."""

from __future__ import annotations

import struct

from xdplb.core.addresses import IPAddress
from xdplb.model.checksum import ipv4_checksum
from xdplb.model.encap import UDP_HLEN
from xdplb.model.parse import ETH_P_8021Q, ETH_P_IP, ETH_P_IPV6, IPPROTO_TCP, IPPROTO_UDP, TCP_SYN
from xdplb.model.state import Flow

#: Locally administered MACs: the model never looks at them.
MAC_DST = bytes.fromhex("02000000000b")
MAC_SRC = bytes.fromhex("02000000000a")


def l4_header(
    proto: int, sport: int, dport: int, payload: bytes = b"", tcp_flags: int = TCP_SYN
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
    tcp_flags: int = TCP_SYN,
) -> bytes:
    """A well-formed Ethernet frame of ``flow`` carrying ``payload`` (a TCP SYN unless
    ``tcp_flags`` says otherwise)."""
    l4 = l4_header(flow.proto, flow.sport, flow.dport, payload, tcp_flags) + payload
    return ethernet(
        ip_packet(flow.src, flow.dst, flow.proto, l4, tos=tos), flow.src.version, vlan=vlan
    )
