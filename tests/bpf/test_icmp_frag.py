"""lb_xdp on fragments, IPv6 extension headers and ICMP (docs/datapath.md steps 2, 4a-4c
and 12's too-big answer): exact output bytes and counter deltas per case, then random
fragments, quotes and header chains against the reference model.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
import subprocess
from collections.abc import Iterator
from typing import Any

import lb_fixtures as fx
import pytest
from lb_harness import Lb
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import (
    ICMPv6EchoReply,
    ICMPv6EchoRequest,
    ICMPv6PacketTooBig,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
)
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw
from test_differential import ModelLb, check_forward, make_state
from test_lb_xdp import run_case

from xdplb import model
from xdplb.core import abi
from xdplb.core.abi import DropReason, Event
from xdplb.core.hashing import flow_hash
from xdplb.core.state import ConnEntry, VipAddrInfo, vip_addr_infos
from xdplb.datapath import BpfObject
from xdplb.model import frames
from xdplb.model.parse import IPPROTO_FRAGMENT

pytestmark = pytest.mark.bpf

C4, C6 = str(fx.CLIENT4), str(fx.CLIENT6)
ROUTER4, ROUTER6 = "198.18.7.1", "fd78:6470:6c62:7::1"


def eth(lb: Lb) -> Packet:
    return Ether(dst=lb.env.lb_mac, src=fx.CLIENT_MAC)


def pick_for(vip: fx.VipDef, key: abi.FlowKey) -> tuple[fx.BackendDef, int]:
    assert vip.backends is not None
    h = flow_hash(bytes(key), fx.SEED)
    return fx.BACKENDS[vip.backends[(h % fx.TABLE_SIZE) % len(vip.backends)]], h


def forwarded(
    lb: Lb, frame: bytes, vip: fx.VipDef, be: fx.BackendDef, h: int, events: dict[Event, int]
) -> fx.Expect:
    assert be.mac is not None
    ip_len = fx.flow_of(frame)[5]
    return fx.Expect(
        fx.XDP_TX,
        fx.encapsulated(frame, vip, be, h, eth_dst=be.mac, eth_src=lb.env.lb_mac),
        events={**events, Event.TX: 1},
        vip_stats={vip.id: (1, ip_len, 0)},
        be_stats={be.id: (1, ip_len, 0)},
    )


# --- 2. IPv6 extension headers ------------------------------------------------------------


def test_extension_headers_are_walked_to_tcp(lb: Lb) -> None:
    vip = fx.VIPS["tcp6"]
    pkt = (
        eth(lb)
        / IPv6(src=C6, dst=str(vip.addr))
        / IPv6ExtHdrHopByHop()
        / IPv6ExtHdrRouting(segleft=0)
        / IPv6ExtHdrDestOpt()
        / TCP(sport=41000, dport=80, flags="S")
        / Raw(b"ext")
    )
    frame = bytes(pkt)
    be, h = pick_for(vip, abi.FlowKey.make(fx.CLIENT6, vip.addr, 41000, 80, fx.TCP_))
    assert be.mac is not None
    ip_len = len(frame) - 14
    want = fx.Expect(
        fx.XDP_TX,
        fx.encapsulated(frame, vip, be, h, eth_dst=be.mac, eth_src=lb.env.lb_mac),
        events={**fx.NEW_FLOW, Event.TX: 1},
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={be.id: (1, ip_len, 1)},
    )
    run_case(lb, frame, want)


@pytest.mark.parametrize(
    ("desc", "headers"),
    [
        ("five extension headers", [IPv6ExtHdrDestOpt() for _ in range(5)]),
        ("a header longer than the packet", [IPv6ExtHdrDestOpt(len=9)]),
    ],
)
def test_bad_extension_header_chains_are_malformed(lb: Lb, desc: str, headers: list[Any]) -> None:
    vip = fx.VIPS["tcp6"]
    ip = IPv6(src=C6, dst=str(vip.addr))
    chain: Packet = ip
    for hdr in headers:
        chain = chain / hdr
    frame = bytes(eth(lb) / chain / TCP(sport=41000, dport=80))
    if desc.startswith("a header longer"):
        frame = frame[:-20]  # cut the TCP header: the option header overruns the packet
        frame = frame[:18] + (len(frame) - 54).to_bytes(2, "big") + frame[20:]
    run_case(lb, frame, fx.passed(Event.PASS_MALFORMED)(lb.env, frame))


# --- 4a. Fragments --------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0, 1, 185])
def test_ipv6_fragments_go_to_one_backend(lb: Lb, offset: int) -> None:
    vip = fx.VIPS["udp6"]
    more = 1 if offset < 185 else 0
    body = bytes(UDP(sport=5353, dport=53) / Raw(b"q" * 40)) if offset == 0 else b"r" * 48
    pkt = (
        eth(lb)
        / IPv6(src=C6, dst=str(vip.addr))
        / IPv6ExtHdrFragment(nh=17, offset=offset, m=more, id=77)
        / Raw(body)
    )
    frame = bytes(pkt)
    be, h = pick_for(vip, abi.FlowKey.make(fx.CLIENT6, vip.addr, 0, 0, fx.UDP_))
    run_case(lb, frame, forwarded(lb, frame, vip, be, h, {Event.FRAGMENT: 1}))
    assert lb.conn(bytes(eth(lb) / IPv6(src=C6, dst=str(vip.addr)) / UDP(sport=0, dport=0))) is None


def test_ipv4_later_fragment_follows_the_first(lb: Lb) -> None:
    vip = fx.VIPS["srchash"]
    first = bytes(
        eth(lb)
        / IP(src=C4, dst=str(vip.addr), flags="MF", id=9)
        / TCP(sport=40000, dport=80)
        / Raw(b"a" * 16)
    )
    later = bytes(eth(lb) / IP(src=C4, dst=str(vip.addr), frag=5, id=9, proto=6) / Raw(b"b" * 24))
    key = abi.FlowKey(abi.addr_words(fx.CLIENT4))  # source hash: the source only
    be, h = pick_for(vip, key)
    run_case(lb, first, forwarded(lb, first, vip, be, h, {Event.FRAGMENT: 1}))
    run_case(lb, later, forwarded(lb, later, vip, be, h, {Event.FRAGMENT: 1}))


def test_fragments_drop_when_no_vip_is_named_and_follow_the_choice(lb: Lb) -> None:
    tcp4 = fx.VIPS["tcp4"]
    frag = bytes(eth(lb) / IP(src=C4, dst=str(tcp4.addr), frag=3, proto=6) / Raw(b"z" * 8))
    # A second TCP VIP on the address, no wildcard: nobody is named, fragments drop.
    lb.put_vip(fx.VipDef(40, tcp4.addr, 443, fx.TCP_, fx.V4_BES))
    lb.set_vip_addrs(chosen=())
    lb.obj.map("lb_vip_addrs").update(
        abi.Addr.make(tcp4.addr).pack(), VipAddrInfo(3, None, 53).abi_value().pack()
    )
    run_case(lb, frag, fx.dropped(DropReason.FRAGMENT)(lb.env, frag))
    # The operator's choice (fragments: true on :443) names it.
    lb.obj.map("lb_vip_addrs").update(
        abi.Addr.make(tcp4.addr).pack(), VipAddrInfo(3, 443, 53).abi_value().pack()
    )
    chosen = fx.VipDef(40, tcp4.addr, 443, fx.TCP_, fx.V4_BES)
    be, h = pick_for(chosen, abi.FlowKey.make(fx.CLIENT4, tcp4.addr, 0, 0, fx.TCP_))
    want = forwarded(lb, frag, chosen, be, h, {Event.FRAGMENT: 1})
    # The harness reads the fixture VIPs' stats only.
    run_case(lb, frag, dataclasses.replace(want, vip_stats={}))


# --- 4b. ICMP errors ---------------------------------------------------------------------------


def quote4(vip: fx.VipDef, sport: int = 40000, proto: int = fx.TCP_) -> bytes:
    """The start of the backend's reply VIP:port -> client:sport, as a router quotes it."""
    l4: Packet = (
        TCP(sport=vip.port, dport=sport, flags="A")
        if proto == fx.TCP_
        else UDP(sport=vip.port, dport=sport)
    )
    return bytes(IP(src=str(vip.addr), dst=C4, flags="DF") / l4 / Raw(b"x" * 1400))[:28]


