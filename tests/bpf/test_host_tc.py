"""host_tc on fixture packets through BPF_PROG_TEST_RUN (docs/datapath.md, "host_tc").

Each case: a description, the input frame, the expected verdict, the expected output
frame (None: the input, untouched) and the events it must count, each exactly once.

The daisy-chaining cases (``test_chain_*``) run inside a network namespace of their own
that this thread enters (``chain_ns``): real TCP sockets own or do not own the inner
4-tuples, and bpf_fib_lookup() sees a veth with permanent neighbours for the next hops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import itertools
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Packet

from xdplb.core import abi
from xdplb.core.addresses import IPAddress
from xdplb.datapath import Program
from xdplb.datapath.host import HostDatapath
from xdplb.datapath.testrun import TestRunResult, skb_ctx
from xdplb.lab import netns
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
    events: tuple[abi.HostEvent, ...]
    #: Expected output frame; None means the input comes out untouched.
    out: bytes | None = None


def decap(desc: str, outer: Packet, inner: Packet, *events: abi.HostEvent) -> Case:
    return Case(desc, ether(outer), TC_ACT_OK, events, ether(inner))


def passes(desc: str, frame: bytes | Packet) -> Case:
    data = frame if isinstance(frame, bytes) else ether(frame)
    return Case(desc, data, TC_ACT_OK, (abi.HostEvent.PASS,))


def dropped(desc: str, outer: Packet) -> Case:
    return Case(desc, ether(outer), TC_ACT_SHOT, (abi.HostEvent.DROP_MALFORMED,))


GUE, IPIP = abi.HostEvent.DECAP_GUE, abi.HostEvent.DECAP_IPIP
NOT_TCP, SYN = abi.HostEvent.ACCEPT_NOT_TCP, abi.HostEvent.ACCEPT_SYN
INNER4_SYN = IP(src="198.18.0.1", dst="198.18.100.1") / TCP(sport=40001, dport=80, flags="S")
V4_OUT = IP(src=str(LB4), dst=str(HOST4))
V6_OUT = IPv6(src=str(LB6), dst=str(HOST6))

CASES = [
    decap("GUE, IPv4 in IPv4", gue_encap(INNER4, LB4, HOST4), INNER4, GUE, NOT_TCP),
    decap("GUE, IPv6 in IPv6", gue_encap(INNER6, LB6, HOST6), INNER6, GUE, SYN),
    decap("GUE, IPv4 in IPv6 (family change)", gue_encap(INNER4, LB6, HOST6), INNER4, GUE, NOT_TCP),
    decap("GUE, IPv6 in IPv4 (family change)", gue_encap(INNER6, LB4, HOST4), INNER6, GUE, SYN),
    decap(
        "GUE, two IPv6 hops, SYN: the first hop takes it",
        gue_encap(INNER6, LB6, HOST6, hops=[HOST6, OTHER6]),
        INNER6,
        GUE,
        SYN,
    ),
    decap(
        "GUE, two IPv4 hops, SYN: the first hop takes it",
        gue_encap(INNER4_SYN, LB4, HOST4, hops=[HOST4, OTHER4]),
        INNER4_SYN,
        GUE,
        SYN,
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
    dp = HostDatapath(f"test-host-tc-{os.getpid()}")
    try:
        dp.configure([HOST4, HOST6])
        yield dp.obj
    finally:
        dp.close()
        shutil.rmtree(dp.pin_root, ignore_errors=True)


def _events(obj: object) -> dict[abi.HostEvent, int]:
    m = obj.map("host_events")  # type: ignore[attr-defined]
    return {
        ev: sum(int.from_bytes(v[:8], "little") for v in m.lookup_percpu(ev.to_bytes(4, "little")))
        for ev in abi.HostEvent
    }


def _assert_moved(
    before: dict[abi.HostEvent, int], after: dict[abi.HostEvent, int], *events: abi.HostEvent
) -> None:
    """Each of ``events`` moved by exactly one, every other event not at all."""
    delta = {ev: after[ev] - before[ev] for ev in abi.HostEvent}
    want = {ev: int(ev in events) for ev in abi.HostEvent}
    assert {ev.name: n for ev, n in delta.items() if n} == {
        ev.name: n for ev, n in want.items() if n
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
    _assert_moved(before, after, *case.events)
    if case.retval == TC_ACT_OK:
        want = case.frame if case.out is None else case.out
        assert res.data == want, _diff(res.data, want)


#: A sender's segment size, and the segments of the GSO packets below.
MSS, SEGS = 1000, 3  # a test run takes at most a page


def _gso_run(
    host_obj: object, outer: Packet, ifindex: int = 0
) -> tuple[int, dict[abi.HostEvent, int]]:
    prog = host_obj.program("host_tc")  # type: ignore[attr-defined]
    before = _events(host_obj)
    ctx = skb_ctx(ifindex=ifindex, gso_size=MSS, gso_segs=SEGS)
    res = prog.test_run(ether(outer), ctx=ctx)
    after = _events(host_obj)
    return res.retval, {
        ev: after[ev] - before[ev] for ev in abi.HostEvent if after[ev] > before[ev]
    }


@pytest.mark.parametrize(
    "outer",
    [
        ipip_encap(
            IP(src="198.18.0.1", dst="198.18.100.1") / TCP(flags="A") / bytes(MSS * SEGS),
            LB4,
            HOST4,
        ),
        gue_encap(INNER6 / bytes(MSS * SEGS), LB4, HOST4),
    ],
    ids=["ipip", "gue-6in4"],
)
def test_gso_packet_holding_one_inner_packet_goes_to_decap(host_obj: object, outer: Packet) -> None:
    """A GSO packet whose inner IP length spans it (lb_tc's, or IPIP merged by GRO) is
    parsed and decapsulated. A test run's GSO skb has no GSO type, and the kernel
    refuses to shrink an untyped GSO packet (bpf_skb_net_shrink: only TCP, or UDP with
    FIXED_GSO): here that is DROP_DECAP, past the parser; real merged packets are
    decapsulated in tests/e2e/test_offloads.py."""
    retval, moved = _gso_run(host_obj, outer)
    assert abi.HostEvent.DROP_MALFORMED not in moved, moved
    assert moved.get(abi.HostEvent.DROP_DECAP) == 1, moved
    assert retval == TC_ACT_SHOT


#: lo's ifindex in every namespace, and a test run's device when its context names none.
LOOPBACK = 1


@pytest.mark.parametrize("family", [4, 6])
def test_gue_gso_packet_of_udp_datagrams_goes_to_lo_to_be_segmented(
    host_obj: object, chain_ns: ChainNs, family: int
) -> None:
    """Decapsulated whole, a GUE packet of UDP GSO would keep its UDP-tunnel GSO state and
    a socket without UDP_GRO would lose it: host_tc redirects it, still encapsulated, to
    lo's egress (the kernel segments it there) and decapsulates the datagrams on lo's
    ingress, where the same packet is not redirected again. IPIP is decapsulated whole
    (the kernel segments IPIP's leftovers correctly); so is UDP that is not GSO."""
    lb, host = (LB4, HOST4) if family == 4 else (LB6, HOST6)
    inner = (
        INNER4 / bytes(MSS * SEGS)
        if family == 4
        else (
            IPv6(src="fd78:6470:6c62::1", dst="fd78:6470:6c62:100::1")
            / UDP(sport=1, dport=53)
            / bytes(MSS * SEGS)
        )
    )
    gue = gue_encap(inner, lb, host)
    retval, moved = _gso_run(host_obj, gue, ifindex=chain_ns.ifindex)
    assert (retval, moved) == (TC_ACT_REDIRECT, {NOT_TCP: 1})
    # On lo: decapsulated (a test run's GSO skb is untyped, which the kernel refuses to
    # shrink: DROP_DECAP; what lo really receives are single datagrams, not GSO).
    retval, moved = _gso_run(host_obj, gue, ifindex=LOOPBACK)
    assert (retval, moved) == (TC_ACT_SHOT, {NOT_TCP: 1, abi.HostEvent.DROP_DECAP: 1})
    retval, moved = _gso_run(host_obj, ipip_encap(inner, lb, host), ifindex=chain_ns.ifindex)
    assert (retval, moved) == (TC_ACT_SHOT, {abi.HostEvent.DROP_DECAP: 1})
    res = host_obj.program("host_tc").test_run(ether(gue_encap(INNER4, lb, host)))  # type: ignore[attr-defined]
    assert res.retval == TC_ACT_OK


@pytest.mark.parametrize("family", [4, 6])
def test_gso_train_of_gue_datagrams_is_refused(host_obj: object, family: int) -> None:
    """UDP GRO (rx-udp-gro-forwarding, rx-gro-list) would merge GUE datagrams into one
    GSO packet whose outer UDP spans them all while the first inner IP header spans one
    datagram. Decapsulated as one packet, the stack would keep the first datagram and
    trim the rest: host_tc refuses it as malformed instead."""
    lb, host = (LB4, HOST4) if family == 4 else (LB6, HOST6)
    one = bytes(gue_encap(INNER4 / bytes(MSS - 40), lb, host))
    udp_off = 20 if family == 4 else 40
    datagram = one[udp_off + 8 :]  # GUE + inner packet
    outer_ip = IP(src=str(lb), dst=str(host)) if family == 4 else IPv6(src=str(lb), dst=str(host))
    train = outer_ip / UDP(sport=0x8001, dport=abi.GUE_PORT, chksum=0) / (datagram * SEGS)
    retval, moved = _gso_run(host_obj, train)
    assert retval == TC_ACT_SHOT
    assert moved == {abi.HostEvent.DROP_MALFORMED: 1}, moved


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


# --- Daisy chaining (docs/datapath.md, "host_tc", second chance) -----------------------

#: Another address of the backend network with no neighbour entry (FIB: no neighbour).
UNRESOLVED4 = ipaddress.ip_address("198.18.0.13")
#: An address with no route at all in the test namespace (FIB: unreachable).
UNROUTED4 = ipaddress.ip_address("198.19.0.99")
HOST_MAC = "02:00:00:00:00:11"
OTHER_MAC = "02:00:00:00:00:12"
CLIENT = {4: ipaddress.ip_address("198.18.0.1"), 6: ipaddress.ip_address("fd78:6470:6c62::1")}
VIP = {4: ipaddress.ip_address("198.18.100.1"), 6: ipaddress.ip_address("fd78:6470:6c62:100::1")}
HOST = {4: HOST4, 6: HOST6}
OTHER = {4: OTHER4, 6: OTHER6}
LB = {4: LB4, 6: LB6}
#: A port with no socket in the namespace.
NOBODY_PORT = 9

#: Offsets in struct __sk_buff (UAPI, stable) of the two fields a TC test_run may set
#: to choose the device: skb->dev is ``ifindex``, skb->skb_iif ``ingress_ifindex``.
SKB_INGRESS_IFINDEX, SKB_IFINDEX, SKB_CTX_LEN = 36, 40, 44
TC_ACT_REDIRECT = 7

_serial = itertools.count()


@dataclasses.dataclass(frozen=True)
class ChainNs:
    name: str
    ifindex: int


@pytest.fixture(scope="module")
def chain_ns() -> Iterator[ChainNs]:
    """A namespace ``xdplbt-<pid>-chain<n>`` that this thread enters for the module:

    veth h0 (MAC HOST_MAC, HOST4/24, HOST6/64, forwarding on) and its peer h0p, up; permanent
    neighbours OTHER4 and OTHER6 → OTHER_MAC on h0; the VIPs and the client addresses on
    lo; tcp_syncookies = 2 (every SYN is answered with a cookie).
    """
    name = f"xdplbt-{os.getpid()}-chain{next(_serial)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        with netns.enter(name):
            yield ChainNs(name, _configure_chain_ns())
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _configure_chain_ns() -> int:
    """Runs inside the namespace: sockets and /proc/sys/net below are its own."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.rtnl.ifaddrmsg import IFA_F_NODAD
    from pyroute2.netlink.rtnl.ndmsg import states

    Path("/proc/sys/net/ipv4/tcp_syncookies").write_text("2\n")
    with IPRoute() as ipr:
        (lo,) = ipr.link_lookup(ifname="lo")
        ipr.link("set", index=lo, state="up")
        ipr.link("add", ifname="h0", kind="veth", peer="h0p")
        (h0,) = ipr.link_lookup(ifname="h0")
        # bpf_fib_lookup() answers FWD_DISABLED on a device without forwarding.
        for proto in ("ipv4", "ipv6"):
            Path(f"/proc/sys/net/{proto}/conf/h0/forwarding").write_text("1\n")
        (h0p,) = ipr.link_lookup(ifname="h0p")
        ipr.link("set", index=h0, address=HOST_MAC)
        for idx in (h0p, h0):
            ipr.link("set", index=idx, state="up")
        ipr.addr("add", index=h0, address=str(HOST4), prefixlen=24)
        ipr.addr("add", index=h0, address=str(HOST6), prefixlen=64, flags=IFA_F_NODAD)
        for fam in (4, 6):
            plen = 32 if fam == 4 else 128
            for addr in (VIP[fam], CLIENT[fam]):
                ipr.addr("add", index=lo, address=str(addr), prefixlen=plen, flags=IFA_F_NODAD)
            ipr.neigh(
                "add",
                dst=str(OTHER[fam]),
                lladdr=OTHER_MAC,
                ifindex=h0,
                state=states["permanent"],
            )
    return int(h0)


def tc_run(prog: Program, frame: bytes, ifindex: int) -> TestRunResult:
    """BPF_PROG_TEST_RUN of a TC program as if ``frame`` arrived on ``ifindex`` of this
    thread's namespace (xdplb.datapath.test_run only passes an ifindex to XDP)."""
    from xdplb.datapath._ffi import check, ffi, lib, new_opts

    size_out = len(frame) + 256
    data_out = ffi.new("char[]", size_out)
    ctx = ffi.new("char[]", SKB_CTX_LEN)
    struct.pack_into("<II", ffi.buffer(ctx), SKB_INGRESS_IFINDEX, ifindex, ifindex)
    opts = new_opts(
        "bpf_test_run_opts",
        data_in=ffi.from_buffer(frame),
        data_size_in=len(frame),
        data_out=data_out,
        data_size_out=size_out,
        ctx_in=ctx,
        ctx_size_in=SKB_CTX_LEN,
        repeat=1,
    )
    check(lib.bpf_prog_test_run_opts(prog.fd, opts), "bpf_prog_test_run_opts(host_tc)")
    return TestRunResult(opts.retval, ffi.buffer(data_out, opts.data_size_out)[:], opts.duration)


def _ip(fam: int) -> type[Packet]:
    return IP if fam == 4 else IPv6


def _inner_tcp(
    fam: int, sport: int, dport: int, flags: str, seq: int = 1000, ack: int = 2000
) -> Packet:
    ip = _ip(fam)(src=str(CLIENT[fam]), dst=str(VIP[fam]))
    return ip / TCP(sport=sport, dport=dport, flags=flags, seq=seq, ack=ack) / b"data"


def _chain(
    obj: object, ns: ChainNs, frame: bytes, retval: int, want: bytes, *events: abi.HostEvent
) -> None:
    prog = obj.program("host_tc")  # type: ignore[attr-defined]
    before = _events(obj)
    res = tc_run(prog, frame, ns.ifindex)
    after = _events(obj)
    _assert_moved(before, after, *events)
    assert res.retval == retval
    assert res.data == want, _diff(res.data, want)


def _accepted(
    obj: object,
    ns: ChainNs,
    inner: Packet,
    event: abi.HostEvent,
    hops: list[IPAddress],
    next_hop: int = 0,
) -> None:
    """GUE from the LB to hops[next_hop] (this host) is decapsulated here, ``event``."""
    outer = gue_encap(inner, LB[hops[0].version], hops[next_hop], hops=hops, next_hop=next_hop)
    _chain(obj, ns, ether(outer), TC_ACT_OK, ether(inner), GUE, event)


@pytest.fixture(params=[4, 6], ids=["v4", "v6"])
def conn(chain_ns: ChainNs, request: pytest.FixtureRequest) -> Iterator[tuple[int, int, int]]:
    """A real established TCP connection CLIENT → VIP in the namespace, per family;
    yields (family, client port, VIP port)."""
    fam = request.param
    af = socket.AF_INET if fam == 4 else socket.AF_INET6
    with contextlib.ExitStack() as stack:
        lsn = stack.enter_context(socket.socket(af, socket.SOCK_STREAM))
        lsn.bind((str(VIP[fam]), 0))
        lsn.listen()
        cli = stack.enter_context(socket.socket(af, socket.SOCK_STREAM))
        cli.bind((str(CLIENT[fam]), 0))
        cli.connect(lsn.getsockname()[:2])
        srv, _ = lsn.accept()
        stack.enter_context(srv)
        yield fam, cli.getsockname()[1], lsn.getsockname()[1]


def test_chain_owned_connection_accepted(
    host_obj: object, chain_ns: ChainNs, conn: tuple[int, int, int]
) -> None:
    """A non-SYN of an established local connection stays here, even with a second hop."""
    fam, cport, vport = conn
    inner = _inner_tcp(fam, cport, vport, "PA")
    _accepted(host_obj, chain_ns, inner, abi.HostEvent.ACCEPT_OWNED, [HOST[fam], OTHER[fam]])


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
@pytest.mark.parametrize("flags", ["A", "PA", "FA", "R"])
def test_chain_forward_unowned(host_obj: object, chain_ns: ChainNs, fam: int, flags: str) -> None:
    """Non-SYN, no local socket, a second hop: the same frame leaves for the second hop,
    outer source = this host, destination = hop 1, next hop index 1, IPv4 checksum
    right (scapy computes the expected one), MACs from h0 and the permanent neighbour."""
    inner = _inner_tcp(fam, 40002, NOBODY_PORT, flags)
    hops = [HOST[fam], OTHER[fam]]
    frame = ether(gue_encap(inner, LB[fam], HOST[fam], hops=hops))
    want = ether(
        gue_encap(inner, HOST[fam], OTHER[fam], hops=hops, next_hop=1),
        src=HOST_MAC,
        dst=OTHER_MAC,
    )
    _chain(host_obj, chain_ns, frame, TC_ACT_REDIRECT, want, abi.HostEvent.FORWARD)


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
def test_chain_forward_ack_to_listener_without_cookie(
    host_obj: object, chain_ns: ChainNs, fam: int
) -> None:
    """A listener on the port does not own an ACK that is not its SYN cookie."""
    af = socket.AF_INET if fam == 4 else socket.AF_INET6
    with socket.socket(af, socket.SOCK_STREAM) as lsn:
        lsn.bind((str(VIP[fam]), 0))
        lsn.listen()
        port = lsn.getsockname()[1]
        inner = _inner_tcp(fam, 40003, port, "A", seq=1, ack=12345)
        hops = [HOST[fam], OTHER[fam]]
        frame = ether(gue_encap(inner, LB[fam], HOST[fam], hops=hops))
        want = ether(
            gue_encap(inner, HOST[fam], OTHER[fam], hops=hops, next_hop=1),
            src=HOST_MAC,
            dst=OTHER_MAC,
        )
        _chain(host_obj, chain_ns, frame, TC_ACT_REDIRECT, want, abi.HostEvent.FORWARD)


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
def test_chain_last_resort(host_obj: object, chain_ns: ChainNs, fam: int) -> None:
    """No socket and no hop left: decapsulated here (the stack answers with a reset)."""
    inner = _inner_tcp(fam, 40004, NOBODY_PORT, "A")
    last = abi.HostEvent.ACCEPT_LAST_RESORT
    _accepted(host_obj, chain_ns, inner, last, [HOST[fam]])
    # Arrived as the second hop of two: nothing after it either.
    _accepted(host_obj, chain_ns, inner, last, [OTHER[fam], HOST[fam]], next_hop=1)


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
def test_chain_loop_guard(host_obj: object, chain_ns: ChainNs, fam: int) -> None:
    """The next hop is one of this host's addresses: never forward to ourselves."""
    inner = _inner_tcp(fam, 40005, NOBODY_PORT, "A")
    _accepted(host_obj, chain_ns, inner, abi.HostEvent.ACCEPT_LOOP, [HOST[fam], HOST[fam]])


def test_chain_forward_failed(host_obj: object, chain_ns: ChainNs) -> None:
    """No route to the next hop: taken here, counted apart, untouched."""
    inner = _inner_tcp(4, 40006, NOBODY_PORT, "A")
    _accepted(host_obj, chain_ns, inner, abi.HostEvent.FORWARD_FAILED, [HOST4, UNROUTED4])


def test_chain_forward_without_neighbour(host_obj: object, chain_ns: ChainNs) -> None:
    """The next hop is on link but not resolved yet: the outer header is rewritten and
    bpf_redirect_neigh() leaves the MACs to the kernel's neighbour resolution (the
    frame keeps the ones it came with) rather than resetting someone else's connection."""
    inner = _inner_tcp(4, 40008, NOBODY_PORT, "A")
    hops = [HOST4, UNRESOLVED4]
    frame = ether(gue_encap(inner, LB[4], HOST4, hops=hops))
    want = ether(gue_encap(inner, HOST4, UNRESOLVED4, hops=hops, next_hop=1))
    _chain(host_obj, chain_ns, frame, TC_ACT_REDIRECT, want, abi.HostEvent.FORWARD)


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
def test_chain_udp_never_chained(host_obj: object, chain_ns: ChainNs, fam: int) -> None:
    """UDP has no connection to look up: whichever hop it reaches takes it."""
    inner = _ip(fam)(src=str(CLIENT[fam]), dst=str(VIP[fam])) / UDP(sport=1, dport=53) / b"q"
    not_tcp = abi.HostEvent.ACCEPT_NOT_TCP
    _accepted(host_obj, chain_ns, inner, not_tcp, [HOST[fam], OTHER[fam]])
    _accepted(host_obj, chain_ns, inner, not_tcp, [OTHER[fam], HOST[fam]], next_hop=1)


def test_chain_syn_accepted_in_ns(host_obj: object, chain_ns: ChainNs) -> None:
    """A SYN stays with the first hop even where nothing listens on its port."""
    inner = _inner_tcp(4, 40007, NOBODY_PORT, "S")
    _accepted(host_obj, chain_ns, inner, abi.HostEvent.ACCEPT_SYN, [HOST4, OTHER4])


def _syn_cookie(fam: int, sport: int, dport: int, isn: int) -> int:
    """The kernel's SYN cookie for CLIENT:sport → VIP:dport: send a bare SYN (no
    options) from a raw socket to the listener (tcp_syncookies = 2 answers every SYN
    with a cookie) and read the SYN-ACK's sequence number. The SYN-ACK reaches no
    socket, so the kernel resets it; the listener kept no state to reset."""
    syn = _ip(fam)(src=str(CLIENT[fam]), dst=str(VIP[fam])) / TCP(
        sport=sport, dport=dport, flags="S", seq=isn, window=65535
    )
    tcp = bytes(syn[TCP])  # checksum computed over the right pseudo-header
    af = socket.AF_INET if fam == 4 else socket.AF_INET6
    with socket.socket(af, socket.SOCK_RAW, socket.IPPROTO_TCP) as raw:
        raw.settimeout(2.0)
        raw.bind((str(CLIENT[fam]), 0))
        raw.sendto(tcp, (str(VIP[fam]), 0))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            data = raw.recv(4096)
            # IPv4 raw sockets deliver the IP header, IPv6 ones do not.
            seg = TCP(IP(data).payload.original if fam == 4 else data)
            if seg.sport == dport and seg.dport == sport and seg.flags == "SA":
                assert seg.ack == isn + 1
                return int(seg.seq)
    pytest.fail("no SYN-ACK from the listener")


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
def test_chain_syncookie_ack_accepted(host_obj: object, chain_ns: ChainNs, fam: int) -> None:
    """The ACK that completes a cookie handshake belongs to the listener that sent the
    cookie (no socket exists yet): accepted here. The same ACK with a broken cookie is
    not the listener's: forwarded to the second hop."""
    af = socket.AF_INET if fam == 4 else socket.AF_INET6
    hops = [HOST[fam], OTHER[fam]]
    with socket.socket(af, socket.SOCK_STREAM) as lsn:
        lsn.bind((str(VIP[fam]), 0))
        lsn.listen()
        port = lsn.getsockname()[1]
        isn = 0x1234567
        cookie = _syn_cookie(fam, 40008, port, isn)
        ack = _inner_tcp(fam, 40008, port, "A", seq=isn + 1, ack=(cookie + 1) & 0xFFFFFFFF)
        _accepted(host_obj, chain_ns, ack, abi.HostEvent.ACCEPT_SYNCOOKIE, hops)

        # The cookie's low 24 bits decode to an MSS index 0..3: +0x1000 is out of range
        # (a cookie off by one or two is still valid, with another MSS).
        bad_ack = (cookie + 1 + 0x1000) & 0xFFFFFFFF
        bad = _inner_tcp(fam, 40008, port, "A", seq=isn + 1, ack=bad_ack)
        frame = ether(gue_encap(bad, LB[fam], HOST[fam], hops=hops))
        want = ether(
            gue_encap(bad, HOST[fam], OTHER[fam], hops=hops, next_hop=1),
            src=HOST_MAC,
            dst=OTHER_MAC,
        )
        _chain(host_obj, chain_ns, frame, TC_ACT_REDIRECT, want, abi.HostEvent.FORWARD)


def test_chain_ipip_never_chained(host_obj: object, chain_ns: ChainNs) -> None:
    """IPIP has no hop list: a non-SYN nobody owns is still decapsulated here, and
    none of the chaining events moves."""
    inner = _inner_tcp(4, 40009, NOBODY_PORT, "A")
    frame = ether(ipip_encap(inner, LB4, HOST4))
    _chain(host_obj, chain_ns, frame, TC_ACT_OK, ether(inner), IPIP)


# --- Longer hop lists: a Beamer bucket carries up to abi.MAX_HOPS hops ------------------

#: Hops that are neither this host nor routed to in these tests (only listed).
FAR = {
    4: [ipaddress.ip_address("198.18.0.21"), ipaddress.ip_address("198.18.0.22")],
    6: [ipaddress.ip_address("fd78:6470:6c62::21"), ipaddress.ip_address("fd78:6470:6c62::22")],
}


def _hop_lists(fam: int) -> list[tuple[list[IPAddress], int]]:
    """(hop list, index of this host): this host at hop 1 of 3, hop 1 of 4, hop 2 of 4,
    OTHER right after it."""
    a, b = FAR[fam]
    h, o = HOST[fam], OTHER[fam]
    return [([a, h, o], 1), ([a, h, o, b], 1), ([a, b, h, o], 2)]


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["hop1-of-3", "hop1-of-4", "hop2-of-4"])
def test_chain_forwards_again_along_a_longer_list(
    host_obj: object, chain_ns: ChainNs, fam: int, case: int
) -> None:
    """A packet forwarded to this host (not hop 0) that it does not own goes on to the
    next hop: outer source = this host, next hop index + 1, the rest of the list as is."""
    assert abi.MAX_HOPS == 4
    hops, me = _hop_lists(fam)[case]
    inner = _inner_tcp(fam, 40010 + case, NOBODY_PORT, "A")
    frame = ether(gue_encap(inner, hops[me - 1], HOST[fam], hops=hops, next_hop=me))
    want = ether(
        gue_encap(inner, HOST[fam], OTHER[fam], hops=hops, next_hop=me + 1),
        src=HOST_MAC,
        dst=OTHER_MAC,
    )
    _chain(host_obj, chain_ns, frame, TC_ACT_REDIRECT, want, abi.HostEvent.FORWARD)


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
@pytest.mark.parametrize("n", [3, 4])
def test_chain_last_resort_at_the_last_of_more_hops(
    host_obj: object, chain_ns: ChainNs, fam: int, n: int
) -> None:
    """This host is the last of 3 or 4 hops and nobody here owns the tuple: taken here."""
    hops = [*[*FAR[fam], OTHER[fam]][: n - 1], HOST[fam]]
    inner = _inner_tcp(fam, 40020 + n, NOBODY_PORT, "A")
    _accepted(host_obj, chain_ns, inner, abi.HostEvent.ACCEPT_LAST_RESORT, hops, next_hop=n - 1)


def test_chain_owned_at_a_later_hop(
    host_obj: object, chain_ns: ChainNs, conn: tuple[int, int, int]
) -> None:
    """The connection's owner is hop 2 of 4: it keeps the packet, hop 3 never sees it."""
    fam, cport, vport = conn
    hops = [*FAR[fam], HOST[fam], OTHER[fam]]
    inner = _inner_tcp(fam, cport, vport, "PA")
    _accepted(host_obj, chain_ns, inner, abi.HostEvent.ACCEPT_OWNED, hops, next_hop=2)


@pytest.mark.parametrize("fam", [4, 6], ids=["v4", "v6"])
def test_chain_loop_guard_in_a_longer_list(host_obj: object, chain_ns: ChainNs, fam: int) -> None:
    """Hop 2 of 4 is this host again (the list would bring the packet back): taken here."""
    hops = [FAR[fam][0], HOST[fam], HOST[fam], OTHER[fam]]
    inner = _inner_tcp(fam, 40030, NOBODY_PORT, "A")
    _accepted(host_obj, chain_ns, inner, abi.HostEvent.ACCEPT_LOOP, hops, next_hop=1)
