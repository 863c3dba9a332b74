"""Hypothesis strategies for structure-aware frames, and their deterministic mutations.

A drawn frame is well formed layer by layer (lengths and checksums right) unless the
strategy chose otherwise, and it is aimed at the state's VIPs, backends and their near
misses, so that the program's later steps are reached, not only its first checks.
:func:`expand` then turns one drawn frame into a few hundred: every truncation,
length-field corruptions, byte flips.  Drawing is what costs time in hypothesis; the
expansion is plain byte slicing, so 10^6 frames take a few thousand draws.

Layers: Ethernet (no tag, 802.1Q, 802.1ad, double tag, odd TPID), then IPv4 (options,
any IHL, MF / offset / DF / the reserved bit, TTL, bad checksums) or IPv6 (chains of
hop-by-hop, routing, fragment and destination-options headers), then TCP (MSS, SACK,
timestamps, window scale, NOPs, garbage options), UDP, ICMP / ICMPv6 (errors quoting
an inner packet, usually a VIP flow reversed; echo) or GUE / IPIP wrapping a whole
inner packet.
"""

from __future__ import annotations

import ipaddress
import random
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from xdplb import model
from xdplb.core import abi
from xdplb.core.addresses import IPAddress
from xdplb.model import frames
from xdplb.model.checksum import ipv4_checksum
from xdplb.model.parse import ETH_P_IP, ETH_P_IPV6

TCP, UDP, ICMP, ICMP6 = 6, 17, 1, 58
IPIP, IPV6 = 4, 41
#: IPv6 extension headers lb_xdp may meet: hop-by-hop, routing, fragment, dest options.
HOPOPT, ROUTING, FRAGMENT, DSTOPTS = 0, 43, 44, 60
EXT_HEADERS = (HOPOPT, ROUTING, FRAGMENT, DSTOPTS)

CLIENT4 = ipaddress.IPv4Address("198.18.128.7")
CLIENT6 = ipaddress.IPv6Address("fd78:6470:6c62:8000::7")


@dataclass(frozen=True)
class Targets:
    """What the strategies aim at, from a model state."""

    #: (address, port, protocol) of every VIP; port 0 is a wildcard.
    vips: tuple[tuple[IPAddress, int, int], ...]
    backends: tuple[IPAddress, ...]
    lb_addrs: tuple[IPAddress, ...]
    gue_port: int
    #: ``lb_vip_addrs`` entries with no VIP on them (a map out of step).
    extra_addrs: tuple[IPAddress, ...] = ()

    @classmethod
    def of(cls, state: model.DataplaneState) -> Targets:
        cfg = state.config
        lb = tuple(a for a in (cfg.src4, cfg.src6) if a is not None)
        return cls(
            tuple(sorted(((v.addr, v.port, v.proto) for v in state.vips), key=str)),
            tuple(sorted({b.addr for b in state.backends.values()}, key=str)),
            lb,
            cfg.gue_port,
            tuple(sorted(set(state.vip_addrs or ()) - {v.addr for v in state.vips}, key=str)),
        )

    def addrs(self, version: int) -> list[IPAddress]:
        """The addresses packets to a VIP go to: every VIP's, and lb_vip_addrs' others."""
        vips = [a for a, _, _ in self.vips if a.version == version]
        return vips + [a for a in self.extra_addrs if a.version == version]


def _near(addr: IPAddress, delta: int) -> IPAddress:
    top = (1 << addr.max_prefixlen) - 1
    return ipaddress.ip_address(min(max(int(addr) + delta, 0), top))


# --- addresses and ports -----------------------------------------------------------------------


@st.composite
def address(draw: st.DrawFn, t: Targets, version: int, *, dst: bool) -> IPAddress:
    """A VIP address (mostly, for destinations), a backend, the LB, a near miss, a client."""
    vips = t.addrs(version) or [CLIENT4 if version == 4 else CLIENT6]
    backs = [a for a in t.backends if a.version == version] or vips
    client = CLIENT4 if version == 4 else CLIENT6
    kind = draw(st.sampled_from(["vip"] * (6 if dst else 1) + ["be", "lb", "near", "client"]))
    if kind == "vip":
        return draw(st.sampled_from(vips))
    if kind == "be":
        return draw(st.sampled_from(backs))
    if kind == "lb":
        lb = [a for a in t.lb_addrs if a.version == version]
        return lb[0] if lb else client
    if kind == "near":
        base = draw(st.sampled_from(vips + backs))
        return _near(base, draw(st.sampled_from([-1, 1, 256, 1 << 16])))
    return _near(client, draw(st.integers(0, 1 << 15)))


