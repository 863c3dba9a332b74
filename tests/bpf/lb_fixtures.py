"""Packet fixtures for lb_xdp, Katran style: each case is a description, an input frame,
the expected verdict, the expected output frame and the exact counter deltas.

The expected outputs are built independently of the program, from docs/datapath.md:
outer headers with scapy, the GUE hop list by hand, the flow hash with
``xdplb.core.hashing.flow_hash`` (checked bit for bit against bpf/lib/hash.h elsewhere).
The same table can drive a performance run (``Case.frame`` is all it needs).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
import struct
from collections.abc import Callable, Mapping

from scapy.layers.inet import IP, TCP, UDP, IPOption_NOP, IPOption_RR
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Dot1Q, Ether
from scapy.packet import Packet, Raw

from xdplb.core import abi
from xdplb.core.abi import DropReason, Encap, Event, TableKind
from xdplb.core.hashing import flow_hash

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = range(5)
VERDICTS = {0: "XDP_ABORTED", 1: "XDP_DROP", 2: "XDP_PASS", 3: "XDP_TX", 4: "XDP_REDIRECT"}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
A = ipaddress.ip_address

# --- the lab: addresses in 198.18.0.0/15 and fd78:6470:6c62::/48 only -------------------

LB_SRC4 = A("198.18.0.2")
LB_SRC6 = A("fd78:6470:6c62::2")
GUE_PORT = 19523
SEED = 0x5EED1234
CLIENT_MAC = "02:c1:00:00:00:01"
CLIENT4 = A("198.18.5.1")
CLIENT6 = A("fd78:6470:6c62:5::1")
TABLE_SIZE = 13  # a small prime: bucket i -> the VIP's backends[i % n]


@dataclasses.dataclass(frozen=True)
class BackendDef:
    id: int
    addr: IPAddress
    mac: str | None  # permanent neighbour entry on lb0, or None: no neighbour
    active: bool = True


BACKENDS: dict[int, BackendDef] = {
    b.id: b
    for b in (
        BackendDef(1, A("198.18.0.11"), "02:be:00:00:00:11"),
        BackendDef(2, A("198.18.0.12"), "02:be:00:00:00:12"),
        BackendDef(3, A("198.18.0.13"), "02:be:00:00:00:13"),
        BackendDef(4, A("fd78:6470:6c62::11"), "02:be:00:00:06:11"),
        BackendDef(5, A("fd78:6470:6c62::12"), "02:be:00:00:06:12"),
        BackendDef(6, A("fd78:6470:6c62::13"), "02:be:00:00:06:13"),
        BackendDef(7, A("198.18.0.14"), None),  # on link, never resolved: FIB_PASS
        BackendDef(8, A("198.18.0.15"), "02:be:00:00:00:15", active=False),
        BackendDef(9, A("198.19.200.1"), None),  # no route at all: drop FIB
        BackendDef(10, A("198.18.0.2"), None),  # the LB itself (co-located): LOCAL
        BackendDef(11, A("fd78:6470:6c62::14"), None),  # a later hop only: never routed to
    )
}
V4_BES = (1, 2, 3)
V6_BES = (4, 5, 6)


@dataclasses.dataclass(frozen=True)
class VipDef:
    id: int
    addr: IPAddress
    port: int
    proto: int
    backends: tuple[int, ...] | None  # hop[0] of bucket i is backends[i % n]; None: no table
    encap: Encap = Encap.GUE
    flags: int = 0
    table_kind: TableKind = TableKind.MAGLEV
    # Beamer: hop[1..] of bucket i is rest[i % n] (0-padded to MAX_HOPS - 1)
    rest: tuple[tuple[int, ...], ...] = ()


TCP_, UDP_ = socket.IPPROTO_TCP, socket.IPPROTO_UDP
VIPS: dict[str, VipDef] = {
    "tcp4": VipDef(1, A("198.19.1.1"), 80, TCP_, V4_BES),
    "udp4": VipDef(2, A("198.19.1.1"), 53, UDP_, V4_BES),
    "tcp6": VipDef(3, A("fd78:6470:6c62:1::1"), 80, TCP_, V6_BES),
    "udp6": VipDef(4, A("fd78:6470:6c62:1::1"), 53, UDP_, V6_BES),
    "ipip": VipDef(5, A("198.19.1.2"), 80, TCP_, V4_BES, encap=Encap.IPIP),
    "ip6ip6": VipDef(6, A("fd78:6470:6c62:1::2"), 80, TCP_, V6_BES, encap=Encap.IPIP),
    "4in6": VipDef(7, A("198.19.1.3"), 80, TCP_, V6_BES),
    "6in4": VipDef(8, A("fd78:6470:6c62:1::3"), 80, TCP_, V4_BES),
    "wild": VipDef(9, A("198.19.1.4"), 0, TCP_, V4_BES),
    "srchash": VipDef(10, A("198.19.1.5"), 80, TCP_, V4_BES, flags=abi.VIP_F_SRC_HASH),
    "notable": VipDef(11, A("198.19.1.6"), 80, TCP_, None),
    "noneigh": VipDef(12, A("198.19.1.7"), 80, TCP_, (7,)),
    "inactive": VipDef(13, A("198.19.1.8"), 80, TCP_, (8,)),
    "noroute": VipDef(14, A("198.19.1.9"), 80, TCP_, (9,)),
    "beamer": VipDef(
        15, A("198.19.1.10"), 80, TCP_, (1,), table_kind=TableKind.BEAMER, rest=((2,),)
    ),
    "ipip6in4": VipDef(16, A("fd78:6470:6c62:1::4"), 80, TCP_, V4_BES, encap=Encap.IPIP),
    "self": VipDef(17, A("198.19.1.11"), 80, TCP_, (10,)),
    # Four hops (7 is never routed to as a later hop: no neighbour needed).
    "beamer4": VipDef(
        18, A("198.19.1.12"), 80, TCP_, (1,), table_kind=TableKind.BEAMER, rest=((2, 3, 7),)
    ),
    # Inactive (8) and other-family (4) later hops are left out: two hops.
    "beamer_skip": VipDef(
        19, A("198.19.1.13"), 80, TCP_, (1,), table_kind=TableKind.BEAMER, rest=((8, 4, 3),)
    ),
    # IPv6: even buckets four hops, odd buckets three (the 0 is skipped).
    "beamer6": VipDef(
        20,
        A("fd78:6470:6c62:1::5"),
        80,
        TCP_,
        (4,),
        table_kind=TableKind.BEAMER,
        rest=((5, 6, 11), (0, 5, 6)),
    ),
}
VIP_BY_ID = {v.id: v for v in VIPS.values()}


# --- building frames -----------------------------------------------------------------------


def client_frame(
    dst: IPAddress,
    dport: int,
    proto: int = TCP_,
    *,
    src: IPAddress | None = None,
    sport: int = 40000,
    lb_mac: str,
    payload: bytes = b"hello xdplb",
    vlan: int | None = None,
    tos: int = 0,
    flags: str = "S",
) -> Packet:
    """A client's frame to ``dst``, as it arrives on lb0 (TCP: a SYN unless ``flags``
    says otherwise; lb_xdp sends every SYN by the table, other packets by the
    connection table first)."""
    if src is None:
        src = CLIENT4 if dst.version == 4 else CLIENT6
    l3: Packet
    if dst.version == 4:
        l3 = IP(src=str(src), dst=str(dst), tos=tos, id=7, ttl=63)
    else:
        l3 = IPv6(src=str(src), dst=str(dst), tc=tos, fl=0x12345, hlim=63)
    l4 = (
        TCP(sport=sport, dport=dport, flags=flags, seq=1)
        if proto == TCP_
        else UDP(sport=sport, dport=dport)
    )
    eth = Ether(dst=lb_mac, src=CLIENT_MAC)
    if vlan is not None:
        return eth / Dot1Q(vlan=vlan) / l3 / l4 / Raw(payload)
    return eth / l3 / l4 / Raw(payload)


def l3_offset(frame: bytes) -> int:
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    return 18 if ethertype in (0x8100, 0x88A8) else 14


def flow_of(frame: bytes) -> tuple[IPAddress, IPAddress, int, int, int, int]:
    """(src, dst, sport, dport, proto, ip_len) of a frame's inner packet."""
    off = l3_offset(frame)
    if frame[off] >> 4 == 4:
        ihl = (frame[off] & 0x0F) * 4
        ip_len = struct.unpack_from("!H", frame, off + 2)[0]
        proto = frame[off + 9]
        src, dst = A(frame[off + 12 : off + 16]), A(frame[off + 16 : off + 20])
        l4 = off + ihl
    else:
        ip_len = 40 + struct.unpack_from("!H", frame, off + 4)[0]
        proto = frame[off + 6]
        src, dst = A(frame[off + 8 : off + 24]), A(frame[off + 24 : off + 40])
        l4 = off + 40
    sport, dport = struct.unpack_from("!HH", frame, l4)
    return src, dst, sport, dport, proto, ip_len