def quote6(vip: fx.VipDef, sport: int = 40000) -> bytes:
    return bytes(
        IPv6(src=str(vip.addr), dst=C6) / TCP(sport=vip.port, dport=sport) / Raw(b"x" * 1400)
    )[:1232]


def frag_needed(lb: Lb, vip: fx.VipDef, quote: bytes, mtu: int = 1400) -> bytes:
    return bytes(
        eth(lb)
        / IP(src=ROUTER4, dst=str(vip.addr))
        / ICMP(type=3, code=4, nexthopmtu=mtu)
        / Raw(quote)
    )


def test_frag_needed_goes_to_the_backend_of_the_connection(lb: Lb) -> None:
    vip = fx.VIPS["tcp4"]
    syn = bytes(fx.client_frame(vip.addr, 80, lb_mac=lb.env.lb_mac, sport=40000))
    be_id, h = fx.pick(syn, vip)
    run_case(lb, syn, fx.new_flow("tcp4")(lb.env, syn))
    # Move the connection elsewhere in the table: the ICMP must follow the connection.
    other = next(b for b in fx.V4_BES if b != be_id)
    lb.set_table(vip.id, [other])
    icmp = frag_needed(lb, vip, quote4(vip))
    want = forwarded(lb, icmp, vip, fx.BACKENDS[be_id], h, {Event.CONN_HIT: 1, Event.ICMP_ERROR: 1})
    run_case(lb, icmp, want)
    assert lb.conn(syn) is not None


