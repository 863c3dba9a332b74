"""lb_xdp's packet capture (bpf/lib/capture.h) through the real program (BPF_PROG_TEST_RUN).

Every fixture case of tests/bpf/lb_fixtures.py runs with capture on at every point: its
verdict, output frame and counters are exactly those of the table (capture changes no
verdict), and its records are what the expectation implies — a drop names the reason
lb_drops counted, a pass the event lb_events counted, a forward the backend that
lb_be_stats counted and the VIP of lb_vip_stats — each with the input frame's bytes.
Then: nothing with capture off, the 1-in-N sampler and the per-second cap exactly, the
destination filter, and the expiry that ends an abandoned capture.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import lb_fixtures as fx
import pytest
from lb_harness import Lb
from test_lb_xdp import run_case

from xdplb.core import abi
from xdplb.core.abi import CapDecision, CapPoint, DropReason, Event
from xdplb.core.capture import CaptureSettings, Record
from xdplb.datapath import Map
from xdplb.datapath.capture import CAPTURE_MAPS, CaptureMaps, monotonic_ns

pytestmark = pytest.mark.bpf

ALL = CapPoint.DROP | CapPoint.FORWARD | CapPoint.PASS
PASS_EVENTS = {Event.PASS_NOT_IP, Event.PASS_MALFORMED, Event.PASS_NOT_VIP}


@pytest.fixture
def cap(lb: Lb) -> Iterator[CaptureMaps]:
    """The capture maps of the test's lb_xdp (own descriptors), left off afterwards; the
    test's packets run on one CPU, as the sampler is per CPU."""
    maps = {n: Map.from_fd(lb.obj.map(n).fd) for n in CAPTURE_MAPS}
    c = CaptureMaps(maps, Map.from_fd(lb.obj.map("lb_vips").fd))
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield c
    finally:
        os.sched_setaffinity(0, before)
        c.stop()
        c.ring.skip()
        c.close()


def records(cap: CaptureMaps) -> list[Record]:
    return cap.read(0)


def expected_records(frame: bytes, want: fx.Expect) -> list[tuple[object, ...]]:
    """(point, reason, vip id, backend id, backend) the table's expectation implies."""
    out: list[tuple[object, ...]] = []
    if want.be_stats:
        ((be_id, _),) = want.be_stats.items()
        ((vip_id, (_, _, new)),) = want.vip_stats.items()
        if new:
            reason = CapDecision.TABLE
        elif Event.FRAGMENT in want.events:
            reason = CapDecision.FRAGMENT
        elif Event.ICMP_ERROR in want.events:
            reason = CapDecision.ICMP_ERROR
        else:
            reason = CapDecision.CONN_HIT
        out.append((CapPoint.FORWARD, reason, vip_id, be_id, fx.BACKENDS[be_id].addr))
    for reason_, n in want.drops.items():
        assert n == 1
        out.append((CapPoint.DROP, DropReason(reason_), None, None, None))
    if want.verdict == fx.XDP_PASS and not want.be_stats:
        (ev,) = (e for e in want.events if e in PASS_EVENTS)
        out.append((CapPoint.PASS, Event(ev), None, None, None))
    return out


def as_tuple(r: Record) -> tuple[object, ...]:
    enum_of = {CapPoint.DROP: DropReason, CapPoint.PASS: Event, CapPoint.FORWARD: CapDecision}
    return (r.point, enum_of[r.point](r.reason), r.vip_id, r.backend_id, r.backend)


@pytest.mark.parametrize("case", fx.CASES, ids=[c.description for c in fx.CASES])
def test_fixture_with_capture_on(lb: Lb, cap: CaptureMaps, case: fx.Case) -> None:
    frame = case.frame(lb.env)
    want = case.expect(lb.env, frame)
    cap.start(CaptureSettings(ALL, max_per_sec=0))
    run_case(lb, frame, want)  # verdict, output frame and counters as with capture off
    recs = records(cap)
    assert [as_tuple(r) for r in recs] == expected_records(frame, want)
    for r in recs:
        assert r.pkt_len == len(frame) or r.point == CapPoint.DROP  # a late drop: encapsulated
        assert r.ifindex == lb.ns.lb_ifindex
    first = recs[0]
    assert (first.frame, first.pkt_len) == (frame[: abi.CAP_SNAP_MAX], len(frame))
    assert cap.stats() == type(cap.stats())(records=len(recs), capped=0, ring_full=0)


def test_dropped_packet_has_its_reason_and_bytes(lb: Lb, cap: CaptureMaps) -> None:
    frame = fx.to_vip("notable")(lb.env)  # a VIP without a table: NO_TABLE
    cap.start(CaptureSettings(CapPoint.DROP, snap_len=40))
    before = lb.counters()
    assert lb.run(frame).retval == fx.XDP_DROP
    assert (lb.counters() - before).drops == {DropReason.NO_TABLE: 1}
    (rec,) = records(cap)
    assert (rec.point, rec.reason_name, rec.frame, rec.pkt_len) == (
        CapPoint.DROP,
        "NO_TABLE",
        frame[:40],
        len(frame),
    )
    assert rec.comment() == "point=drop reason=NO_TABLE"