def hash_of(frame: bytes, vip: VipDef, seed: int = SEED) -> int:
    """The flow hash lb_xdp must use for ``frame`` on ``vip`` (step 9)."""
    src, dst, sport, dport, proto, _ = flow_of(frame)
    if vip.flags & abi.VIP_F_SRC_HASH:
        key = abi.FlowKey(abi.addr_words(src))
    else:
        key = abi.FlowKey.make(src, dst, sport, dport, proto)
    return flow_hash(bytes(key), seed)


def pick(frame: bytes, vip: VipDef, seed: int = SEED) -> tuple[int, int]:
    """(backend id, hash) for a new flow, from the hand-built table."""
    assert vip.backends is not None
    h = hash_of(frame, vip, seed)
    return vip.backends[(h % TABLE_SIZE) % len(vip.backends)], h


def encapsulated(
    frame: bytes,
    vip: VipDef,
    be: BackendDef,
    flow_hash_: int,
    *,
    eth_dst: str,
    eth_src: str,
    hops: tuple[BackendDef, ...] | None = None,
) -> bytes:
    """The frame lb_xdp must emit for ``frame`` sent to ``be`` (step 11)."""
    inner = frame[l3_offset(frame) :]  # the IP packet and any Ethernet padding after it
    inner_v4 = inner[0] >> 4 == 4
    tos = inner[1] if inner_v4 else ((inner[0] & 0x0F) << 4) | (inner[1] >> 4)
    inner_proto = 4 if inner_v4 else 41
    _, _, _, _, _, ip_len = flow_of(frame)
    trailer = inner[ip_len:]
    hops = hops or (be,)

    payload: Packet
    if vip.encap == Encap.GUE:
        words = 1 if be.addr.version == 4 else 4
        gue = bytes([1 + len(hops) * words, inner_proto, 0, 0, 0, 0, 0, len(hops)])
        gue += b"".join(h.addr.packed for h in hops)
        payload = (
            UDP(sport=0x8000 | (flow_hash_ & 0x7FFF), dport=GUE_PORT, chksum=0)
            / Raw(gue)
            / Raw(inner[:ip_len])
        )
        outer_proto = 17
    else:
        payload = Raw(inner[:ip_len])
        outer_proto = inner_proto

    l3: Packet
    if be.addr.version == 4:
        l3 = IP(
            src=str(LB_SRC4),
            dst=str(be.addr),
            tos=tos,
            id=0,
            flags="DF",
            ttl=64,
            proto=outer_proto,
        )
    else:
        l3 = IPv6(src=str(LB_SRC6), dst=str(be.addr), tc=tos, fl=0, hlim=64, nh=outer_proto)
    ethertype = 0x0800 if be.addr.version == 4 else 0x86DD
    out = Ether(dst=eth_dst, src=eth_src, type=ethertype) / l3 / payload
    # Ethernet padding stays at the end of the frame but counts in no length field.
    return bytes(out) + trailer