def test_icmp_error_without_a_connection_follows_the_table_and_is_not_recorded(lb: Lb) -> None:
    vip = fx.VIPS["udp4"]
    icmp = bytes(
        eth(lb)
        / IP(src=ROUTER4, dst=str(vip.addr))
        / ICMP(type=11, code=0)
        / Raw(quote4(vip, 5353, fx.UDP_))
    )
    be, h = pick_for(vip, abi.FlowKey.make(fx.CLIENT4, vip.addr, 5353, 53, fx.UDP_))
    run_case(lb, icmp, forwarded(lb, icmp, vip, be, h, {Event.ICMP_ERROR: 1}))
    flow = bytes(fx.client_frame(vip.addr, 53, fx.UDP_, lb_mac=lb.env.lb_mac, sport=5353))
    assert lb.conn(flow) is None


def test_packet_too_big_goes_to_the_flows_backend(lb: Lb) -> None:
    vip = fx.VIPS["tcp6"]
    icmp = bytes(
        eth(lb)
        / IPv6(src=ROUTER6, dst=str(vip.addr))
        / ICMPv6PacketTooBig(mtu=1280)
        / Raw(quote6(vip)[: 1280 - 48])
    )
    be, h = pick_for(vip, abi.FlowKey.make(fx.CLIENT6, vip.addr, 40000, 80, fx.TCP_))
    run_case(lb, icmp, forwarded(lb, icmp, vip, be, h, {Event.ICMP_ERROR: 1}))


@pytest.mark.parametrize(
    ("desc", "build"),
    [
        ("quote too short for the ports", lambda v: quote4(v)[:22]),
        ("quote from another address", lambda v: bytes(IP(src="198.19.9.9", dst=C4) / TCP())[:28]),
        (
            "quote of a port no VIP has",
            lambda v: bytes(IP(src=str(v.addr), dst=C4) / TCP(sport=81)),
        ),
        ("quoted ICMP", lambda v: bytes(IP(src=str(v.addr), dst=C4) / ICMP())),
    ],
)
def test_bad_quotes_drop(lb: Lb, desc: str, build: Any) -> None:
    vip = fx.VIPS["tcp4"]
    icmp = frag_needed(lb, vip, build(vip))
    run_case(lb, icmp, fx.dropped(DropReason.ICMP)(lb.env, icmp))


