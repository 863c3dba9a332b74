"""bpf/lab_flood.bpf.c, the lab's SYN-flood generator, through BPF_PROG_TEST_RUN.

Live-frame pages come back to the generator holding whatever was written into them
downstream (a receiver's skb is built on the page): every frame must be the template
with a fresh source, whatever the page held before.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator

import pytest
from scapy.layers.inet import IP, TCP
from scapy.layers.l2 import Ether

from xdplb.core import paths
from xdplb.datapath import BpfObject
from xdplb.lab.flood import FRAME_LEN, flood_config, syn_template

pytestmark = pytest.mark.bpf

XDP_TX = 3
PREFIX = ipaddress.IPv4Network("198.19.7.0/24")
SPORTS = (2000, 2099)
TEMPLATE = syn_template("02:00:00:00:00:01", "02:00:00:00:00:02", "198.19.7.0", "10.0.0.9", 80)


@pytest.fixture(scope="module")
def flood() -> Iterator[BpfObject]:
    with BpfObject.load(paths.bpf_object("lab_flood")) as obj:
        obj.map("flood_cfg").update(bytes(4), flood_config(TEMPLATE, PREFIX, SPORTS))
        yield obj


def check_frame(out: bytes) -> None:
    """``out`` is the template but for a source in PREFIX, a source port in SPORTS and
    a sequence number, with both checksums right."""
    got, want = Ether(out), Ether(TEMPLATE)
    assert (got.src, got.dst) == (want.src, want.dst)
    assert ipaddress.IPv4Address(got[IP].src) in PREFIX
    assert SPORTS[0] <= got[TCP].sport <= SPORTS[1]
    assert got[IP].dst == want[IP].dst and got[TCP].dport == want[TCP].dport
    assert got[TCP].options == want[TCP].options
    # Checksums: scapy recomputes them when they are deleted.
    fixed = got.copy()
    del fixed[IP].chksum
    del fixed[TCP].chksum
    assert bytes(Ether(bytes(fixed))) == out


def test_template_becomes_a_spoofed_syn(flood: BpfObject) -> None:
    res = flood.program("lab_flood").test_run(TEMPLATE)
    assert res.retval == XDP_TX
    check_frame(res.data)


def test_page_written_downstream_is_rebuilt(flood: BpfObject) -> None:
    """A page holding another packet (here: the balancer's MACs swapped in, a header
    moved, garbage) leaves as the template: the generator never sends what a receiver
    wrote (the lab's bridge once learned the balancer's MAC on the attacker's port)."""
    tmpl = Ether(TEMPLATE)
    swapped = bytes(Ether(src=tmpl.dst, dst=tmpl.src) / tmpl[IP])
    for page in (swapped, bytes(range(FRAME_LEN)), b"\xff" * FRAME_LEN):
        res = flood.program("lab_flood").test_run(page)
        assert res.retval == XDP_TX, page.hex()
        check_frame(res.data)


def test_repeated_runs_stay_valid(flood: BpfObject) -> None:
    """With repeat, the kernel reuses one buffer: the last of 1,000 runs is still a
    well-formed SYN."""
    res = flood.program("lab_flood").test_run(TEMPLATE, repeat=1000)
    assert res.retval == XDP_TX
    check_frame(res.data)


def test_short_frame_is_dropped(flood: BpfObject) -> None:
    assert flood.program("lab_flood").test_run(TEMPLATE[:60]).retval == 1  # XDP_DROP