# --- the case table --------------------------------------------------------------------------

#: What a new flow counts on its way through step 9: hashed into the table, recorded.
NEW_FLOW: Mapping[int, int] = {Event.CONN_MISS: 1, Event.CONN_INSERT: 1}

Deltas = Mapping[int, int]
StatsDeltas = Mapping[int, tuple[int, int, int]]  # id -> (packets, bytes, new_flows)


@dataclasses.dataclass(frozen=True)
class Expect:
    verdict: int
    output: bytes
    events: Deltas
    drops: Deltas = dataclasses.field(default_factory=dict)
    vip_stats: StatsDeltas = dataclasses.field(default_factory=dict)
    be_stats: StatsDeltas = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Env:
    """What a case needs to know about the namespace it runs in."""

    lb_mac: str


@dataclasses.dataclass(frozen=True)
class Case:
    description: str
    frame: Callable[[Env], bytes]
    expect: Callable[[Env, bytes], Expect]

    def __str__(self) -> str:
        return self.description


def new_flow(vip_name: str) -> Callable[[Env, bytes], Expect]:
    """A first packet on a VIP: hashed, recorded, encapsulated, sent back out lb0."""

    def expect(env: Env, frame: bytes) -> Expect:
        vip = VIPS[vip_name]
        be_id, h = pick(frame, vip)
        be = BACKENDS[be_id]
        assert be.mac is not None
        ip_len = flow_of(frame)[5]
        return Expect(
            XDP_TX,
            encapsulated(frame, vip, be, h, eth_dst=be.mac, eth_src=env.lb_mac),
            events={**NEW_FLOW, Event.TX: 1},
            vip_stats={vip.id: (1, ip_len, 1)},
            be_stats={be_id: (1, ip_len, 1)},
        )

    return expect