def test_other_icmp_passes(lb: Lb) -> None:
    vip = fx.VIPS["tcp4"]
    for msg in (ICMP(type=8, id=1, seq=1), ICMP(type=5, code=1, gw=ROUTER4)):
        frame = bytes(eth(lb) / IP(src=C4, dst=str(vip.addr)) / msg / Raw(quote4(vip)))
        run_case(lb, frame, fx.passed(Event.PASS_NOT_VIP)(lb.env, frame))
    # ICMP to an address without VIPs is none of our business, whatever it quotes.
    frame = bytes(eth(lb) / IP(src=ROUTER4, dst="198.19.99.1") / ICMP(type=3, code=4) / Raw(b"x"))
    run_case(lb, frame, fx.passed(Event.PASS_NOT_VIP)(lb.env, frame))


# --- 4c. Echo ------------------------------------------------------------------------------------


def test_echo_is_answered_when_the_address_says_so(lb: Lb) -> None:
    lb.set_vip_addrs(echo=[fx.VIPS["tcp4"].addr, fx.VIPS["tcp6"].addr])
    v4, v6 = fx.VIPS["tcp4"].addr, fx.VIPS["tcp6"].addr
    req4 = (
        eth(lb) / IP(src=C4, dst=str(v4), ttl=61, id=5) / ICMP(type=8, id=7, seq=3) / Raw(b"ping")
    )
    rep4 = (
        Ether(dst=fx.CLIENT_MAC, src=lb.env.lb_mac)
        / IP(src=str(v4), dst=C4, ttl=64, id=5)
        / ICMP(type=0, id=7, seq=3)
        / Raw(b"ping")
    )
    req6 = eth(lb) / IPv6(src=C6, dst=str(v6), hlim=3) / ICMPv6EchoRequest(id=7, seq=3, data=b"p6")
    rep6 = (
        Ether(dst=fx.CLIENT_MAC, src=lb.env.lb_mac)
        / IPv6(src=str(v6), dst=C6, hlim=64)
        / ICMPv6EchoReply(id=7, seq=3, data=b"p6")
    )
    for req, rep in ((req4, rep4), (req6, rep6)):
        frame = bytes(req)
        run_case(lb, frame, fx.Expect(fx.XDP_TX, bytes(rep), events={Event.ICMP_ECHO: 1}))
    # Another address has no echo: passed.
    other = bytes(eth(lb) / IP(src=C4, dst=str(fx.VIPS["wild"].addr)) / ICMP(type=8))
    run_case(lb, other, fx.passed(Event.PASS_NOT_VIP)(lb.env, other))


# --- 12. Too big: frag-needed / packet-too-big back to the client ---------------------------------


def big(lb: Lb, vip: fx.VipDef, df: bool = True) -> bytes:
    if vip.addr.version == 4:
        ip: Packet = IP(src=C4, dst=str(vip.addr), flags="DF" if df else 0, id=3)
    else:
        ip = IPv6(src=C6, dst=str(vip.addr))
    return bytes(eth(lb) / ip / UDP(sport=6000, dport=vip.port) / Raw(bytes(range(256)) * 6))[
        : 14 + 1500
    ]


def fix_len(frame: bytes) -> bytes:
    """Lengths of a frame cut to 1,500 bytes of IP."""
    p = Ether(frame)
    if IP in p:
        del p[IP].len, p[IP].chksum, p[UDP].len
    else:
        del p[IPv6].plen, p[UDP].len
    return bytes(p)