@st.composite
def port(draw: st.DrawFn, t: Targets, proto: int, *, dst: bool) -> int:
    ports = sorted({p for _, p, pr in t.vips if p and pr == proto} | {80, 443, 53})
    if not dst:
        return draw(st.one_of(st.integers(1024, 65535), st.sampled_from([0, 1, 65535, *ports])))
    return draw(
        st.one_of(
            st.sampled_from(ports),
            st.sampled_from([p + d for p in ports for d in (-1, 1)]),
            st.sampled_from([0, 1, 65535, t.gue_port]),
            st.integers(0, 65535),
        )
    )


# --- layer 4 -----------------------------------------------------------------------------------

#: Small payloads mostly; sometimes one near the lab's 1500-byte MTU once encapsulated.
payloads = st.one_of(
    st.binary(max_size=48),
    st.binary(max_size=48),
    st.binary(max_size=48),
    st.integers(1330, 1480).map(lambda n: bytes(i & 0xFF for i in range(n))),
)

_TCP_FLAGS = [0x02, 0x10, 0x12, 0x18, 0x11, 0x04, 0x14, 0x03, 0x00, 0xFF, 0x42, 0x82]


@st.composite
def tcp_options(draw: st.DrawFn) -> bytes:
    opts = draw(
        st.lists(
            st.one_of(
                st.builds(lambda m: struct.pack("!BBH", 2, 4, m), st.integers(0, 65535)),
                st.just(b"\x04\x02"),  # SACK permitted
                st.builds(
                    lambda n: bytes((5, 2 + 8 * n)) + bytes(8 * n), st.integers(1, 4)
                ),  # SACK blocks
                st.builds(
                    lambda a, b: struct.pack("!BBII", 8, 10, a, b),
                    st.integers(0, 2**32 - 1),
                    st.integers(0, 2**32 - 1),
                ),
                st.builds(lambda s: bytes((3, 3, s)), st.integers(0, 255)),  # window scale
                st.just(b"\x01"),  # NOP
                st.just(b"\x00"),  # EOL
                st.binary(min_size=1, max_size=6),  # garbage
            ),
            max_size=6,
        )
    )
    raw = b"".join(opts)[:40]
    return raw + bytes(-len(raw) % 4)


@st.composite
def tcp(draw: st.DrawFn, sport: int, dport: int, payload: bytes) -> bytes:
    opts: bytes = draw(st.one_of(st.just(b""), tcp_options()))
    doff = 5 + len(opts) // 4
    flags = draw(st.sampled_from(_TCP_FLAGS))
    seq = draw(st.sampled_from([0, 1, 2**32 - 1]))
    hdr = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, doff << 4, flags, 65535, 0, 0)
    return hdr + opts + payload


def udp(sport: int, dport: int, payload: bytes) -> bytes:
    return struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload


def _csum(data: bytes) -> int:
    data = data + bytes(len(data) % 2)
    return ipv4_checksum(data)


@st.composite
def l4(draw: st.DrawFn, t: Targets, proto: int, *, to_vip: bool = True) -> tuple[int, int, bytes]:
    """(sport, dport, header + payload) of TCP or UDP."""
    payload: bytes = draw(payloads)
    sport: int = draw(port(t, proto, dst=False))
    dport: int = draw(port(t, proto, dst=to_vip))
    if proto == TCP:
        return sport, dport, draw(tcp(sport, dport, payload))
    return sport, dport, udp(sport, dport, payload)


# --- layer 3 -----------------------------------------------------------------------------------

_IPV4_OPTIONS = st.one_of(
    st.just(b"\x01"),  # NOP
    st.just(b"\x00"),  # EOL
    st.builds(lambda n: bytes((7, 3 + 4 * n, 4)) + bytes(4 * n), st.integers(1, 4)),  # RR
    st.just(b"\x94\x04\x00\x00"),  # router alert
    st.builds(lambda n: bytes((68, 4 + 4 * n, 5, 0)) + bytes(4 * n), st.integers(1, 4)),  # TS
    st.binary(min_size=1, max_size=8),  # garbage
)