def passed(event: Event) -> Callable[[Env, bytes], Expect]:
    return lambda env, frame: Expect(XDP_PASS, frame, events={event: 1})


def dropped(reason: DropReason, **kw: object) -> Callable[[Env, bytes], Expect]:
    return lambda env, frame: Expect(XDP_DROP, frame, events={}, drops={reason: 1}, **kw)  # type: ignore[arg-type]


def to_vip(name: str, **kw: object) -> Callable[[Env], bytes]:
    vip = VIPS[name]
    port = vip.port or 8080

    def build(env: Env) -> bytes:
        return bytes(client_frame(vip.addr, port, vip.proto, lb_mac=env.lb_mac, **kw))  # type: ignore[arg-type]

    return build


def _fragment(env: Env) -> bytes:
    vip = VIPS["tcp4"]
    pkt = (
        Ether(dst=env.lb_mac, src=CLIENT_MAC)
        / IP(src=str(CLIENT4), dst=str(vip.addr), flags="MF", frag=0)
        / TCP(sport=40000, dport=80)
        / Raw(b"x" * 32)
    )
    return bytes(pkt)


def fragment_hash(frame: bytes, vip: VipDef, seed: int = SEED) -> int:
    """A fragment's flow hash: (src, dst, proto) with the ports zero (or the source)."""
    off = l3_offset(frame)
    if frame[off] >> 4 == 4:
        src, dst, proto = (
            A(frame[off + 12 : off + 16]),
            A(frame[off + 16 : off + 20]),
            frame[off + 9],
        )
    else:
        src, dst = A(frame[off + 8 : off + 24]), A(frame[off + 24 : off + 40])
        proto = frame[off + 40]  # the fragment header's next header (no other ext header)
    if vip.flags & abi.VIP_F_SRC_HASH:
        key = abi.FlowKey(abi.addr_words(src))
    else:
        key = abi.FlowKey.make(src, dst, 0, 0, proto)
    return flow_hash(bytes(key), seed)