def test_too_big_is_answered_when_configured(lb: Lb) -> None:
    lb.set_config(flags=abi.CFG_F_PTB)
    for name, overhead in (("udp4", 20 + 8 + 8 + 4), ("udp6", 40 + 8 + 8 + 16)):
        vip = fx.VIPS[name]
        frame = fix_len(big(lb, vip))
        inner = frame[14:]
        h = fx.hash_of(frame, vip)
        be = fx.BACKENDS[vip.backends[(h % fx.TABLE_SIZE) % len(vip.backends)]]  # type: ignore[index]
        ip_len = len(inner)
        back = Ether(dst=fx.CLIENT_MAC, src=lb.env.lb_mac)
        if vip.addr.version == 4:
            reply = (
                back
                / IP(src=str(vip.addr), dst=C4, ttl=64, id=0)
                / ICMP(type=3, code=4, nexthopmtu=1500 - overhead)
                / Raw(inner[:548])
            )
        else:
            reply = (
                back
                / IPv6(src=str(vip.addr), dst=C6, hlim=64)
                / ICMPv6PacketTooBig(mtu=1500 - overhead)
                / Raw(inner[:1232])
            )
        want = fx.Expect(
            fx.XDP_TX,
            bytes(reply),
            events={**fx.NEW_FLOW, Event.ICMP_PTB: 1},
            vip_stats={vip.id: (1, ip_len, 1)},
            be_stats={be.id: (1, ip_len, 1)},
        )
        run_case(lb, frame, want)


def test_too_big_without_df_is_still_dropped(lb: Lb) -> None:
    lb.set_config(flags=abi.CFG_F_PTB)
    vip = fx.VIPS["udp4"]
    frame = fix_len(big(lb, vip, df=False))
    h = fx.hash_of(frame, vip)
    be = fx.BACKENDS[vip.backends[(h % fx.TABLE_SIZE) % len(vip.backends)]]  # type: ignore[index]
    before = lb.counters()
    r = lb.run(frame)
    assert r.retval == fx.XDP_DROP
    delta = lb.counters() - before
    assert delta.named()["drops"] == {"TOO_BIG": 1}
    assert delta.named()["events"] == {"CONN_MISS": 1, "CONN_INSERT": 1}
    assert delta.be_stats == {be.id: (1, len(frame) - 14, 1)}


def forget_next_hops(lb: Lb) -> None:
    """Empty lb_xdp's next-hop cache (lib/fib.h: 64 jiffies of earlier tests' lookups, made
    before the route MTU): the next packets look the route up afresh."""
    nh = lb.obj.map("lb_nexthops")
    nh.update_array(bytes(nh.max_entries * nh.value_stride))


@pytest.fixture
def route_mtu(lb: Lb) -> Iterator[int]:
    """A locked route MTU of 1,300 to backend 1 (bpf_fib_lookup uses a route MTU only
    when locked, or with ip_forward_use_pmtu)."""
    dst = str(fx.BACKENDS[1].addr)
    subprocess.run(
        ["ip", "route", "replace", f"{dst}/32", "dev", "lb0", "mtu", "lock", "1300"], check=True
    )
    forget_next_hops(lb)
    try:
        yield 1300
    finally:
        subprocess.run(["ip", "route", "del", f"{dst}/32"], check=False)


def test_too_big_names_the_route_mtu(lb: Lb, route_mtu: int) -> None:
    lb.set_config(flags=abi.CFG_F_PTB)
    vip = fx.VIPS["tcp4"]
    lb.set_table(vip.id, [1])
    frame = bytes(
        eth(lb)
        / IP(src=C4, dst=str(vip.addr), flags="DF")
        / TCP(sport=40000, dport=80, flags="A")
        / Raw(b"m" * 1300)
    )
    r = lb.run(frame)
    assert r.retval == fx.XDP_TX
    reply = Ether(r.data)
    assert reply[IP].src == str(vip.addr) and reply[IP].dst == C4
    assert (reply[ICMP].type, reply[ICMP].code) == (3, 4)
    assert reply[ICMP].nexthopmtu == route_mtu - 40
    assert r.data[14 + 28 :] == frame[14 : 14 + 548]
    # Checksums as a receiver computes them.
    assert bytes(Ether(bytes(fix_checksums(reply)))) == r.data


def fix_checksums(p: Packet) -> Packet:
    q = p.copy()
    del q[IP].chksum, q[ICMP].chksum
    return q


# --- random fragments, quotes and header chains against the model ---------------------------------


