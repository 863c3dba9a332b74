"""The balancer on veth with the client's offloads at their defaults (checksum offload and
TSO on, as on every container): lb_xdp there breaks every connection, lb_tc carries them,
64 KB TSO packets included (docs/operations.md, "Which hook").

One daemon, its hook switched by a reload: ``xdp`` first, then ``auto`` (TC on veth).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from xdplb.core import abi
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import ExchangeError, http_post
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
#: Enough for the client's stack to send TSO packets of tens of KB.
BULK = 2 * 1024 * 1024


def csum_errors(lab: Lab, node: str) -> int:
    """TcpInCsumErrors of a namespace (/proc/net/snmp is per network namespace)."""
    snmp = lab.run(node, ["cat", "/proc/net/snmp"]).stdout
    head, values = (line.split() for line in re.findall(r"^Tcp: .*$", snmp, re.M)[:2])
    return int(values[head.index("InCsumErrors")])


def offloads_on(lab: Lab) -> bool:
    out = lab.run("client", ["ethtool", "-k", "eth0"]).stdout
    return "tx-checksumming: on" in out and "tcp-segmentation-offload: on" in out


def vip_bytes_per_packet(lb: LbNode) -> tuple[int, float]:
    with lb.maps() as maps:
        snap = maps.snapshot()
        vip_id = next(p.vip_id for v, p in snap.vips.items() if v.port == 80)
        st = maps.counters(snap=snap).vips[vip_id]
    return st.packets, st.bytes / max(st.packets, 1)


def test_lb_xdp_on_veth_breaks_offloaded_connections_and_lb_tc_carries_them(
    lab: Lab, tmp_path: Path
) -> None:
    assert offloads_on(lab)  # the lab runs the way users run
    servers = lab.start_servers()
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    vips = [{"address": VIP, "port": 80, "backends": backends}]
    lb = LbNode(lab, tmp_path, vips, interfaces=[{"name": "eth0", "hook": "xdp"}])
    try:
        lb.start()
        assert lb.link_pin.name == "xdp_eth0"
        # XDP on veth: the frame leaves its skb, the "checksum to be completed" state
        # is lost, and the backend gets a TCP checksum that is the pseudo-header sum.
        before = sum(csum_errors(lab, b) for b in lab.backends)
        with pytest.raises(ExchangeError):
            http_post(lab.ns("client"), VIP, 80, b"hello", timeout=2.0)
        wait_for(
            lambda: sum(csum_errors(lab, b) for b in lab.backends) - before,
            "the backends counting TCP checksum errors",
            until=lambda n: n > 0,
            timeout=5.0,
        )

        # The same daemon, hook auto: TC on veth. The XDP link goes, a tcx link comes.
        lb.reload(vips, interfaces=["eth0"])
        wait_for(
            lambda: lb.link_pin.name,
            "the reload moving eth0 to tc",
            until=lambda name: name == "tc_eth0",
            timeout=10.0,
            detail=lb.log_tail,
        )
        assert not (lb.link_pin.parent / "xdp_eth0").exists()
        assert lb.kernel_prog() is not None
        packets0, _ = vip_bytes_per_packet(lb)
        errors = sum(csum_errors(lab, b) for b in lab.backends)
        body = bytes(range(256)) * (BULK // 256)
        for _ in range(3):
            assert http_post(lab.ns("client"), VIP, 80, body, timeout=10.0) in lab.backends
        assert sum(csum_errors(lab, b) for b in lab.backends) == errors
        # The client's TSO packets went through whole: far fewer packets than an MTU
        # of 1500 would need, each one encapsulated once (GSO shrinks their segments).
        packets, per_packet = vip_bytes_per_packet(lb)
        assert packets - packets0 < 3 * BULK // 1500, (packets - packets0, per_packet)
        with lb.maps() as maps:
            counters = maps.counters()
        assert counters.drops[abi.DropReason.ENCAP] == 0
        assert counters.drops[abi.DropReason.TOO_BIG] == 0
    finally:
        lb.destroy()
        for p in servers:
            p.kill()


#: setsockopt(SOL_UDP, UDP_SEGMENT) (linux/udp.h): the socket's sends are UDP GSO.
SOL_UDP, UDP_SEGMENT = 17, 103
DATAGRAM = 1000


@pytest.mark.parametrize(("encap", "family"), [("gue", 4), ("gue", 6), ("ipip", 4), ("ipip", 6)])
def test_udp_gso_datagrams_each_reach_the_backend_through_lb_tc(
    lab: Lab, tmp_path: Path, encap: str, family: int
) -> None:
    """A sender's UDP GSO send (UDP_SEGMENT, as QUIC stacks use) crosses the veth as one
    skb of many datagrams; lb_tc encapsulates it whole without changing the datagrams'
    boundaries (FIXED_GSO), and the backend's echo, a plain socket without UDP_GRO,
    answers every one of them.

    GUE: decapsulated whole, the packet would keep its UDP-tunnel GSO state and the
    backend's kernel would lose every datagram when it segments it for the socket (no
    helper clears that state on 6.18). host_tc sends it out through lo instead, where
    the kernel segments it as the tunnel packet it is, and decapsulates each datagram
    on lo's ingress: one decapsulation a datagram. IPIP: decapsulated whole, the kernel
    segments it for the socket correctly."""
    vip = str(next(v for v in lab.vips if v.version == family))
    servers = lab.start_servers("--udp", "53")
    backends = [{"address": str(lab.addr(b, family))} for b in lab.backends]
    udp = [{"address": vip, "port": 53, "protocol": "udp", "encap": encap, "backends": backends}]
    lb = LbNode(lab, tmp_path, udp)
    try:
        lb.start()
        assert lb.link_pin.name == "tc_eth0"
        event = abi.HostEvent.DECAP_GUE if encap == "gue" else abi.HostEvent.DECAP_IPIP
        before = sum(lab.hosts[b].events()[event] for b in lab.backends)
        payloads = [bytes([i]) * DATAGRAM for i in range(8)]
        with lab.enter("client"):
            sock = socket.socket(
                socket.AF_INET6 if family == 6 else socket.AF_INET, socket.SOCK_DGRAM
            )
        with sock:
            sock.setsockopt(SOL_UDP, UDP_SEGMENT, DATAGRAM)
            sock.settimeout(2.0)
            sock.connect((vip, 53))
            got: set[bytes] = set()
            sends = 0
            while sends < 3 and len(got) < len(payloads):  # the first may wait for ARP/ND
                sock.send(b"".join(payloads))
                sends += 1
                try:
                    while len(got) < len(payloads):
                        name, _, echoed = sock.recv(4096).partition(b"\n")
                        assert name.decode() in lab.backends
                        got.add(echoed)
                except TimeoutError:
                    continue
        assert got == set(payloads)
        decaps = sum(lab.hosts[b].events()[event] for b in lab.backends) - before
        with lb.maps() as maps:
            counters = maps.counters()
        assert counters.drops[abi.DropReason.ENCAP] == 0
        # They crossed lb_tc together: fewer packets than datagrams, all of their bytes.
        (st,) = counters.vips.values()
        assert st.packets <= sends < len(payloads), st
        assert st.bytes >= len(payloads) * DATAGRAM, st
        # A send that waited for a neighbour may be lost before a backend: count whole ones.
        if encap == "gue":  # segmented on lo, each datagram decapsulated there
            assert decaps % len(payloads) == 0 and 1 <= decaps // len(payloads) <= sends, decaps
        else:  # decapsulated whole
            assert 1 <= decaps <= sends, (decaps, sends)
    finally:
        lb.destroy()
        for p in servers:
            p.kill()


def ethtool(lab: Lab, node: str, dev: str, *features: str) -> None:
    lab.run(node, ["ethtool", "-K", dev, *features])


@pytest.mark.parametrize("encap", ["ipip", "gue"])
def test_backends_receiving_through_gro_get_every_byte(
    lab: Lab, tmp_path: Path, encap: str
) -> None:
    """The backends' interfaces aggregate like a NIC's GRO: the client sends MTU-sized
    segments (its TSO off), lb_tc encapsulates each, and the backend's veth merges them
    before host_tc runs (GRO on, and TSO off on the switch port facing it: veth merges
    only what its peer could not have sent as one GSO packet).

    IPIP: the kernel merges tunnel packets (ipip_gro_receive), so host_tc decapsulates
    packets of many segments, each whole. GUE: with UDP GRO forwarding and fraglist GRO
    on as well, the kernel (6.18) merges none (no fou socket claims the port), and
    host_tc would refuse a train of datagrams rather than deliver it cut short
    (tests/bpf/test_host_tc.py); every byte arrives either way."""
    servers = lab.start_servers()
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    vips = [{"address": VIP, "port": 80, "encap": encap, "backends": backends}]
    gro = ["gro", "on"] + (
        ["rx-udp-gro-forwarding", "on", "rx-gro-list", "on"] if encap == "gue" else []
    )
    lb = LbNode(lab, tmp_path, vips)
    try:
        ethtool(lab, "client", "eth0", "tso", "off", "gso", "off")
        for b in lab.backends:
            ethtool(lab, "sw", b, "tso", "off")
            ethtool(lab, b, "eth0", *gro)
        lb.start()
        event = abi.HostEvent.DECAP_IPIP if encap == "ipip" else abi.HostEvent.DECAP_GUE
        before = {b: lab.hosts[b].events() for b in lab.backends}
        packets0, _ = vip_bytes_per_packet(lb)
        errors = sum(csum_errors(lab, b) for b in lab.backends)
        body = bytes(range(256)) * (BULK // 256)
        for _ in range(3):
            assert http_post(lab.ns("client"), VIP, 80, body, timeout=10.0) in lab.backends
        packets = vip_bytes_per_packet(lb)[0] - packets0
        delta = {
            ev: sum(lab.hosts[b].events()[ev] - before[b][ev] for b in lab.backends)
            for ev in abi.HostEvent
        }
        assert delta[abi.HostEvent.DROP_MALFORMED] == delta[abi.HostEvent.DROP_DECAP] == 0
        assert sum(csum_errors(lab, b) for b in lab.backends) == errors
        # The client sent MTU-sized segments: at least one per 1400 bytes went through lb_tc.
        assert packets >= 3 * BULK // 1400, packets
        if encap == "ipip":
            assert delta[event] < packets // 3, (delta[event], packets)  # merged
        else:
            assert delta[event] >= packets * 9 // 10, (delta[event], packets)  # not merged
    finally:
        lb.destroy()
        for p in servers:
            p.kill()
        ethtool(lab, "client", "eth0", "tso", "on", "gso", "on")
        for b in lab.backends:
            ethtool(lab, "sw", b, "tso", "on")
            ethtool(
                lab, b, "eth0", "gro", "off", "rx-udp-gro-forwarding", "off", "rx-gro-list", "off"
            )