def fragment_flow(vip_name: str) -> Callable[[Env, bytes], Expect]:
    """A fragment of a VIP address: hashed without ports into the VIP's table, never
    recorded, no new flow counted."""

    def expect(env: Env, frame: bytes) -> Expect:
        vip = VIPS[vip_name]
        assert vip.backends is not None
        h = fragment_hash(frame, vip)
        be = BACKENDS[vip.backends[(h % TABLE_SIZE) % len(vip.backends)]]
        assert be.mac is not None
        ip_len = flow_of(frame)[5]
        return Expect(
            XDP_TX,
            encapsulated(frame, vip, be, h, eth_dst=be.mac, eth_src=env.lb_mac),
            events={Event.FRAGMENT: 1, Event.TX: 1},
            vip_stats={vip.id: (1, ip_len, 0)},
            be_stats={be.id: (1, ip_len, 0)},
        )

    return expect


def _later_fragment_not_vip(env: Env) -> bytes:
    pkt = (
        Ether(dst=env.lb_mac, src=CLIENT_MAC)
        / IP(src=str(CLIENT4), dst="198.19.99.1", frag=4, proto=6)
        / Raw(b"y" * 24)
    )
    return bytes(pkt)


def _truncated_tcp(env: Env) -> bytes:
    """IP says 10 bytes of TCP follow, and only 10 do: ports present, header not."""
    vip = VIPS["tcp4"]
    tcp = bytes(TCP(sport=40000, dport=80))[:10]
    return bytes(
        Ether(dst=env.lb_mac, src=CLIENT_MAC)
        / IP(src=str(CLIENT4), dst=str(vip.addr), proto=6)
        / Raw(tcp)
    )


def _bad_doff(env: Env) -> bytes:
    """TCP data offset 15 (60 bytes) with only 20 bytes of TCP: truncated."""
    vip = VIPS["tcp6"]
    tcp = bytearray(bytes(TCP(sport=40000, dport=80)))
    tcp[12] = 0xF0
    return bytes(
        Ether(dst=env.lb_mac, src=CLIENT_MAC)
        / IPv6(src=str(CLIENT6), dst=str(vip.addr), nh=6)
        / Raw(bytes(tcp))
    )


def _tot_len_too_big(env: Env) -> bytes:
    raw = bytearray(to_vip("tcp4")(env))
    struct.pack_into("!H", raw, 14 + 2, len(raw) - 14 + 1)  # one byte more than the frame
    raw[14 + 10 : 14 + 12] = b"\0\0"
    return bytes(raw)


def _arp(env: Env) -> bytes:
    return bytes(
        Ether(dst="ff:ff:ff:ff:ff:ff", src=CLIENT_MAC)
        / ARP(op=1, psrc=str(CLIENT4), pdst=str(LB_SRC4), hwsrc=CLIENT_MAC)
    )


def _padded(env: Env) -> bytes:
    """A short UDP packet padded to Ethernet's 60-byte minimum, as a NIC delivers it."""
    vip = VIPS["udp4"]
    pkt = client_frame(vip.addr, 53, UDP_, lb_mac=env.lb_mac, payload=b"q")
    raw = bytes(pkt)
    return raw + b"\xaa" * (60 - len(raw))


def _ip_options(env: Env) -> bytes:
    vip = VIPS["tcp4"]
    pkt = (
        Ether(dst=env.lb_mac, src=CLIENT_MAC)
        # Two NOPs, Record Route with room for two addresses, padding: IHL 9.
        / IP(
            src=str(CLIENT4),
            dst=str(vip.addr),
            options=[IPOption_NOP(), IPOption_NOP(), IPOption_RR(routers=["0.0.0.0"] * 2)],
        )
        / TCP(sport=40001, dport=80)
        / Raw(b"opts")
    )
    raw = bytes(pkt)
    assert raw[14] == 0x49, "want IHL 9"
    return raw


