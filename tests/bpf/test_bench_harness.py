"""The benchmark measures what it says: bench_wrap restores the packet every iteration.

BPF_PROG_TEST_RUN with repeat reuses one buffer, so without the wrapper lb_xdp would see
its own encapsulated output from the second iteration on, and the benchmark would time
the wrong path without any error. These tests run the harness of bench/bench.py (quick
sizes) and check that every iteration took the intended path and produced the output of
a single plain run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from xdplb.core import abi, paths

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_harness as bh  # noqa: E402

pytestmark = pytest.mark.bpf

N = 5000


@pytest.fixture(scope="module")
def harness() -> Iterator[bh.Harness]:
    for obj in ("lb_xdp", "bench_wrap", "bench_ref"):
        paths.bpf_object(obj)  # a clear error if `make build` did not run
    instance = f"benchtest-{os.getpid()}"
    with bh.Harness(instance) as h:
        yield h
    # Everything is gone afterwards: the namespace and every pin.
    assert not (paths.pin_root(instance)).exists()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert instance not in netns.split()


def test_reference_through_wrapper(harness: bh.Harness) -> None:
    assert harness.check_single("reference") == []
    run = harness.measure("reference", N)
    assert run.valid, run.problems
    assert run.retval == bh.XDP_TX
    # One MAC swap of the original packet, not N of them.
    pkt = harness.cases["reference"].packet
    assert run.output == pkt[6:12] + pkt[0:6] + pkt[12:]
    assert run.ns_per_packet > 0


def test_new_flow_every_iteration_sees_the_original_packet(harness: bh.Harness) -> None:
    assert harness.check_single("ipv4_new_flow") == []
    before = harness._lb_counters()
    run = harness.measure("ipv4_new_flow", N)
    after = harness._lb_counters()
    assert run.valid, run.problems
    # Every iteration was a new flow that was recorded, encapsulated and sent back out ...
    assert run.counter_deltas == {"CONN_MISS": N, "CONN_INSERT": N, "TX": N}
    # ... measure() ran one more plain run after its window (a hit on the last flow).
    assert after["CONN_MISS"] - before["CONN_MISS"] == N
    assert after["CONN_HIT"] - before["CONN_HIT"] == 1
    # The last iteration's output is exactly one GUE encapsulation of its packet.
    assert run.output == run.expected_output
    ctr = harness._ctr - 1
    last = bh.varied(harness.cases["ipv4_new_flow"].packet, ctr)
    assert bh.check_gue(last, run.output, bh.LB_MAC) == []


def test_known_flow_through_wrapper(harness: bh.Harness) -> None:
    run = harness.measure("ipv6_known_flow", N)
    assert run.valid, run.problems
    assert run.counter_deltas == {"CONN_HIT": N, "TX": N}
    _, single = harness.single_run(harness.cases["ipv6_known_flow"])
    assert run.output == single
    assert bh.check_gue(harness.cases["ipv6_known_flow"].packet, run.output, bh.LB_MAC) == []


def test_without_the_wrapper_the_checks_would_fail(harness: bh.Harness) -> None:
    """The pitfall the wrapper exists for: lb_xdp run directly with repeat sees its own
    output from the second iteration on (a GUE packet for a backend: not a VIP), so it
    times one hit and N - 1 passes. The output alone would not tell (it is the same
    frame); the counters and the verdict do."""
    case = harness.cases["ipv4_known_flow"]
    harness.single_run(case)  # the flow is known
    before = harness._lb_counters()
    res = harness.progs["lb"].test_run(case.packet, repeat=N, ingress_ifindex=harness.ifindex)
    after = harness._lb_counters()
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert moved == {"CONN_HIT": 1, "TX": 1, abi.Event.PASS_NOT_VIP.name: N - 1}
    assert res.retval == bh.XDP_PASS


def test_bench_quick_writes_valid_results(tmp_path: Path) -> None:
    """`bench.py --quick` end to end: every case valid, the JSON has the contract's keys."""
    out = tmp_path / "results.json"
    with subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "bench.py"), "--quick", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode in (0, 1), output  # 2: a case did not take its path
    res = json.loads(out.read_text())
    assert res["valid"], res["problems"]
    lb_cases = {f"ipv{v}_{p}" for v in (4, 6) for p in ("non_vip", "known_flow", "new_flow")}
    assert {"reference", *lb_cases} <= res["datapath"].keys()
    assert {"reference", *lb_cases} <= res["datapath_ratio"].keys()
    assert set(res["targets"]) == lb_cases
    with_capture = {f"ipv{v}_{p}" for v in (4, 6) for p in ("known_flow", "new_flow")}
    assert {f"{c}_capture" for c in with_capture} <= res["datapath"].keys()
    assert set(res["capture_on_minus_off_ns"]) == with_capture
    assert {
        "build_push_10_backends",
        "build_push_100_backends",
        "build_push_1000_backends",
        "maglev_build_1000_backends",
        "push_only_65537",
    } <= res["control"].keys()
    assert {"kernel", "cpu_model", "cpus", "iterations", "rounds", "date"} <= res["meta"].keys()
    # Nothing left behind by the bench process: its namespace and pins are gone.
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"bench-{proc.pid}" not in netns.split()
    assert not paths.pin_root(f"bench-{proc.pid}").exists()
    assert not paths.pin_root(f"bench-{proc.pid}-cp").exists()


