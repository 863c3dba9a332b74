"""hc_tc on fixture packets through BPF_PROG_TEST_RUN (docs/datapath.md, "hc_tc").

The module runs inside the lb_xdp tests' namespace (``lb`` fixture: lb0 with the LB's
addresses, permanent neighbours for the fixture backends), where a HealthTunnel makes its
ifb device and loads hc_tc; each run hands hc_tc a frame as the stack would put it on
that device, with the socket's mark in ``skb->mark``.

- byte-exact outputs for IPv4/IPv6, TCP/UDP, GUE/IPIP (expected frames built with scapy
  and ``xdplb.core.hashing``, independently of the program);
- differential: for the same packet, hc_tc's frame is lb_xdp's frame, byte for byte;
- round trip: host_tc decapsulates hc_tc's output back to the original packet;
- every drop reason, each counted exactly once.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
from collections.abc import Iterator

import lb_fixtures as fx
import pytest
from lb_harness import Lb
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Packet, Raw

from xdplb.core import abi
from xdplb.core.hashing import flow_hash
from xdplb.datapath.hc import HealthTunnel, destroy_health_tunnel
from xdplb.datapath.host import HostDatapath
from xdplb.datapath.testrun import TestRunResult, skb_ctx

pytestmark = pytest.mark.bpf

TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = 0, 2, 7
Ev = abi.HcEvent

#: The MACs the stack puts on a frame for a NOARP device: its own, both ways.
IFB_MAC = "02:00:00:00:0c:01"
VIP4 = ipaddress.ip_address("198.18.100.1")
VIP6 = ipaddress.ip_address("fd78:6470:6c62:100::1")
BE = fx.BACKENDS
#: Marks used below: index = fixture backend id (GUE), + 100 (IPIP), + 200 (src hash).
MARK = HealthTunnel.mark_for
GUE_MARKS = {MARK(i): (BE[i].addr, abi.Encap.GUE) for i in BE}
IPIP_MARKS = {MARK(100 + i): (BE[i].addr, abi.Encap.IPIP) for i in BE}


@dataclasses.dataclass(frozen=True)
class Hc:
    """hc_tc of a HealthTunnel in the lb fixture's namespace."""

    tunnel: HealthTunnel

    def run(self, frame: bytes, mark: int) -> TestRunResult:
        prog = self.tunnel.obj.program("hc_tc")
        return prog.test_run(frame, ctx=skb_ctx(mark=mark, ifindex=self.tunnel.ifindex))

    def counters(self) -> dict[str, int]:
        return self.tunnel.counters()


@pytest.fixture(scope="module")
def hc_module(lb_module: Lb) -> Iterator[Hc]:
    """Made inside lb_module's namespace (this thread is in it for the module)."""
    instance = f"xdplbt-{os.getpid()}-hc"
    tunnel = HealthTunnel(instance, fx.LB_SRC4, fx.LB_SRC6, fx.GUE_PORT, hash_seed=fx.SEED)
    try:
        yield Hc(tunnel)
    finally:
        tunnel.close()
        destroy_health_tunnel(instance)


@pytest.fixture
def hc(hc_module: Hc) -> Hc:
    """Every fixture target installed."""
    hc_module.tunnel.set_targets(
        {**GUE_MARKS, **IPIP_MARKS, MARK(210): (BE[1].addr, abi.Encap.GUE, True)}
    )
    return hc_module


# --- expected frames ----------------------------------------------------------------------


def inner(dst: abi.IPAddress, proto: int, *, tos: int = 0, payload: bytes = b"hc") -> Packet:
    """A health check as the LB's stack sends it: from the tunnel source to the VIP."""
    l3: Packet
    if dst.version == 4:
        l3 = IP(src=str(fx.LB_SRC4), dst=str(dst), tos=tos, id=4321, flags="DF", ttl=64)
    else:
        l3 = IPv6(src=str(fx.LB_SRC6), dst=str(dst), tc=tos, fl=0xABCDE, hlim=64)
    l4 = (
        TCP(sport=45678, dport=80, flags="S", seq=7)
        if proto == fx.TCP_
        else UDP(sport=45678, dport=53)
    )
    return l3 / l4 / Raw(payload)


def on_ifb(pkt: Packet) -> bytes:
    etype = 0x0800 if isinstance(pkt, IP) else 0x86DD
    return bytes(Ether(dst=IFB_MAC, src=IFB_MAC, type=etype) / pkt)