def test_forwarded_packet_names_the_backend(lb: Lb, cap: CaptureMaps) -> None:
    vip = fx.VIPS["tcp4"]
    syn = fx.to_vip("tcp4")(lb.env)
    ack = fx.to_vip("tcp4", flags="A")(lb.env)
    be_id, _ = fx.pick(syn, vip)
    cap.start(CaptureSettings(CapPoint.FORWARD))
    assert [lb.run(f).retval for f in (syn, ack)] == [fx.XDP_TX, fx.XDP_TX]
    new, known = records(cap)
    be = fx.BACKENDS[be_id].addr
    assert (new.reason_name, new.backend_id, new.backend, new.vip_id, new.hops) == (
        "TABLE", be_id, be, vip.id, 1
    )  # fmt: skip
    assert (known.reason_name, known.backend_id, known.frame) == ("CONN_HIT", be_id, ack)
    names = cap.vip_names()
    assert names[vip.id] == "198.19.1.1:80/tcp"
    assert known.comment(names) == (
        f"point=forward reason=CONN_HIT vip=198.19.1.1:80/tcp vip_id={vip.id} backend={be} "
        f"backend_id={be_id} hops=1"
    )


def test_malformed_packet_is_recorded_under_the_reason_it_is_counted_under(
    lb: Lb, cap: CaptureMaps
) -> None:
    malformed = ("IPv4 tot_len beyond the frame", "truncated TCP to a VIP")
    frames = [c.frame(lb.env) for c in fx.CASES if c.description.startswith(malformed)]
    assert len(frames) == 2
    cap.start(CaptureSettings(CapPoint.DROP | CapPoint.PASS))
    seen = set()
    for frame in frames:
        before = lb.counters()
        lb.run(frame)
        delta = lb.counters() - before
        (rec,) = records(cap)
        counted = (
            {abi.DropReason(k).name for k in delta.drops}
            if rec.point == CapPoint.DROP
            else {abi.Event(k).name for k in delta.events}
        )
        assert counted == {rec.reason_name}
        assert rec.frame == frame
        seen.add(rec.reason_name)
    assert seen == {"PASS_MALFORMED", "MALFORMED_L4"}


def test_capture_off_records_nothing(lb: Lb, cap: CaptureMaps) -> None:
    cap.start(CaptureSettings(ALL))
    cap.stop()
    for case in fx.CASES:
        lb.run(case.frame(lb.env))
    assert records(cap) == []
    assert cap.stats().records == 0
    assert not cap.active()


def test_points_not_chosen_are_not_recorded(lb: Lb, cap: CaptureMaps) -> None:
    cap.start(CaptureSettings(CapPoint.PASS))
    lb.run(fx.to_vip("tcp4")(lb.env))  # forwarded
    lb.run(fx.to_vip("notable")(lb.env))  # dropped
    assert records(cap) == []
    arp = next(c for c in fx.CASES if "ARP" in c.description).frame(lb.env)
    lb.run(arp)
    assert [r.reason_name for r in records(cap)] == ["PASS_NOT_IP"]


def test_one_in_n_exactly(lb: Lb, cap: CaptureMaps) -> None:
    frame = fx.to_vip("notable")(lb.env)
    cap.start(CaptureSettings(CapPoint.DROP, sample=3, max_per_sec=0))
    for _ in range(10):
        lb.run(frame)
    assert len(records(cap)) == 4  # packets 1, 4, 7 and 10
    st = cap.stats()
    assert (st.records, st.capped) == (4, 0)


def test_per_second_cap(lb: Lb, cap: CaptureMaps) -> None:
    frame = fx.to_vip("notable")(lb.env)
    cap.start(CaptureSettings(CapPoint.DROP, max_per_sec=5))
    t0 = monotonic_ns()
    for _ in range(20):
        lb.run(frame)
    elapsed = monotonic_ns() - t0
    assert elapsed < 1_000_000_000, "20 test runs took a second: the window moved"
    assert len(records(cap)) == 5
    assert (cap.stats().records, cap.stats().capped) == (5, 15)


def test_destination_filter(lb: Lb, cap: CaptureMaps) -> None:
    cap.start(CaptureSettings(ALL, dst=fx.VIPS["tcp6"].addr))
    lb.run(fx.to_vip("tcp4")(lb.env))
    lb.run(fx.to_vip("notable")(lb.env))
    assert records(cap) == []
    lb.run(fx.to_vip("tcp6")(lb.env))
    assert [(r.point, r.backend_id) for r in records(cap)] == [
        (CapPoint.FORWARD, fx.pick(fx.to_vip("tcp6")(lb.env), fx.VIPS["tcp6"])[0])
    ]


def test_an_expired_capture_stops_and_switches_itself_off(lb: Lb, cap: CaptureMaps) -> None:
    frame = fx.to_vip("notable")(lb.env)
    cap.start(CaptureSettings(CapPoint.DROP), seconds=0.001)
    deadline = abi.CaptureConfig.from_buffer_copy(cap.cfg.lookup(bytes(4)) or b"").expires_ns
    while monotonic_ns() <= deadline:
        pass  # the expiry is a millisecond away: busy-wait for the clock, not a sleep
    lb.run(frame)
    assert records(cap) == []
    raw = cap.cfg.lookup(bytes(4))
    assert raw is not None
    assert abi.CaptureConfig.from_buffer_copy(raw).expires_ns == 0  # lb_xdp switched it off
    assert not cap.active()


def test_renew_keeps_it_on_and_a_new_capture_starts_clean(lb: Lb, cap: CaptureMaps) -> None:
    frame = fx.to_vip("notable")(lb.env)
    cap.start(CaptureSettings(CapPoint.DROP, sample=2, max_per_sec=0))
    lb.run(frame)
    lb.run(frame)
    cap.renew()
    assert cap.active()
    lb.run(frame)  # the third: sampled
    assert len(records(cap)) == 2
    lb.run(frame)  # left in the ring (not sampled anyway) and a fresh start
    lb.run(frame)
    cap.start(CaptureSettings(CapPoint.DROP, sample=2, max_per_sec=0))
    assert records(cap) == []
    lb.run(frame)
    assert len(records(cap)) == 1