def test_new_flow_flood_is_balanced_but_not_recorded(harness: bh.Harness) -> None:
    """Past the per-CPU insert budget of a 100 ms window, new flows are still forwarded by
    the table, counted as CONN_FLOOD, and left out of the connection table.

    20,000 new flows take about 15 ms, inside one window; on a slow or busy machine the
    run may cross into the next windows, each with its budget again: the bounds follow
    from the run's own duration."""
    budget, n = 12_500, 20_000
    case = harness.cases["ipv4_new_flow"]
    first = harness._arm(case)
    flood = harness.lb.xdp_object.map("lb_flood")
    flood.update(bytes(4), bytes(flood.value_stride))  # a fresh window
    before = harness._lb_counters()
    # One test_run call: 20,000 new flows in ~15 ms, well inside one window.
    res = harness.wrap.test_run(case.packet, repeat=n, ingress_ifindex=harness.ifindex)
    after = harness._lb_counters()
    harness._ctr = first + n
    assert res.retval == bh.XDP_TX
    deltas = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    windows = 1 + res.duration_ns * n // abi.FLOOD_WINDOW_NS  # at most this many touched
    inserts, flooded = deltas.get("CONN_INSERT", 0), deltas.get("CONN_FLOOD", 0)
    assert deltas["CONN_MISS"] == deltas["TX"] == inserts + flooded == n, deltas
    assert budget <= inserts <= budget * windows, (deltas, windows)
    # More than one window's inserts may evict (a set holds 4): nothing else moves.
    assert set(deltas) <= {"CONN_MISS", "CONN_INSERT", "TX", "CONN_FLOOD", "CONN_EVICT"}, deltas
    if windows == 1:
        assert deltas == {"CONN_MISS": n, "CONN_INSERT": budget, "TX": n, "CONN_FLOOD": n - budget}
        conns, seed = harness.lb.conns, harness.lb.snapshot().config.seed
        assert conns.get(bh.flow_key(bh.varied(case.packet, first)), seed) is not None
        assert conns.get(bh.flow_key(bh.varied(case.packet, first + n - 1)), seed) is None


def test_capture_case_records_one_in_a_thousand(harness: bh.Harness) -> None:
    """The capture cases measure the path they claim: every point on, 1 in 1,000 recorded
    (exactly, on one CPU), the verdict and counters those of the case without capture."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        run = harness.measure("ipv4_known_flow_capture", 2500)
    finally:
        os.sched_setaffinity(0, before)
    assert run.problems == []
    assert run.counter_deltas == {"CONN_HIT": 2500, "TX": 2500}
    assert harness.capture is not None
    assert harness.capture.stats().records == 3  # iterations 1, 1001 and 2001
    assert not harness.capture.active()