@pytest.fixture(scope="module")
def mlb(lb_obj: BpfObject, lb_netns: Any) -> Iterator[ModelLb]:
    mac = bytes.fromhex(lb_netns.lb_mac.replace(":", ""))
    harness = ModelLb(lb_obj, lb_netns.lb_ifindex, mac, [])
    try:
        yield harness
    finally:
        for inner in harness.inner_maps:
            inner.close()


def random_frames(state: model.DataplaneState, n: int, seed: int) -> Iterator[bytes]:
    rng = random.Random(seed)
    vips = list(state.vips)
    for _ in range(n):
        vip = rng.choice(vips)
        v6 = vip.addr.version == 6
        dst = vip.addr if rng.random() < 0.9 else ipaddress.ip_address(bytes(4 if not v6 else 16))
        client = (
            ipaddress.ip_address(bytes.fromhex("fd786470") + rng.randbytes(12))
            if v6
            else ipaddress.ip_address(bytes([198, 18, 128 + rng.randrange(64), rng.randrange(256)]))
        )
        port = vip.port or rng.randrange(1, 65536)
        kind = rng.choice(["frag", "icmp", "ext", "echo"])
        l4 = frames.l4_header(vip.proto, rng.randrange(1024, 65536), port, b"d" * 8)
        if kind == "frag":
            body = l4 + b"d" * 8 if rng.random() < 0.5 else rng.randbytes(rng.randrange(0, 40))
            if v6:
                off = rng.choice([0, 1, rng.randrange(8192)]) << 3 | rng.randrange(2)
                hdr = bytes([vip.proto, 0]) + off.to_bytes(2, "big") + rng.randbytes(4)
                ip = frames.ip_packet(client, dst, IPPROTO_FRAGMENT, hdr + body)
            else:
                frag = rng.choice([0x2000, rng.randrange(1, 0x2000), 0x4000])
                ip = frames.ip_packet(client, dst, vip.proto, body, frag=frag)
        elif kind == "icmp":
            reply = frames.ip_packet(
                dst, client, vip.proto, frames.l4_header(vip.proto, port, 40000)
            )
            if rng.random() < 0.2:
                reply = rng.randbytes(40)
            quote = reply[: rng.choice([len(reply), 24, 28, 44, 48, rng.randrange(60)])]
            types = [3, 11, 5, 0] if not v6 else [1, 2, 3, 4, 129]
            icmp = bytes([rng.choice(types), rng.randrange(5)]) + rng.randbytes(6) + quote
            ip = frames.ip_packet(client, dst, 1 if not v6 else 58, icmp)
        elif kind == "echo":
            icmp = bytes([8 if not v6 else 128, 0]) + rng.randbytes(6 + rng.randrange(30))
            ip = frames.ip_packet(client, dst, 1 if not v6 else 58, icmp)
        else:
            if not v6:
                ip = frames.ip_packet(client, dst, vip.proto, l4)
            else:
                chain, nxt = b"", vip.proto
                for _ in range(rng.randrange(0, 6)):
                    ht = rng.choice([0, 43, 60, 44])
                    if ht == 44:
                        h = (
                            bytes([nxt, 0])
                            + (rng.choice([0, 0, 8, 1])).to_bytes(2, "big")
                            + bytes(4)
                        )
                    else:
                        ln = rng.randrange(0, 3)
                        h = bytes([nxt, ln]) + bytes(6 + 8 * ln)
                    chain, nxt = h + chain, ht
                ip = frames.ip_packet(client, dst, nxt, chain + l4)
                if rng.random() < 0.2:
                    cut = rng.randrange(40, len(ip) + 1)
                    ip = ip[:4] + (cut - 40).to_bytes(2, "big") + ip[6:cut]
        yield frames.ethernet(ip, dst.version)


