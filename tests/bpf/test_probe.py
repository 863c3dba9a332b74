"""The self-check's probe (xdplb.cluster.probe) through lb_xdp and lb_tc: a packet that
carries lb_config's probe key takes steps 6 and 9 only -- forwarded where the tables
say, no session, no VIP or backend counters, no ACL -- and one that does not carry it,
or carries a key when lb_config has none, is an ordinary packet.
"""

from __future__ import annotations

import struct

import lb_fixtures as fx
import pytest
from lb_harness import Lb, lb_program

from xdplb.cluster.probe import PROBE_SPORT, Probe, outer_destination, probes, run_probe
from xdplb.core import abi, mapops
from xdplb.core.state import Vip
from xdplb.datapath.hooks import Hook
from xdplb.datapath.testrun import BPF_PROG_TYPE_SCHED_CLS
from xdplb.model import frames
from xdplb.model.state import Flow

pytestmark = pytest.mark.bpf

KEY = 0x5EC0_0DE5


def hook_of(lb: Lb) -> Hook:
    return Hook.TC if lb_program(lb.obj).type == BPF_PROG_TYPE_SCHED_CLS else Hook.XDP


def probe_of(lb: Lb, name: str) -> Probe:
    vip = fx.VIPS[name]
    (p,) = probes(lb.maps.snapshot(), [Vip(vip.addr, vip.port, vip.proto)])
    return p


def run(lb: Lb, probe: Probe, key: int = KEY) -> str | None:
    return run_probe(lb.prog, hook_of(lb), probe, key, lb.ns.lb_ifindex)


#: noneigh: the backend's neighbour is not resolved, so the encapsulated frame is passed
#: to the kernel to route (FIB_PASS): a forward all the same.
@pytest.mark.parametrize("name", ["tcp4", "udp6", "4in6", "ipip", "wild", "beamer4", "noneigh"])
def test_probe_goes_where_the_model_says_and_records_nothing(lb: Lb, name: str) -> None:
    lb.update_config(probe_key=KEY)
    probe = probe_of(lb, name)
    vip = fx.VIPS[name]
    assert vip.backends is not None
    be_id, _ = fx.pick(probe.frame, vip)
    assert probe.expect == fx.BACKENDS[be_id].addr
    before = lb.counters()
    assert run(lb, probe) is None
    delta = lb.counters() - before
    assert lb.conn(probe.frame) is None
    assert delta.vip_stats == {} and delta.be_stats == {}
    # The one counter it moves: the way out (a test run does not send).
    assert set(delta.named()["events"]) <= {"TX", "REDIRECT", "FIB_PASS"}


def test_probe_skips_the_acl(lb: Lb) -> None:
    """A VIP whose ACL denies the probe's source still answers the probe (the ACL has its
    own tests; the probe checks the tables)."""
    lb.update_config(probe_key=KEY)
    probe = probe_of(lb, "tcp4")
    lb.update_config(flags=abi.CFG_F_ACL_DENY)  # every source denied by default
    assert lb.run(probe.frame).retval == fx.XDP_DROP
    assert run(lb, probe) is None


def test_probe_finds_a_table_that_is_not_what_the_control_plane_wrote(lb: Lb) -> None:
    lb.update_config(probe_key=KEY)
    probe = probe_of(lb, "tcp4")
    wrong = next(b for b in fx.V4_BES if fx.BACKENDS[b].addr != probe.expect)
    lb.set_table(fx.VIPS["tcp4"].id, (wrong,))
    why = run(lb, probe)
    assert why is not None and f"to {fx.BACKENDS[wrong].addr}" in why, why


def test_probe_of_a_vip_gone_from_the_maps_fails(lb: Lb) -> None:
    """The maps lost the VIP the control plane wrote: the program passes the frame as it
    came, which is no forward."""
    lb.update_config(probe_key=KEY)
    probe = probe_of(lb, "tcp4")
    lb.maps.apply([mapops.DeleteVip(probe.vip)])
    why = run(lb, probe)
    assert why is not None and f"to {probe.vip.addr}" in why, why


def test_probe_of_a_vip_without_table_expects_the_drop(lb: Lb) -> None:
    lb.update_config(probe_key=KEY)
    probe = probe_of(lb, "notable")
    assert probe.expect is None
    assert run(lb, probe) is None


def test_without_the_key_a_probe_is_an_ordinary_packet(lb: Lb) -> None:
    """Wrong key, or no key in lb_config (a zero key marks nothing, or every skb with
    mark 0 would be a probe): the packet is recorded and counted as any other."""
    probe = probe_of(lb, "tcp4")
    for config_key, carried in ((KEY, KEY + 1), (0, 0)):
        lb.reset()
        lb.update_config(probe_key=config_key)
        before = lb.counters()
        assert run(lb, probe, key=carried) is None  # forwarded all the same
        delta = lb.counters() - before
        assert lb.conn(probe.frame) is not None
        assert delta.vip_stats == {fx.VIPS["tcp4"].id: (1, len(probe.frame) - 14, 1)}


def test_outer_destination() -> None:
    flow = Flow(fx.A("192.0.2.1"), fx.A("198.19.1.1"), PROBE_SPORT, 80, 6)
    assert outer_destination(frames.frame(flow)) == fx.A("198.19.1.1")
    flow6 = Flow(fx.A("2001:db8::1"), fx.A("fd78:6470:6c62:1::1"), PROBE_SPORT, 80, 17)
    assert outer_destination(frames.frame(flow6)) == fx.A("fd78:6470:6c62:1::1")
    assert outer_destination(struct.pack("!12xH", 0x0806) + bytes(28)) is None
    assert outer_destination(b"") is None