def flow_hash_of(pkt: Packet, seed: int = fx.SEED) -> int:
    l4 = pkt.payload
    key = abi.FlowKey.make(
        ipaddress.ip_address(pkt.src),
        ipaddress.ip_address(pkt.dst),
        l4.sport,
        l4.dport,
        fx.TCP_ if isinstance(l4, TCP) else fx.UDP_,
    )
    return flow_hash(bytes(key), seed)


def expected(pkt: Packet, be: fx.BackendDef, encap: abi.Encap, lb_mac: str) -> bytes:
    """docs/datapath.md step 11 for one hop, written out: the frame on lb0."""
    raw = bytes(pkt)
    v4_inner = isinstance(pkt, IP)
    tos = raw[1] if v4_inner else ((raw[0] & 0x0F) << 4) | (raw[1] >> 4)
    inner_proto = 4 if v4_inner else 41
    payload: Packet
    if encap is abi.Encap.GUE:
        hop_words = 1 if be.addr.version == 4 else 4
        gue = bytes([1 + hop_words, inner_proto, 0, 0, 0, 0, 0, 1]) + be.addr.packed
        sport = 0x8000 | (flow_hash_of(pkt) & 0x7FFF)
        payload = UDP(sport=sport, dport=fx.GUE_PORT, chksum=0) / Raw(gue + raw)
        outer_proto = 17
    else:
        payload, outer_proto = Raw(raw), inner_proto
    l3: Packet
    if be.addr.version == 4:
        l3 = IP(
            src=str(fx.LB_SRC4),
            dst=str(be.addr),
            tos=tos,
            id=0,
            flags="DF",
            ttl=64,
            proto=outer_proto,
        )
        etype = 0x0800
    else:
        l3 = IPv6(src=str(fx.LB_SRC6), dst=str(be.addr), tc=tos, fl=0, hlim=64, nh=outer_proto)
        etype = 0x86DD
    assert be.mac is not None
    return bytes(Ether(dst=be.mac, src=lb_mac, type=etype) / l3 / payload)


def _diff(got: bytes, want: bytes) -> str:
    lines = [f"got  {len(got)} bytes: {Ether(got).summary()}", f"want {len(want)} bytes"]
    for off in range(0, max(len(got), len(want)), 16):
        g, w = got[off : off + 16].hex(" "), want[off : off + 16].hex(" ")
        if g != w:
            lines.append(f"{off:04x} got  {g}\n{off:04x} want {w}")
    return "\n".join(lines)


def _moved(hc: Hc, before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in hc.counters().items() if v != before[k]}


# --- exact bytes --------------------------------------------------------------------------

EXACT = [
    # (id, VIP, proto, backend id, encap, tos)
    ("gue-tcp4-in-v4", VIP4, fx.TCP_, 1, abi.Encap.GUE, 0),
    ("gue-udp4-in-v4", VIP4, fx.UDP_, 2, abi.Encap.GUE, 0x10),
    ("gue-tcp6-in-v6", VIP6, fx.TCP_, 4, abi.Encap.GUE, 0xB8),
    ("gue-udp6-in-v6", VIP6, fx.UDP_, 5, abi.Encap.GUE, 0),
    ("gue-tcp4-in-v6", VIP4, fx.TCP_, 6, abi.Encap.GUE, 0),
    ("gue-udp6-in-v4", VIP6, fx.UDP_, 3, abi.Encap.GUE, 0),
    ("ipip-tcp4", VIP4, fx.TCP_, 1, abi.Encap.IPIP, 0x20),
    ("ipip-udp4", VIP4, fx.UDP_, 2, abi.Encap.IPIP, 0),
    ("ip6ip6-tcp6", VIP6, fx.TCP_, 4, abi.Encap.IPIP, 0),
    ("ip6ip6-udp6", VIP6, fx.UDP_, 5, abi.Encap.IPIP, 0x48),
    ("4in6-udp4", VIP4, fx.UDP_, 6, abi.Encap.IPIP, 0),
    ("6in4-tcp6", VIP6, fx.TCP_, 3, abi.Encap.IPIP, 0),
]


def _mark(be_id: int, encap: abi.Encap) -> int:
    return MARK(be_id if encap is abi.Encap.GUE else 100 + be_id)