def test_random_fragments_quotes_and_chains_match_the_model(mlb: ModelLb) -> None:
    state = make_state()
    infos = dict(vip_addr_infos(state.vips))
    for addr in list(infos)[::2]:
        infos[addr] = VipAddrInfo(
            infos[addr].nvips, infos[addr].frag_tcp, infos[addr].frag_udp, True
        )
    conns: dict[bytes, ConnEntry] = {}
    state = dataclasses.replace(state, conns=conns, vip_addrs=infos)
    mlb.load_state(state)
    ev0 = mlb.counters("lb_events", len(abi.Event))
    dr0 = mlb.counters("lb_drops", len(abi.DropReason))
    seen: dict[str, int] = {}
    problems = []
    for i, fr in enumerate(random_frames(state, 4000, 5)):
        d = model.decide(state, fr)
        r = mlb.run(fr)
        p = check_forward(mlb, fr, d, r)
        if p is not None:
            problems.append(f"frame {i}: {p}\n  {fr.hex()}")
        for e in d.events:
            seen[e.name] = seen.get(e.name, 0) + 1
        if d.drop is not None:
            seen[d.drop.name] = seen.get(d.drop.name, 0) + 1
    assert not problems, f"{len(problems)} mismatches:\n" + "\n".join(problems[:5])
    for what in ("FRAGMENT", "ICMP_ERROR", "ICMP_ECHO", "CONN_MISS", "PASS_MALFORMED", "ICMP"):
        assert seen.get(what, 0) > 10, f"too few {what}: {seen}"
    assert (mlb.counters("lb_events", len(abi.Event)) - ev0)[abi.Event.ICMP_ECHO] == seen[
        "ICMP_ECHO"
    ]
    assert (mlb.counters("lb_drops", len(abi.DropReason)) - dr0)[DropReason.ICMP] == seen["ICMP"]


@pytest.fixture
def route_mtus(lb: Lb) -> Iterator[int]:
    """Locked route MTUs of 1,300 to backends 1 (IPv4) and 4 (IPv6)."""
    dsts = (f"{fx.BACKENDS[1].addr}/32", f"{fx.BACKENDS[4].addr}/128")
    for dst in dsts:
        subprocess.run(
            ["ip", "route", "replace", dst, "dev", "lb0", "mtu", "lock", "1300"], check=True
        )
    forget_next_hops(lb)
    try:
        yield 1300
    finally:
        for dst in dsts:
            subprocess.run(["ip", "route", "del", dst], check=False)


@pytest.mark.parametrize("family", [4, 6])
def test_a_forwarded_icmp_error_too_big_is_not_answered(
    lb: Lb, route_mtus: int, family: int
) -> None:
    """No ICMP error about an ICMP error (RFC 1122 3.2.2, RFC 4443 2.4(e)): a router's
    error, forwarded to the backend of the flow it quotes and too big for the tunnel, is
    dropped ``TOO_BIG``, not answered to the router."""
    lb.set_config(flags=abi.CFG_F_PTB)
    if family == 4:
        vip = fx.VIPS["tcp4"]
        lb.set_table(vip.id, [1])
        # A long quote (RFC 4884 allows them), with DF as some routers send it.
        quote = bytes(
            IP(src=str(vip.addr), dst=C4, flags="DF")
            / TCP(sport=vip.port, dport=40000, flags="A")
            / Raw(b"x" * 1400)
        )[:1300]
        err: Packet = IP(src=ROUTER4, dst=str(vip.addr), flags="DF") / ICMP(
            type=3, code=4, nexthopmtu=1200
        )
    else:
        vip = fx.VIPS["tcp6"]
        lb.set_table(vip.id, [4])
        # A full-size ICMPv6 error: 1,280 bytes, 1,352 with GUE over IPv6.
        quote = quote6(vip)
        err = IPv6(src=ROUTER6, dst=str(vip.addr)) / ICMPv6PacketTooBig(mtu=1280)
    frame = bytes(eth(lb) / err / Raw(quote))
    assert len(frame) - 14 + (40 if family == 4 else 72) > route_mtus
    before = lb.counters()
    r = lb.run(frame)
    assert r.retval == fx.XDP_DROP, Ether(r.data).summary()
    delta = lb.counters() - before
    assert delta.named()["drops"] == {"TOO_BIG": 1}
    assert delta.named()["events"] == {"ICMP_ERROR": 1}