def _fib_pass(env: Env, frame: bytes) -> Expect:
    vip = VIPS["noneigh"]
    be = BACKENDS[7]
    h = hash_of(frame, vip)
    ip_len = flow_of(frame)[5]
    # No neighbour: the original MACs stay, so the kernel takes the frame and forwards it.
    return Expect(
        XDP_PASS,
        encapsulated(frame, vip, be, h, eth_dst=env.lb_mac, eth_src=CLIENT_MAC),
        events={**NEW_FLOW, Event.FIB_PASS: 1},
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={be.id: (1, ip_len, 1)},
    )


def beamer_hops(frame: bytes, vip: VipDef) -> tuple[BackendDef, ...]:
    """The hop list lb_xdp must write for a new flow of a Beamer VIP: the first hop,
    then the bucket's later hops that are active and of the first hop's family."""
    be_id, h = pick(frame, vip)
    first = BACKENDS[be_id]
    rest = vip.rest[(h % TABLE_SIZE) % len(vip.rest)] if vip.rest else ()
    later = [BACKENDS[i] for i in rest if i]
    return (first, *(b for b in later if b.active and b.addr.version == first.addr.version))


def beamer_flow(vip_name: str) -> Callable[[Env, bytes], Expect]:
    """A new flow of a Beamer VIP: encapsulated with the bucket's usable hops."""

    def expect(env: Env, frame: bytes) -> Expect:
        vip = VIPS[vip_name]
        hops = beamer_hops(frame, vip)
        first = hops[0]
        h = hash_of(frame, vip)
        ip_len = flow_of(frame)[5]
        assert first.mac is not None
        return Expect(
            XDP_TX,
            encapsulated(frame, vip, first, h, eth_dst=first.mac, eth_src=env.lb_mac, hops=hops),
            events={**NEW_FLOW, Event.TX: 1},
            vip_stats={vip.id: (1, ip_len, 1)},
            be_stats={first.id: (1, ip_len, 1)},
        )

    return expect


_beamer = beamer_flow("beamer")


def _local(env: Env, frame: bytes) -> Expect:
    """Co-located: the chosen hop is the LB's own address. Passed up encapsulated, with
    the original MACs (ours as destination), for host_tc on the same interface."""
    vip = VIPS["self"]
    be = BACKENDS[10]
    h = hash_of(frame, vip)
    ip_len = flow_of(frame)[5]
    return Expect(
        XDP_PASS,
        encapsulated(frame, vip, be, h, eth_dst=env.lb_mac, eth_src=CLIENT_MAC),
        events={**NEW_FLOW, Event.LOCAL: 1},
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={be.id: (1, ip_len, 1)},
    )


def _no_route(env: Env, frame: bytes) -> Expect:
    """No route to the backend: dropped after steps 9-11, so counted and encapsulated."""
    vip = VIPS["noroute"]
    be = BACKENDS[9]
    h = hash_of(frame, vip)
    ip_len = flow_of(frame)[5]
    return Expect(
        XDP_DROP,
        encapsulated(frame, vip, be, h, eth_dst=env.lb_mac, eth_src=CLIENT_MAC),
        events={**NEW_FLOW},
        drops={DropReason.FIB: 1},
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={be.id: (1, ip_len, 1)},
    )