@pytest.mark.parametrize(
    ("vip", "proto", "be_id", "encap", "tos"), [c[1:] for c in EXACT], ids=[c[0] for c in EXACT]
)
def test_exact_bytes(
    hc: Hc, lb_module: Lb, vip: abi.IPAddress, proto: int, be_id: int, encap: abi.Encap, tos: int
) -> None:
    pkt = inner(vip, proto, tos=tos)
    before = hc.counters()
    res = hc.run(on_ifb(pkt), _mark(be_id, encap))
    assert res.retval == TC_ACT_REDIRECT
    assert _moved(hc, before) == {"redirect": 1}
    want = expected(pkt, BE[be_id], encap, lb_module.ns.lb_mac)
    assert res.data == want, _diff(res.data, want)


def test_src_hash_flag_picks_lb_xdps_source_only_port(hc: Hc) -> None:
    pkt = inner(VIP4, fx.TCP_)
    res = hc.run(on_ifb(pkt), MARK(210))
    src_only = flow_hash(bytes(abi.FlowKey(abi.addr_words(fx.LB_SRC4))), fx.SEED)
    assert res.retval == TC_ACT_REDIRECT
    sport = int.from_bytes(res.data[14 + 20 : 14 + 22], "big")
    assert sport == 0x8000 | (src_only & 0x7FFF) != 0x8000 | (flow_hash_of(pkt) & 0x7FFF)


# --- differential: hc_tc writes what lb_xdp writes ------------------------------------------

SAME_AS_LB = [
    "tcp4",
    "udp4",
    "tcp6",
    "udp6",
    "ipip",
    "ip6ip6",
    "4in6",
    "6in4",
    "ipip6in4",
    "srchash",
]


@pytest.mark.parametrize("vip_name", SAME_AS_LB)
def test_same_frame_as_lb_xdp(hc: Hc, lb: Lb, vip_name: str) -> None:
    """A client packet for a fixture VIP: lb_xdp's frame (XDP_TX on lb0) and hc_tc's frame
    for a mark naming the backend lb_xdp chose, with the VIP's encapsulation and hashing,
    are the same bytes (MACs from the same neighbour entry)."""
    vip = fx.VIPS[vip_name]
    frame = bytes(fx.client_frame(vip.addr, vip.port, vip.proto, lb_mac=lb.ns.lb_mac, tos=0x28))
    be_id, _ = fx.pick(frame, vip)
    src_hash = bool(vip.flags & abi.VIP_F_SRC_HASH)
    hc.tunnel.set_targets({MARK(1): (BE[be_id].addr, vip.encap, src_hash)})

    lb_out = lb.run(frame)
    hc_out = hc.run(frame, MARK(1))
    assert lb_out.retval == fx.XDP_TX
    assert hc_out.retval == TC_ACT_REDIRECT
    assert hc_out.data == lb_out.data, _diff(hc_out.data, lb_out.data)


# --- round trip through host_tc -------------------------------------------------------------


@pytest.fixture(scope="module")
def host_obj() -> Iterator[HostDatapath]:
    dp = HostDatapath(f"xdplbt-{os.getpid()}-hc-host")
    try:
        dp.configure([BE[1].addr, BE[4].addr], fx.GUE_PORT)
        yield dp
    finally:
        dp.close()
        shutil.rmtree(dp.pin_root, ignore_errors=True)


ROUND_TRIP = [
    ("gue-v4", VIP4, fx.TCP_, 1, abi.Encap.GUE, abi.HostEvent.DECAP_GUE),
    ("gue-v6", VIP6, fx.UDP_, 4, abi.Encap.GUE, abi.HostEvent.DECAP_GUE),
    ("gue-4in6", VIP4, fx.UDP_, 4, abi.Encap.GUE, abi.HostEvent.DECAP_GUE),
    ("ipip", VIP4, fx.UDP_, 1, abi.Encap.IPIP, abi.HostEvent.DECAP_IPIP),
    ("ip6ip6", VIP6, fx.TCP_, 4, abi.Encap.IPIP, abi.HostEvent.DECAP_IPIP),
    ("6in4", VIP6, fx.TCP_, 1, abi.Encap.IPIP, abi.HostEvent.DECAP_IPIP),
]


