"""lb_tc on the packets only an skb has, as far as BPF_PROG_TEST_RUN can make them: an
skb context carries gso_size and gso_segs, but not the GSO type the kernel needs to grow
a GSO packet, nor a CHECKSUM_PARTIAL state. So here: what a test run can show (an
untyped GSO packet is refused safely, a packet over the MTU without GSO is still too big,
a frame's checksum field is carried as the sender left it); real TSO packets with
checksum offload go through lb_tc in the lab (tests/e2e/test_offloads.py).
"""

from __future__ import annotations

import struct

import lb_fixtures as fx
import pytest
from lb_harness import TC_ACT_SHOT, Lb

from xdplb.core import abi
from xdplb.datapath.testrun import skb_ctx, skb_gso

pytestmark = pytest.mark.bpf

#: The sender's segment size (a 1500-byte MTU, IPv4 + TCP with timestamps).
MSS = 1448


@pytest.fixture(scope="module")
def lb_hook() -> str:
    return "lb_tc"


def super_packet(lb: Lb, vip: str, segments: int, csum: int) -> bytes:
    """A TSO super-packet of ``segments`` full segments to ``vip``: one TCP header, one
    IP header whose length covers them all, and ``csum`` in the TCP checksum field."""
    v = fx.VIPS[vip]
    pkt = fx.client_frame(
        v.addr, v.port, lb_mac=lb.env.lb_mac, flags="A", payload=bytes(MSS * segments)
    )
    frame = bytearray(bytes(pkt))
    l3 = fx.l3_offset(bytes(frame))
    l4 = l3 + (20 if v.addr.version == 4 else 40)
    struct.pack_into("!H", frame, l4 + 16, csum)
    return bytes(frame)


def run_gso(lb: Lb, frame: bytes, segments: int) -> tuple[int, bytes, int, int]:
    ctx = skb_ctx(
        ifindex=lb.ns.lb_ifindex,
        ingress_ifindex=lb.ns.lb_ifindex,
        gso_size=MSS,
        gso_segs=segments,
    )
    r = lb.prog.test_run(frame, ctx=ctx)
    assert r.ctx_out is not None
    size, segs = skb_gso(r.ctx_out)
    return r.retval, r.data, size, segs


def test_a_gso_packet_the_kernel_cannot_type_is_dropped_and_counted(lb: Lb) -> None:
    """A test run's GSO skb has no GSO type (net/bpf/test_run.c sets only the size and the
    count), and bpf_skb_adjust_room refuses to grow a GSO packet that is not typed TCP:
    lb_tc drops it under ENCAP, counted, its session recorded; nothing half-built leaves.
    A real TSO packet is typed; the lab carries them (tests/e2e/test_offloads.py)."""
    frame = super_packet(lb, "tcp4", 2, 0x1234)
    before = lb.counters()
    verdict, _, gso_size, _ = run_gso(lb, frame, 2)
    assert verdict == TC_ACT_SHOT
    assert gso_size == MSS  # untouched
    delta = lb.counters() - before
    assert delta.drops == {abi.DropReason.ENCAP: 1}
    assert abi.Event.TX not in delta.events


def test_a_packet_too_big_without_gso_is_still_too_big(lb: Lb) -> None:
    """Only GSO lifts the MTU check: the same bytes as one plain packet are answered."""
    lb.update_config(flags=0)  # no ICMP answer: a counted drop
    frame = super_packet(lb, "tcp4", 2, 0x1234)
    before = lb.counters()
    r = lb.prog.test_run(
        frame, ctx=skb_ctx(ifindex=lb.ns.lb_ifindex, ingress_ifindex=lb.ns.lb_ifindex)
    )
    assert r.retval == TC_ACT_SHOT
    assert (lb.counters() - before).drops[abi.DropReason.TOO_BIG] == 1
