"""host_tc on fixture packets through BPF_PROG_TEST_RUN (docs/datapath.md, "host_tc").

Each case: a description, the input frame, the expected verdict, the expected output
frame (None: the input, untouched) and the event it must count.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import shutil
import struct
from collections.abc import Iterator

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Packet

from xdplb import abi, paths
from xdplb.lab.host import configure_host
from xdplb.lab.packets import IPPROTO_IPIP, ether, gue_encap, gue_header, ipip_encap

pytestmark = pytest.mark.bpf

TC_ACT_OK = 0
TC_ACT_SHOT = 2

HOST4 = ipaddress.ip_address("198.18.0.11")
HOST6 = ipaddress.ip_address("fd78:6470:6c62::11")
OTHER4 = ipaddress.ip_address("198.18.0.12")
OTHER6 = ipaddress.ip_address("fd78:6470:6c62::12")
LB4 = ipaddress.ip_address("198.18.0.2")
LB6 = ipaddress.ip_address("fd78:6470:6c62::2")

INNER4 = IP(src="198.18.0.1", dst="198.18.100.1", ttl=61) / UDP(sport=40000, dport=7777) / b"v4"
INNER6 = (
    IPv6(src="fd78:6470:6c62::1", dst="fd78:6470:6c62:100::1", hlim=61)
    / TCP(sport=40000, dport=80, flags="S")
    / b"v6"
)


def raw_gue(outer: Packet, gue: bytes) -> Packet:
    """Outer IP + UDP to the GUE port + arbitrary GUE bytes (for malformed cases)."""
    return outer / UDP(sport=0x8001, dport=abi.GUE_PORT, chksum=0) / gue


@dataclasses.dataclass(frozen=True)
class Case:
    desc: str
    frame: bytes
    retval: int
    event: abi.HostEvent
    #: Expected output frame; None means the input comes out untouched.
    out: bytes | None = None


def decap(desc: str, outer: Packet, inner: Packet, event: abi.HostEvent) -> Case:
    return Case(desc, ether(outer), TC_ACT_OK, event, ether(inner))


def passes(desc: str, frame: bytes | Packet) -> Case:
    data = frame if isinstance(frame, bytes) else ether(frame)
    return Case(desc, data, TC_ACT_OK, abi.HostEvent.PASS)


def dropped(desc: str, outer: Packet) -> Case:
    return Case(desc, ether(outer), TC_ACT_SHOT, abi.HostEvent.DROP_MALFORMED)


GUE, IPIP = abi.HostEvent.DECAP_GUE, abi.HostEvent.DECAP_IPIP
V4_OUT = IP(src=str(LB4), dst=str(HOST4))
V6_OUT = IPv6(src=str(LB6), dst=str(HOST6))

CASES = [
    decap("GUE, IPv4 in IPv4", gue_encap(INNER4, LB4, HOST4), INNER4, GUE),
    decap("GUE, IPv6 in IPv6", gue_encap(INNER6, LB6, HOST6), INNER6, GUE),
    decap("GUE, IPv4 in IPv6 (family change)", gue_encap(INNER4, LB6, HOST6), INNER4, GUE),
    decap("GUE, IPv6 in IPv4 (family change)", gue_encap(INNER6, LB4, HOST4), INNER6, GUE),
    decap(
        "GUE, two IPv6 hops (Beamer second hop)",
        gue_encap(INNER6, LB6, HOST6, hops=[HOST6, OTHER6]),
        INNER6,
        GUE,
    ),
    decap("IPIP", ipip_encap(INNER4, LB4, HOST4), INNER4, IPIP),
    decap("IP6IP6", ipip_encap(INNER6, LB6, HOST6), INNER6, IPIP),
    decap("4in6", ipip_encap(INNER4, LB6, HOST6), INNER4, IPIP),
    decap("6in4", ipip_encap(INNER6, LB4, HOST4), INNER6, IPIP),
    decap(
        "outer IPv4 options are skipped",
        IP(src=str(LB4), dst=str(HOST4), proto=4, options=[b"\x01\x01\x01\x00"]) / bytes(INNER4),
        INNER4,
        IPIP,
    ),
    passes("GUE for another host", gue_encap(INNER4, LB4, OTHER4)),
    passes("IPIP for another host", ipip_encap(INNER6, LB6, OTHER6)),
    passes("UDP to another port", V4_OUT / UDP(sport=1, dport=53) / b"dns"),
    passes("IPv6 UDP to another port", V6_OUT / UDP(sport=1, dport=19524) / (b"x" * 40)),
    passes("plain TCP to the host", V4_OUT / TCP(dport=22, flags="S")),
    passes(
        "IPv4 fragment of an IPIP packet",
        IP(src=str(LB4), dst=str(HOST4), proto=IPPROTO_IPIP, flags="MF") / bytes(INNER4),
    ),
    passes("ARP", bytes(Ether(dst="ff:ff:ff:ff:ff:ff") / ARP(pdst=str(HOST4)))),
    dropped("GUE truncated in its base header", raw_gue(V4_OUT, b"\x01\x04")),
    dropped("GUE truncated in its private data", raw_gue(V4_OUT, b"\x02\x04\x00\x00\x00\x00")),
    dropped("GUE hlen 0", raw_gue(V4_OUT, struct.pack("!BBH", 0, 4, 0) + bytes(INNER4))),
    dropped(
        "GUE hlen too short for its hop count",
        raw_gue(V4_OUT, struct.pack("!BBHHBB", 2, 4, 0, 0, 0, 3) + HOST4.packed + bytes(INNER4)),
    ),
    dropped(
        "GUE with IPv6 hops, hlen counted for IPv4 hops",
        raw_gue(V6_OUT, struct.pack("!BBHHBB", 2, 41, 0, 0, 0, 1) + HOST6.packed + bytes(INNER6)),
    ),
    dropped(
        "GUE version 1",
        raw_gue(V4_OUT, bytes([0x40 | 2]) + gue_header(4, [HOST4])[1:] + bytes(INNER4)),
    ),
    dropped(
        "GUE control message (C bit)",
        raw_gue(V4_OUT, bytes([0x20 | 2]) + gue_header(4, [HOST4])[1:] + bytes(INNER4)),
    ),
    dropped(
        "GUE inner protocol neither 4 nor 41",
        raw_gue(V4_OUT, gue_header(6, [HOST4]) + bytes(INNER4)),
    ),
    dropped(
        "GUE announces IPv4, carries IPv6", raw_gue(V4_OUT, gue_header(4, [HOST4]) + bytes(INNER6))
    ),
    dropped(
        "GUE inner header truncated", raw_gue(V6_OUT, gue_header(41, [HOST6]) + bytes(INNER6)[:30])
    ),
    dropped(
        "IPIP announces IPv4, carries IPv6",
        IP(src=str(LB4), dst=str(HOST4), proto=4) / bytes(INNER6),
    ),
    dropped(
        "IP6IP6 inner header truncated",
        IPv6(src=str(LB6), dst=str(HOST6), nh=41) / bytes(INNER6)[:39],
    ),
    dropped(
        "IPIP inner IHL < 5",
        IP(src=str(LB4), dst=str(HOST4), proto=4) / (b"\x44" + bytes(INNER4)[1:]),
    ),
]


@pytest.fixture(scope="module")
def host_obj() -> Iterator[object]:
    path = paths.bpf_object("host_tc")
    from xdplb.datapath import BpfObject

    root = paths.pin_root(f"test-host-tc-{os.getpid()}")
    obj = BpfObject.load(path, pin_root=root)
    try:
        configure_host(obj, [HOST4, HOST6])
        yield obj
    finally:
        obj.close()
        shutil.rmtree(root, ignore_errors=True)


def _events(obj: object) -> dict[abi.HostEvent, int]:
    m = obj.map("host_events")  # type: ignore[attr-defined]
    return {
        ev: sum(int.from_bytes(v[:8], "little") for v in m.lookup_percpu(ev.to_bytes(4, "little")))
        for ev in abi.HostEvent
    }


def _diff(got: bytes, want: bytes) -> str:
    """A readable packet diff for assertion messages."""
    lines = [
        f"got  {len(got)} bytes: {Ether(got).summary()}",
        f"want {len(want)} bytes: {Ether(want).summary()}",
    ]
    for off in range(0, max(len(got), len(want)), 16):
        g, w = got[off : off + 16].hex(" "), want[off : off + 16].hex(" ")
        if g != w:
            lines.append(f"{off:04x} got  {g}\n{off:04x} want {w}")
    return "\n".join(lines)


@pytest.mark.parametrize("case", CASES, ids=[c.desc for c in CASES])
def test_host_tc(host_obj: object, case: Case) -> None:
    prog = host_obj.program("host_tc")  # type: ignore[attr-defined]
    before = _events(host_obj)
    res = prog.test_run(case.frame)
    after = _events(host_obj)

    assert res.retval == case.retval, case.desc
    delta = {ev: after[ev] - before[ev] for ev in abi.HostEvent}
    assert delta == {ev: int(ev == case.event) for ev in abi.HostEvent}
    if case.retval == TC_ACT_OK:
        want = case.frame if case.out is None else case.out
        assert res.data == want, _diff(res.data, want)


def test_gue_port_zero_means_no_gue(host_obj: object) -> None:
    """With gue_port 0 in host_config, GUE packets are not ours: they pass untouched."""
    frame = ether(gue_encap(INNER4, LB4, HOST4))
    cfg = host_obj.map("host_config")  # type: ignore[attr-defined]
    zero = (0).to_bytes(4, "little")
    saved = cfg.lookup(zero)
    cfg.update(zero, abi.HostConfig(gue_port=0).pack())
    try:
        res = host_obj.program("host_tc").test_run(frame)  # type: ignore[attr-defined]
    finally:
        cfg.update(zero, saved)
    assert res.retval == TC_ACT_OK
    assert res.data == frame