@st.composite
def ipv4(
    draw: st.DrawFn, src: IPAddress, dst: IPAddress, proto: int, payload: bytes, tos: int = 0
) -> bytes:
    opts = b"".join(draw(st.lists(_IPV4_OPTIONS, max_size=4)))[:40]
    opts += bytes(-len(opts) % 4)
    ihl = 5 + len(opts) // 4
    # Mostly unfragmented (0 or DF), then MF / offsets / the reserved bit, then anything.
    frag = draw(
        st.sampled_from([0, 0x4000] * 4 + [0x2000, 0x0001, 0x2001, 0x1FFF, 0x8000, 0x6000, -1])
    )
    if frag < 0:
        frag = draw(st.integers(0, 0xFFFF))
    ttl = draw(st.sampled_from([64, 0, 1, 255]))
    hdr = struct.pack(
        "!BBHHHBBH4s4s",
        0x40 | ihl,
        tos,
        ihl * 4 + len(payload),
        draw(st.integers(0, 0xFFFF)),
        frag,
        ttl,
        proto,
        0,
        src.packed,
        dst.packed,
    )
    hdr += opts
    csum = ipv4_checksum(hdr)
    if draw(st.integers(0, 9)) == 0:
        csum ^= 0x5A5A  # a bad checksum: lb_xdp does not check it, and must not care
    return hdr[:10] + csum.to_bytes(2, "big") + hdr[12:] + payload


@st.composite
def ipv6_ext_chain(draw: st.DrawFn) -> list[tuple[int, bytes]]:
    """(type, body after next-header/length) of each extension header, in order."""
    chain = []
    for kind in draw(st.lists(st.sampled_from(EXT_HEADERS), max_size=4)):
        if kind == FRAGMENT:
            off = draw(st.sampled_from([0, 1, 100, 0x1FFF]))
            m = draw(st.booleans())
            body = struct.pack("!BHI", 0, (off << 3) | int(m), draw(st.integers(0, 2**32 - 1)))
        elif kind == ROUTING:
            n = draw(st.integers(0, 2))
            body = bytes((draw(st.sampled_from([0, 2, 3, 4])), n)) + bytes(4 + 16 * n)
        else:
            n = draw(st.integers(0, 2))
            body = b"\x01" + bytes((4 + 8 * n,)) + bytes(4 + 8 * n)  # PadN filling it
        chain.append((kind, body))
    return chain


