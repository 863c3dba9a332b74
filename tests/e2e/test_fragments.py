"""Fragments and echo through the whole lab (docs/datapath.md steps 4a and 4c).

Fragments: UDP datagrams bigger than the client's 1400-byte MTU leave the client as IP
fragments; lb_xdp balances every fragment by (source, destination, protocol) only, so
all of them reach one backend; host_tc decapsulates each; the backend's kernel
reassembles the datagram, and its UDP echo answers with its name and the whole payload.
Over GUE and over IPIP, IPv4 and IPv6. All fragmented datagrams of the client to a VIP
go to the backend the model predicts for the port-less flow, whatever their source
port; small datagrams are balanced by their 5-tuple and spread. The LB's ``FRAGMENT``
event moves by the number of fragments sent.

Echo: with ``icmp_echo: true`` the LB answers pings to the VIP itself (``ICMP_ECHO``
moves by one per reply: nobody else could answer, as lb_xdp sends echo requests to no
backend). Without it the request is passed to the LB's kernel, which has no route to
the VIP prefix and answers "destination unreachable": the ping gets no echo reply.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from xdplb import model
from xdplb.core import abi
from xdplb.core.abi import DropReason, Event
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.topology import CLIENT_MTU
from xdplb.lab.traffic import udp_exchange

pytestmark = pytest.mark.e2e

VIP4, VIP6 = "198.18.100.1", "fd78:6470:6c62:100::1"
#: The same over IPIP (IPv4 in IPv4, IPv6 in IPv6) instead of GUE.
IPIP4, IPIP6 = "198.18.100.3", "fd78:6470:6c62:100::3"
#: VIP addresses without ``icmp_echo``.
QUIET4, QUIET6 = "198.18.100.2", "fd78:6470:6c62:100::2"
UDP_PORT = 53
#: Payload sizes: 3, 6 and 2 fragments over IPv4 (fewer or as many over IPv6).
SIZES = (3000, 8000, 1400)
PINGS = 3


def vips(lab: Lab) -> list[dict[str, object]]:
    def backends(family: int) -> list[dict[str, str]]:
        return [{"address": str(lab.addr(b, family))} for b in lab.backends]

    return [
        # The port-0 UDP VIP of each address gets the address's UDP fragments.
        {"address": VIP4, "port": 0, "protocol": "udp", "icmp_echo": True, "backends": backends(4)},
        {"address": VIP6, "port": 0, "protocol": "udp", "icmp_echo": True, "backends": backends(6)},
        {"address": IPIP4, "port": 0, "protocol": "udp", "encap": "ipip", "backends": backends(4)},
        {"address": IPIP6, "port": 0, "protocol": "udp", "encap": "ipip", "backends": backends(6)},
        {"address": QUIET4, "port": UDP_PORT, "protocol": "udp", "backends": backends(4)},
        {"address": QUIET6, "port": UDP_PORT, "protocol": "udp", "backends": backends(6)},
    ]


@pytest.fixture(scope="module")
def lb(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LbNode]:
    for addr in (IPIP4, IPIP6):
        lab.add_vip_to_backends(addr)
    lab.start_servers("--udp", str(UDP_PORT))
    node = LbNode(lab, Path(tmp_path_factory.mktemp("frag")), vips(lab))
    node.start()
    yield node
    node.destroy()


def counters(node: LbNode) -> tuple[dict[Event, int], dict[DropReason, int]]:
    with node.maps() as maps:
        c = maps.counters(exact_conns=False)
    return c.events, c.drops


def predict(lab: Lab, node: LbNode, vip: str, sports: list[int]) -> list[str]:
    """The backend the model picks for each flow client:sport -> vip:UDP_PORT/udp."""
    src, dst = lab.addr("client", ipaddress.ip_address(vip).version), ipaddress.ip_address(vip)
    flows = [model.Flow(src, dst, p, UDP_PORT if p else 0, abi.IPPROTO_UDP) for p in sports]
    with node.maps() as maps:
        state = model.state_from_snapshot(maps.snapshot())
    by_addr = {lab.addr(n, f): n for n in lab.backends for f in (4, 6)}
    names = {bid: by_addr[b.addr] for bid, b in state.backends.items()}
    return [names[int(i)] for i in model.predict_many(state, flows).backend]


def fragments(size: int, family: int) -> int:
    """How many fragments the client's kernel makes of a UDP datagram with ``size``
    bytes of payload: every fragment but the last carries a multiple of 8 bytes."""
    header = 20 if family == 4 else 40 + 8  # IPv6: + the fragment header
    per_fragment = (CLIENT_MTU - header) // 8 * 8
    return math.ceil((8 + size) / per_fragment)


@pytest.mark.parametrize(
    ("vip", "family", "decap"),
    [
        (VIP4, 4, abi.HostEvent.DECAP_GUE),
        (VIP6, 6, abi.HostEvent.DECAP_GUE),
        (IPIP4, 4, abi.HostEvent.DECAP_IPIP),
        (IPIP6, 6, abi.HostEvent.DECAP_IPIP),
    ],
)
def test_fragmented_datagrams_reach_one_backend_whole(
    lab: Lab, lb: LbNode, vip: str, family: int, decap: abi.HostEvent
) -> None:
    client = lab.ns("client")
    first = 30000 + 100 * (family + 2 * (decap == abi.HostEvent.DECAP_IPIP))
    sports = list(range(first, first + 12))
    host_before = {n: lab.hosts[n].events() for n in lab.backends}
    ev0, drops0 = counters(lb)

    got: list[str] = []
    sent_fragments = 0
    for i, sport in enumerate(sports):
        size = SIZES[i % len(SIZES)]
        payload = os.urandom(size - 2) + sport.to_bytes(2, "big")
        # udp_exchange checks the echoed payload byte for byte: reassembled whole.
        got.append(udp_exchange(client, vip, UDP_PORT, payload, src_port=sport, tries=1))
        sent_fragments += fragments(size, family)

    ev1, drops1 = counters(lb)
    # All of one client's datagrams to one VIP: one backend, the model's for the flow
    # without ports (Maglev's fragment key).
    assert set(got) == set(predict(lab, lb, vip, [0])), got
    assert ev1[Event.FRAGMENT] - ev0[Event.FRAGMENT] == sent_fragments
    assert drops1[DropReason.FRAGMENT] == drops0[DropReason.FRAGMENT]
    # host_tc of that backend decapsulated every fragment; the others saw none; none
    # dropped anything.
    for name in lab.backends:
        after = lab.hosts[name].events()
        moved = {e: after[e] - host_before[name][e] for e in abi.HostEvent}
        expect = sent_fragments if name == got[0] else 0
        assert moved[decap] == expect, (name, moved)
        assert not {e: n for e, n in moved.items() if n and e.name.startswith("DROP")}, moved

    # The same source ports with small datagrams: one packet each, balanced by the
    # 5-tuple, so they spread over the backends (and land where the model says).
    small = [udp_exchange(client, vip, UDP_PORT, b"small", src_port=p) for p in sports]
    assert small == predict(lab, lb, vip, sports)
    assert len(set(small)) > 1, small
    ev2, _ = counters(lb)
    assert ev2[Event.FRAGMENT] == ev1[Event.FRAGMENT]
    print(
        f"IPv{family} {decap.name}: {len(sports)} datagrams, {sent_fragments} fragments, "
        f"all to {got[0]}; small ones to {sorted(set(small))}"
    )


def ping(lab: Lab, addr: str) -> tuple[int, str]:
    """``ping -c PINGS``: how many echo replies came back, and the output."""
    done = lab.run("client", ["ping", "-c", str(PINGS), "-i", "0.2", "-W", "1", addr], check=False)
    m = re.search(r"(\d+) received", done.stdout)
    assert m, done.stdout + done.stderr
    return int(m.group(1)), done.stdout


@pytest.mark.parametrize(("vip", "quiet"), [(VIP4, QUIET4), (VIP6, QUIET6)])
def test_echo_answered_by_the_lb_only_when_configured(
    lab: Lab, lb: LbNode, vip: str, quiet: str
) -> None:
    ev0, _ = counters(lb)
    replies, out = ping(lab, vip)
    ev1, _ = counters(lb)
    assert replies == PINGS, out
    assert ev1[Event.ICMP_ECHO] - ev0[Event.ICMP_ECHO] == PINGS

    replies, out = ping(lab, quiet)
    ev2, _ = counters(lb)
    assert replies == 0, out
    assert ev2[Event.ICMP_ECHO] == ev1[Event.ICMP_ECHO]
    assert ev2[Event.PASS_NOT_VIP] - ev1[Event.PASS_NOT_VIP] >= PINGS
    # The LB's kernel has no route to the VIP prefix: it answers "unreachable".
    lb_addr = lab.addr("lb", ipaddress.ip_address(quiet).version)
    assert f"From {lb_addr} icmp_seq=" in out, out