CASES: list[Case] = [
    Case("IPv4 TCP to a GUE VIP: IPv4 GUE to the hashed backend", to_vip("tcp4"), new_flow("tcp4")),
    Case("IPv4 UDP to a GUE VIP", to_vip("udp4"), new_flow("udp4")),
    Case("IPv6 TCP to a GUE VIP: IPv6 GUE, 16-byte hop", to_vip("tcp6"), new_flow("tcp6")),
    Case("IPv6 UDP to a GUE VIP", to_vip("udp6"), new_flow("udp6")),
    Case(
        "TOS / traffic class is copied to the outer header",
        to_vip("tcp6", tos=0xB8),
        new_flow("tcp6"),
    ),
    Case("IPv4 TCP to an IPIP VIP: IPIP, protocol 4", to_vip("ipip", tos=0x10), new_flow("ipip")),
    Case("IPv6 TCP to an IPIP VIP: IP6IP6, next header 41", to_vip("ip6ip6"), new_flow("ip6ip6")),
    Case(
        "IPv6 to an IPIP VIP with IPv4 backends: 6in4, protocol 41",
        to_vip("ipip6in4"),
        new_flow("ipip6in4"),
    ),
    Case("IPv4 client, IPv6 backends: 4in6 GUE", to_vip("4in6"), new_flow("4in6")),
    Case("IPv6 client, IPv4 backends: 6in4 GUE", to_vip("6in4"), new_flow("6in4")),
    Case("802.1Q-tagged input: output untagged", to_vip("tcp4", vlan=42), new_flow("tcp4")),
    Case("802.1Q-tagged IPv6 input", to_vip("udp6", vlan=7), new_flow("udp6")),
    Case("IPv4 with options: carried whole, bytes = tot_len", _ip_options, new_flow("tcp4")),
    Case("Ethernet padding stays in the frame, not in lengths", _padded, new_flow("udp4")),
    Case("wildcard port-0 VIP matches any port", to_vip("wild"), new_flow("wild")),
    Case(
        "source-hash VIP: hash of the source address only", to_vip("srchash"), new_flow("srchash")
    ),
    Case("Beamer bucket with a previous hop: two-hop GUE list", to_vip("beamer"), _beamer),
    Case(
        "Beamer bucket with three previous hops: four-hop list",
        to_vip("beamer4"),
        beamer_flow("beamer4"),
    ),
    Case(
        "Beamer: inactive and other-family hops left out",
        to_vip("beamer_skip"),
        beamer_flow("beamer_skip"),
    ),
    Case("Beamer over IPv6: 16-byte hops", to_vip("beamer6"), beamer_flow("beamer6")),
    Case(
        "non-VIP address: passed untouched",
        lambda env: bytes(client_frame(A("198.19.99.1"), 80, lb_mac=env.lb_mac)),
        passed(Event.PASS_NOT_VIP),
    ),
    Case(
        "VIP address, port with no VIP and no wildcard: passed",
        lambda env: bytes(client_frame(VIPS["tcp4"].addr, 443, lb_mac=env.lb_mac)),
        passed(Event.PASS_NOT_VIP),
    ),
    Case(
        "VIP address and port, other protocol (UDP to a TCP VIP): passed",
        lambda env: bytes(client_frame(VIPS["tcp6"].addr, 80, UDP_, lb_mac=env.lb_mac)),
        passed(Event.PASS_NOT_VIP),
    ),
    Case("ARP: not IP, passed", _arp, passed(Event.PASS_NOT_IP)),
    Case(
        "IPv4 tot_len beyond the frame: malformed, passed",
        _tot_len_too_big,
        passed(Event.PASS_MALFORMED),
    ),
    Case(
        "IPv4 first fragment to a VIP: hashed without ports to the address's TCP VIP",
        _fragment,
        fragment_flow("tcp4"),
    ),
    Case(
        "IPv4 fragment to another address: passed",
        _later_fragment_not_vip,
        passed(Event.PASS_NOT_VIP),
    ),
    Case("truncated TCP to a VIP: dropped", _truncated_tcp, dropped(DropReason.MALFORMED_L4)),
    Case(
        "IPv6 TCP data offset past the payload: dropped",
        _bad_doff,
        dropped(DropReason.MALFORMED_L4),
    ),
    Case("VIP without a table: dropped", to_vip("notable"), dropped(DropReason.NO_TABLE)),
    Case(
        "bucket names an inactive backend: dropped",
        to_vip("inactive"),
        dropped(DropReason.NO_BACKEND),
    ),
    Case("backend on link but no neighbour: encapsulated and passed", to_vip("noneigh"), _fib_pass),
    Case("backend with no route: dropped after encapsulation", to_vip("noroute"), _no_route),
    Case("co-located: the hop is this host, passed up for host_tc", to_vip("self"), _local),
]