@pytest.mark.parametrize(
    ("vip", "proto", "be_id", "encap", "event"),
    [c[1:] for c in ROUND_TRIP],
    ids=[c[0] for c in ROUND_TRIP],
)
def test_host_tc_gets_the_original_packet_back(
    hc: Hc,
    host_obj: HostDatapath,
    vip: abi.IPAddress,
    proto: int,
    be_id: int,
    encap: abi.Encap,
    event: abi.HostEvent,
) -> None:
    pkt = inner(vip, proto, payload=b"GET / HTTP/1.1\r\n\r\n")
    out = hc.run(on_ifb(pkt), _mark(be_id, encap))
    assert out.retval == TC_ACT_REDIRECT
    before = host_obj.events()
    back = host_obj.obj.program("host_tc").test_run(out.data)
    after = host_obj.events()
    assert back.retval == TC_ACT_OK
    assert after[event] - before[event] == 1
    etype = 0x0800 if vip.version == 4 else 0x86DD
    want = bytes(Ether(dst=BE[be_id].mac, src=out.data[6:12], type=etype) / pkt)
    assert back.data == want, _diff(back.data, want)


# --- drops and the unresolved neighbour -------------------------------------------------------


def test_unresolved_neighbour_goes_to_redirect_neigh(hc: Hc) -> None:
    """Backend 7 is on lb0's link without a neighbour entry: bpf_redirect_neigh() resolves
    it; the frame keeps the device's MACs (the neighbour layer writes them later)."""
    pkt = inner(VIP4, fx.TCP_)
    be = dataclasses.replace(BE[7], mac=IFB_MAC)
    before = hc.counters()
    res = hc.run(on_ifb(pkt), MARK(7))
    assert res.retval == TC_ACT_REDIRECT
    assert _moved(hc, before) == {"redirect_neigh": 1}
    want = expected(pkt, be, abi.Encap.GUE, IFB_MAC)
    assert res.data == want, _diff(res.data, want)


def _frag(pkt: Packet) -> Packet:
    pkt = pkt.copy()
    pkt.flags = "MF"
    return pkt


DROPS = [
    ("unknown mark", on_ifb(inner(VIP4, fx.TCP_)), MARK(0xFFFF), Ev.DROP_UNKNOWN_MARK),
    ("no mark at all", on_ifb(inner(VIP4, fx.TCP_)), 0, Ev.DROP_UNKNOWN_MARK),
    ("ICMP", on_ifb(IP(src=str(fx.LB_SRC4), dst=str(VIP4)) / ICMP()), MARK(1), Ev.DROP_UNSUPPORTED),
    ("IPv4 fragment", on_ifb(_frag(inner(VIP4, fx.UDP_))), MARK(1), Ev.DROP_UNSUPPORTED),
    ("ARP", bytes(Ether(src=IFB_MAC) / ARP(pdst=str(VIP4))), MARK(1), Ev.DROP_UNSUPPORTED),
    ("truncated TCP", on_ifb(inner(VIP4, fx.TCP_))[: 14 + 20 + 2], MARK(1), Ev.DROP_UNSUPPORTED),
    ("backend is the LB itself", on_ifb(inner(VIP4, fx.TCP_)), MARK(10), Ev.DROP_SELF),
    ("no route to the backend", on_ifb(inner(VIP4, fx.TCP_)), MARK(9), Ev.DROP_FIB),
    (
        "longer than lb0's MTU once encapsulated",
        on_ifb(inner(VIP4, fx.UDP_, payload=b"x" * (1500 - 28))),
        MARK(1),
        Ev.DROP_TOO_BIG,
    ),
]


@pytest.mark.parametrize(
    ("frame", "mark", "reason"), [c[1:] for c in DROPS], ids=[c[0] for c in DROPS]
)
def test_drops(hc: Hc, frame: bytes, mark: int, reason: abi.HcEvent) -> None:
    before = hc.counters()
    res = hc.run(frame, mark)
    assert res.retval == TC_ACT_SHOT
    assert _moved(hc, before) == {reason.name.lower(): 1}


def test_no_outer_source_for_the_backends_family(hc: Hc) -> None:
    """hc_config without an IPv6 source: a check to an IPv6 backend is dropped NO_CONFIG."""
    cfg_map = hc.tunnel.maps["hc_config"]
    key = (0).to_bytes(4, "little")
    saved = cfg_map.lookup(key)
    assert saved is not None
    cfg = abi.Config.from_buffer_copy(saved)
    cfg.src6[:] = (0, 0, 0, 0)
    cfg_map.update(key, cfg.pack())
    try:
        before = hc.counters()
        res = hc.run(on_ifb(inner(VIP6, fx.TCP_)), MARK(4))
    finally:
        cfg_map.update(key, saved)
    assert res.retval == TC_ACT_SHOT
    assert _moved(hc, before) == {"drop_no_config": 1}