def ipv6(
    src: IPAddress,
    dst: IPAddress,
    proto: int,
    payload: bytes,
    chain: Sequence[tuple[int, bytes]] = (),
    tc: int = 0,
    hlim: int = 64,
) -> bytes:
    exts = b""
    for i, (_kind, body) in enumerate(chain):
        nxt = chain[i + 1][0] if i + 1 < len(chain) else proto
        if _kind == FRAGMENT:
            exts += bytes((nxt,)) + body
        else:
            exts += bytes((nxt, (2 + len(body)) // 8 - 1)) + body
    first = chain[0][0] if chain else proto
    body = exts + payload
    hdr = struct.pack(
        "!IHBB16s16s", (6 << 28) | (tc << 20), len(body), first, hlim, src.packed, dst.packed
    )
    return hdr + body


def ip(
    draw: st.DrawFn, src: IPAddress, dst: IPAddress, proto: int, payload: bytes, tos: int = 0
) -> bytes:
    if src.version == 4:
        return draw(ipv4(src, dst, proto, payload, tos))
    chain = draw(st.one_of(st.just([]), ipv6_ext_chain()))
    hlim = draw(st.sampled_from([64, 0, 1, 255]))
    return ipv6(src, dst, proto, payload, chain, tos, hlim)


# --- whole packets -----------------------------------------------------------------------------


@st.composite
def flow_packet(draw: st.DrawFn, t: Targets, version: int) -> bytes:
    """An IP packet of TCP or UDP: mostly to a VIP's exact (address, port, protocol)
    (any port for a wildcard), else to anything the strategies aim at."""
    vips = [v for v in t.vips if v[0].version == version]
    src = draw(address(t, version, dst=False))
    if vips and draw(st.integers(0, 9)) < 7:
        dst, dport, proto = draw(st.sampled_from(vips))
        dport = dport or draw(port(t, proto, dst=True))
        sport = draw(port(t, proto, dst=False))
        payload: bytes = draw(payloads)
        seg: bytes = (
            draw(tcp(sport, dport, payload)) if proto == TCP else udp(sport, dport, payload)
        )
    else:
        proto = draw(st.sampled_from([TCP, UDP]))
        dst = draw(address(t, version, dst=True))
        _, _, seg = draw(l4(t, proto))
    tos = draw(st.sampled_from([0, 0xB8, 0x03, 0xFF]))
    return ip(draw, src, dst, proto, seg, tos)


@st.composite
def quoted(draw: st.DrawFn, t: Targets, version: int) -> tuple[bytes, IPAddress]:
    """The packet an ICMP error quotes, and who it came back to (the client).

    Mostly a VIP flow reversed: what a VIP's backend sent to the client (VIP:port ->
    client:port), which a router on the way back bounced.  Sometimes the client's own
    packet to the VIP, sometimes anything.
    """
    proto = draw(st.sampled_from([TCP, UDP, TCP, UDP, ICMP if version == 4 else ICMP6]))
    vips = [v for v in t.vips if v[0].version == version and v[2] == proto] or [
        v for v in t.vips if v[0].version == version
    ]
    vip, vport, _ = draw(st.sampled_from(vips)) if vips else (CLIENT4, 80, TCP)
    vport = vport or draw(st.integers(1, 65535))
    client = draw(address(t, version, dst=False))
    cport = draw(st.integers(1024, 65535))
    how = draw(st.sampled_from(["reversed", "reversed", "forward", "other"]))
    if how == "reversed":
        src, dst, sport, dport = vip, client, vport, cport
    elif how == "forward":
        src, dst, sport, dport = client, vip, cport, vport
    else:
        src = draw(address(t, version, dst=True))
        dst, sport, dport = client, draw(st.integers(0, 65535)), draw(st.integers(0, 65535))
    if proto == TCP:
        seg = draw(tcp(sport, dport, b""))
    elif proto == UDP:
        seg = udp(sport, dport, draw(st.binary(max_size=8)))
    else:
        seg = struct.pack("!BBHHH", 8 if version == 4 else 128, 0, 0, 1, 1)
    inner: bytes = ip(draw, src, dst, proto, seg)
    # Routers quote at least the IP header and 8 bytes (RFC 792), often more.
    keep = draw(st.one_of(st.just(len(inner)), st.integers(0, len(inner))))
    return inner[:keep], (dst if how != "forward" else src)


_ICMP4_TYPES = [(3, 4), (3, 3), (3, 1), (3, 0), (11, 0), (11, 1), (8, 0), (0, 0), (5, 1), (12, 0)]
_ICMP6_TYPES = [(2, 0), (1, 4), (1, 0), (3, 0), (3, 1), (128, 0), (129, 0), (4, 0), (135, 0)]


@st.composite
def icmp_packet(draw: st.DrawFn, t: Targets, version: int) -> bytes:
    """ICMP / ICMPv6: errors quoting a packet (frag needed / packet too big carry an
    MTU), or echo; sent to the client whose flow it quotes, or to a VIP."""
    kind, code = draw(
        st.one_of(
            st.sampled_from(_ICMP4_TYPES if version == 4 else _ICMP6_TYPES),
            st.tuples(st.integers(0, 255), st.integers(0, 255)),
        )
    )
    body: bytes
    to: IPAddress
    if kind in (8, 0, 128, 129):  # echo: identifier, sequence, data
        body = struct.pack("!HH", draw(st.integers(0, 65535)), 1) + draw(st.binary(max_size=24))
        to = draw(address(t, version, dst=True))
    else:
        inner, client = draw(quoted(t, version))
        mtu = draw(st.sampled_from([0, 68, 576, 1280, 1400, 1500, 9000, 65535]))
        rest = struct.pack("!I", mtu) if version == 6 else struct.pack("!HH", 0, mtu & 0xFFFF)
        body = rest + inner
        # The error comes back towards where the quoted packet came from: for a reversed
        # VIP flow that is the VIP (the client's side of the path bounced the backend's
        # reply... to the LB's VIP); sometimes elsewhere.
        to = draw(
            st.one_of(st.just(_quoted_src(inner, version, client)), address(t, version, dst=True))
        )
    hdr = struct.pack("!BBH", kind, code, 0) + body
    csum = _csum(hdr) if draw(st.booleans()) else draw(st.integers(0, 0xFFFF))
    pkt = hdr[:2] + struct.pack("!H", csum) + hdr[4:]
    src = draw(address(t, version, dst=False))
    return ip(draw, src, to, ICMP if version == 4 else ICMP6, pkt)


def _quoted_src(inner: bytes, version: int, fallback: IPAddress) -> IPAddress:
    """The quoted packet's source: an ICMP error is sent to it."""
    if version == 4 and len(inner) >= 16:
        return ipaddress.IPv4Address(inner[12:16])
    if version == 6 and len(inner) >= 24:
        return ipaddress.IPv6Address(inner[8:24])
    return fallback


@st.composite
def tunnel_packet(draw: st.DrawFn, t: Targets, version: int) -> bytes:
    """A whole inner packet wrapped in GUE (glb-director hop list) or IPIP, as lb_xdp's
    own output looks, sent to a VIP, a backend or the LB."""
    inner_v = draw(st.sampled_from([4, 6]))
    inner: bytes = draw(flow_packet(t, inner_v))
    src = draw(address(t, version, dst=False))
    dst = draw(address(t, version, dst=True))
    if draw(st.booleans()):
        return ip(draw, src, dst, IPIP if inner_v == 4 else IPV6, inner)
    hops = draw(st.lists(address(t, version, dst=False), min_size=1, max_size=abi.MAX_HOPS))
    w = 1 if version == 4 else 4
    hlen = draw(st.one_of(st.just(1 + len(hops) * w), st.integers(0, 31)))
    gue = bytes((hlen, IPIP if inner_v == 4 else IPV6, 0, 0))
    gue += struct.pack("!HBB", 0, draw(st.integers(0, len(hops))), len(hops))
    gue += b"".join(h.packed for h in hops)
    sport = draw(st.integers(0x8000, 0xFFFF))
    dport = draw(st.one_of(st.just(t.gue_port), port(t, UDP, dst=True)))
    return ip(draw, src, dst, UDP, udp(sport, dport, gue + inner))


@st.composite
def ip_packet(draw: st.DrawFn, t: Targets) -> bytes:
    version = draw(st.sampled_from([4, 6]))
    kind = draw(st.sampled_from(["flow"] * 4 + ["icmp"] * 2 + ["tunnel"]))
    make = {"flow": flow_packet, "icmp": icmp_packet, "tunnel": tunnel_packet}[kind]
    return draw(make(t, version))


#: TPIDs in front of the EtherType: mostly none or one tag, sometimes two, or an odd one.
_TAGS = [b""] * 10 + [b"\x81\x00"] * 3 + [b"\x88\xa8"] * 2
_TAGS += [b"\x88\xa8\x81\x00", b"\x81\x00\x81\x00", b"\x91\x00"]


@st.composite
def ethernet(draw: st.DrawFn, packet: bytes) -> bytes:
    """Ethernet, untagged or with tags (each tag a TPID from the list and a VLAN id)."""
    version = packet[0] >> 4 if packet else 4
    right = ETH_P_IP if version == 4 else ETH_P_IPV6
    ethertype = draw(st.sampled_from([right] * 28 + [ETH_P_IP, ETH_P_IPV6, 0x0806, 0x8847]))
    tags: bytes = draw(st.sampled_from(_TAGS))
    vid = draw(st.integers(0, 0xFFFF)).to_bytes(2, "big")
    tagged = b"".join(tags[i : i + 2] + vid for i in range(0, len(tags), 2))
    pad = draw(st.sampled_from([b"", b"", b"", b"\x00" * 6, b"\xee" * 17]))
    return frames.MAC_DST + frames.MAC_SRC + tagged + ethertype.to_bytes(2, "big") + packet + pad


@dataclass(frozen=True)
class Drawn:
    """One hypothesis example: a frame and the seed of its mutations."""

    frame: bytes
    seed: int


def drawn(t: Targets) -> st.SearchStrategy[Drawn]:
    """The strategy of the fuzz: a structured frame plus a mutation seed."""
    return st.builds(Drawn, ip_packet(t).flatmap(ethernet), st.integers(0, 2**32 - 1))


# --- deterministic expansion -------------------------------------------------------------------


def l3_offset(frame: bytes) -> int:
    """Where the IP header starts, the tags lb_xdp skips being skipped here too (any
    number of them, so that mutations also land behind a second tag)."""
    off = 12
    while frame[off : off + 2] in (b"\x81\x00", b"\x88\xa8", b"\x91\x00"):
        off += 4
    return off + 2


def _length_fields(frame: bytes, l3: int) -> list[tuple[int, int, str]]:
    """(offset, size, kind) of the length fields of the frame's headers as built."""
    out: list[tuple[int, int, str]] = []
    if len(frame) < l3 + 20:
        return out
    v = frame[l3] >> 4
    if v == 4:
        out += [(l3, 1, "ihl"), (l3 + 2, 2, "len")]  # IHL (with version), tot_len
        l4, proto = l3 + (frame[l3] & 0xF) * 4, frame[l3 + 9]
    elif v == 6 and len(frame) >= l3 + 40:
        out.append((l3 + 4, 2, "len"))
        l4, proto = l3 + 40, frame[l3 + 6]
        while proto in EXT_HEADERS and len(frame) >= l4 + 8:
            out.append((l4 + 1, 1, "len"))
            nxt = frame[l4]
            l4 += 8 if proto == FRAGMENT else (frame[l4 + 1] + 1) * 8
            proto = nxt
    else:
        return out
    if proto == TCP and len(frame) >= l4 + 13:
        out.append((l4 + 12, 1, "doff"))
    elif proto == UDP and len(frame) >= l4 + 6:
        out.append((l4 + 4, 2, "len"))
    return out


def expand(d: Drawn, *, flips: int = 24) -> Iterator[bytes]:
    """The drawn frame, every truncation of it, corruptions of each of its length fields
    (small deltas, extremes, random), byte flips and length-consistent truncations.

    Deterministic in ``d``: the same example gives the same frames in the same order.
    """
    rng = random.Random(d.seed)
    fr = d.frame
    yield fr
    l3 = l3_offset(fr)
    # The same flow again: a connection-table hit; TCP with other flags too (an ACK
    # follows the SYN's entry; a SYN re-balances; Beamer records no mid-flow packet).
    yield fr
    fields = _length_fields(fr, l3)
    for off, _size, kind in fields:
        if kind == "doff" and off + 1 < len(fr):
            for flags in (0x10, 0x02, 0x12, 0x18, 0x04):
                yield fr[: off + 1] + bytes((flags,)) + fr[off + 2 :]
    # Every cut through the headers; in a long payload, a sample (they all look alike).
    every = min(len(fr), l3 + 160)
    for n in range(14, every):
        yield fr[:n]
    for n in sorted({rng.randrange(every, len(fr)) for _ in range(12)} if every < len(fr) else ()):
        yield fr[:n]
    for off, size, kind in fields:
        if off + size > len(fr):
            continue
        old = int.from_bytes(fr[off : off + size], "big")
        top = (1 << (8 * size)) - 1
        if kind == "ihl":  # IPv4 version / IHL: every IHL, and a few versions
            values = [0x40 | i for i in range(16)] + [0x00 | (old & 0xF), 0x60 | (old & 0xF)]
        elif kind == "doff":
            values = [(i << 4) | (old & 0xF) for i in range(16)]
        else:
            values = [old + k for k in (-9, -8, -4, -2, -1, 1, 2, 4, 8)] + [0, top]
            values += [rng.randrange(top + 1) for _ in range(4)]
        for v in values:
            if 0 <= v <= top and v != old:
                yield fr[:off] + v.to_bytes(size, "big") + fr[off + size :]
    # IP packet cut short with its length field saying so.
    if len(fr) >= l3 + 20 and fr[l3] >> 4 in (4, 6):
        v6 = fr[l3] >> 4 == 6
        for n in sorted({rng.randrange(20, max(21, len(fr) - l3)) for _ in range(8)}):
            if v6 and n < 40:
                continue
            cut = bytearray(fr[: l3 + n])
            if v6:
                cut[l3 + 4 : l3 + 6] = (n - 40).to_bytes(2, "big")
            else:
                cut[l3 + 2 : l3 + 4] = n.to_bytes(2, "big")
            yield bytes(cut)
    # Byte flips and random bytes, mostly in the headers.
    hi = min(len(fr), l3 + 96)
    for _ in range(flips):
        b = bytearray(fr)
        for _k in range(rng.choice((1, 1, 2, 3))):
            pos = rng.randrange(12, hi) if hi > 12 else 0
            if pos < len(b):
                b[pos] = (
                    rng.randrange(256) if rng.random() < 0.5 else b[pos] ^ (1 << rng.randrange(8))
                )
        yield bytes(b)
