"""`make bench`: per-packet cost of lb_xdp, time to build and push Maglev tables, health
checks per second, and failover time with the real daemon.

    .venv/bin/python bench/bench.py [--out bench/results.json] [--rounds N]
                                    [--iterations N] [--health-seconds S]
                                    [--failover-rounds N] [--quick] [--strict]

Data path: BPF_PROG_TEST_RUN through the restoring wrapper bpf/bench_wrap.bpf.c (see
bench_harness.py and docs/benchmarks.md), every case checked against lb_xdp's own
counters; a case that does not take its path makes the run fail (exit 2). Control
plane: plan + apply through LbDatapath for a VIP with N backends. Operations:
health_bench.py (checks/s on one core, 2,000 backends) and failover_bench.py (a backend's
failure to the new table in the maps, the daemon in the lab).

Exit status: 0 done (targets missed are reported, not fatal unless --strict), 1 targets
missed with --strict, 2 a case was invalid.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from rich.console import Console
from rich.table import Table

import bench_harness as bh
import failover_bench
import health_bench
from xdplb.config import parse_config
from xdplb.control.planner import apply_to_snapshot, plan
from xdplb.core import abi
from xdplb.core.mapops import PutTable
from xdplb.datapath import clock, conns
from xdplb.datapath.lb import LbDatapath, destroy
from xdplb.tables import maglev

#: Ratio to the reference that lb_xdp must stay under, per path.
TARGETS = {"known_flow": 3.5, "new_flow": 7.5, "non_vip": 2.0}
LB_CASES = [
    "ipv4_non_vip",
    "ipv4_known_flow",
    "ipv4_new_flow",
    "ipv6_non_vip",
    "ipv6_known_flow",
    "ipv6_new_flow",
    # A new flow into a table with room (no session evicted), and past the insert budget
    # (balanced, not recorded: what a new-connection flood costs).
    "ipv4_new_flow_empty",
    "ipv4_new_flow_flood",
]
#: The same paths with `xdplb capture` sampling 1 in 1,000 (docs/benchmarks.md).
CAPTURE_CASES = [
    "ipv4_known_flow_capture",
    "ipv4_new_flow_capture",
    "ipv6_known_flow_capture",
    "ipv6_new_flow_capture",
]
DATAPATH_CASES = ["harness", "reference", "reference_ipv6", *LB_CASES, *CAPTURE_CASES]
CONTROL_TARGET_MS = 100.0  # build + push for 1,000 backends
BACKEND_COUNTS = (10, 100, 1000)

console = Console()
if not console.is_terminal:
    console = Console(width=120)


def _target_of(case: str) -> float | None:
    return next((v for k, v in TARGETS.items() if case.endswith(k)), None)


# --- data path --------------------------------------------------------------------------


DIRECT_CASES = ["harness", "reference", "ipv4_non_vip", "ipv6_non_vip"]


def run_datapath(
    rounds: int, iterations: int
) -> tuple[dict[str, list[float]], dict[str, list[float]], list[str]]:
    """Per case, ns/packet of each round (wrapped, and direct for context); and every
    problem found (empty: all valid)."""
    samples: dict[str, list[float]] = {c: [] for c in DATAPATH_CASES}
    direct: dict[str, list[float]] = {c: [] for c in DIRECT_CASES}
    problems: list[str] = []
    with bh.Harness() as h:
        for name in DATAPATH_CASES:
            problems += [f"{name}: {p}" for p in h.check_single(name)]
        # Warm-up: caches, JIT images, and a connection table already full and evicting.
        for name in DATAPATH_CASES:
            h.measure(name, max(iterations // 10, 1000))
        for r in range(rounds):
            # Interleave, starting each round at another case, so that noise (and whatever
            # one case leaves in the caches) falls on every case alike.
            k = r % len(DATAPATH_CASES)
            for name in DATAPATH_CASES[k:] + DATAPATH_CASES[:k]:
                run = h.measure(name, iterations)
                problems += [f"{name} (round {r + 1}): {p}" for p in run.problems]
                samples[name].append(run.ns_per_packet)
            for name in DIRECT_CASES:
                try:
                    direct[name].append(h.measure_direct(name, iterations))
                except bh.InvalidCase as e:
                    problems.append(f"{name} (direct, round {r + 1}): {e}")
    return samples, direct, problems


# --- control plane ----------------------------------------------------------------------

#: Sessions one import (or read) run moves: what session sync will do in a batch.
SESSION_BATCH = 100_000


def run_sessions(lb: LbDatapath, runs: int) -> dict[str, list[float]]:
    """ns per session of an import of SESSION_BATCH sessions into a flushed table (as a
    peer's sync would write them) and of reading the whole table back (a full sync's
    export), each session under the claim protocol (datapath/sessions.c)."""
    cfg = lb.snapshot().config
    bids = np.array([i for i, b in lb.snapshot().backends.items() if b.active] or [1])
    now = clock.now_ticks()
    i = np.arange(SESSION_BATCH, dtype=np.uint32)
    keys = np.zeros((SESSION_BATCH, 10), dtype=np.uint32)
    keys[:, 0] = (0xCB000000 + i).byteswap()  # 203.0.0.0 + i, network order
    keys[:, 4] = np.frombuffer(ipaddress.ip_address("198.18.200.1").packed, dtype="<u4")[0]
    ports = (1024 + i % 60000).astype(np.uint16).byteswap().astype(np.uint32)
    keys[:, 8] = ports | (np.uint32(80 << 8) << 16)  # dport 80 in network order
    keys[:, 9] = abi.IPPROTO_TCP
    batch = conns.records(
        keys, bids[i % len(bids)].astype(np.uint16), i, abi.SessState.TCP_EST, now
    )
    imports, reads = [], []
    for _ in range(runs):
        lb.bump_generation()
        gen = (cfg.conn_gen + 1) & 0xFFFF
        cfg = lb.snapshot().config
        t0 = time.perf_counter()
        res = lb.conns.import_records(
            batch, seed=cfg.seed, gen=gen, timeouts=cfg.conn_timeouts, now=now
        )
        imports.append((time.perf_counter() - t0) * 1e9 / SESSION_BATCH)
        written = int(np.count_nonzero(res <= conns.ImportResult.EVICTED))
        if written < SESSION_BATCH * 9 // 10:
            raise RuntimeError(f"only {written} of {SESSION_BATCH} sessions imported")
        t0 = time.perf_counter()
        n = sum(len(recs) for recs, _ in lb.conns.chunks())
        reads.append((time.perf_counter() - t0) * 1e9 / max(n, 1))
    return {"session_import_ns_per_entry": imports, "session_read_ns_per_entry": reads}


def _cp_config(instance: str, n: int, first_weight: int) -> dict[str, Any]:
    backends = [
        {"address": f"198.19.{i >> 8 & 255}.{i & 255}", "weight": 1} for i in range(1, n + 1)
    ]
    backends[0]["weight"] = first_weight
    return {
        "instance": instance,
        "tunnel": {"source_v4": "198.18.0.2"},
        "vips": [{"address": "198.18.200.1", "port": 80, "protocol": "tcp", "backends": backends}],
    }


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


def run_control(runs: int) -> dict[str, list[float]]:
    """Milliseconds per run of: build + push for N backends, Maglev build, push only."""
    out: dict[str, list[float]] = {}
    instance = f"bench-{os.getpid()}-cp"
    try:
        lb = LbDatapath(instance)
        try:
            snap = lb.snapshot()
            for n in BACKEND_COUNTS:
                # Settle on N backends (untimed), then flip one backend's weight between
                # 2 and 1: each plan is exactly one new table, built and swapped in.
                cfgs = [parse_config(_cp_config(instance, n, w)) for w in (1, 2)]
                ops = plan(cfgs[0], snap)
                lb.apply(ops)
                snap = apply_to_snapshot(snap, ops)
                times: list[float] = []
                for i in range(runs):
                    cfg = cfgs[(i + 1) % 2]
                    t0 = time.perf_counter()
                    ops = plan(cfg, snap)
                    lb.apply(ops)
                    times.append((time.perf_counter() - t0) * 1000.0)
                    if [type(o) for o in ops] != [PutTable]:
                        raise RuntimeError(f"expected one PutTable, planned {ops}")
                    snap = apply_to_snapshot(snap, ops)
                out[f"build_push_{n}_backends"] = times
            weights = {f"198.19.{i >> 8}.{i & 255}": 1 for i in range(1, 1001)}
            out["maglev_build_1000_backends"] = [
                _timed(lambda: maglev.build(weights, abi.DEFAULT_TABLE_SIZE)) for _ in range(runs)
            ]
            (vip_id,) = snap.tables
            buckets = snap.tables[vip_id]
            out[f"push_only_{abi.DEFAULT_TABLE_SIZE}"] = [
                _timed(lambda: lb.apply([PutTable(vip_id, buckets, abi.TableKind.MAGLEV)]))
                for _ in range(runs)
            ]
            # The data path must see the table that was pushed last.
            live = lb.table(vip_id)
            if live != buckets:
                raise RuntimeError("the pushed table is not the one lb_tables holds")
            out.update(run_sessions(lb, runs))
        finally:
            lb.close()
    finally:
        destroy(instance)
    return out


# --- report -----------------------------------------------------------------------------


def _spread(xs: list[float]) -> dict[str, Any]:
    med = statistics.median(xs)
    return {
        "min": min(xs),
        "max": max(xs),
        "rel_spread": (max(xs) - min(xs)) / med if med else 0.0,
        "samples": xs,
    }


def cpu_model() -> str | None:
    """/proc/cpuinfo's model name: figures only compare on one CPU model."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _git_rev() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def run_operations(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The health-check and failover sections (a section set to 0 is left out), and the
    problems found: a failed health check, or a failover that did not happen."""
    ops: dict[str, Any] = {}
    problems: list[str] = []
    if args.health_seconds > 0:
        with console.status("health checks…"):
            ops["health_checks"] = health_bench.run(args.health_seconds)
        for kind, phase in ops["health_checks"]["health"].items():
            if phase["failures"]:
                problems.append(f"health_{kind}: {phase['failures']} checks failed")
    if args.failover_rounds > 0:
        with console.status("failover (the daemon in the lab)…"):
            try:
                ops["failover"] = failover_bench.run(args.failover_rounds)
            except RuntimeError as e:  # a transition that never came: that is a result
                problems.append(f"failover: {e}")
    return ops, problems


def build_results(
    dp: dict[str, list[float]],
    direct: dict[str, list[float]],
    cp: dict[str, list[float]],
    problems: list[str],
    args: argparse.Namespace,
    cpu: int | None,
) -> dict[str, Any]:
    med = {k: statistics.median(v) for k, v in dp.items() if v}
    ref = med.get("reference", 0.0)
    harness = med.get("harness", 0.0)
    ratio = {k: v / ref for k, v in med.items()} if ref else {}
    net_ref = ref - harness
    targets: dict[str, Any] = {}
    for case in LB_CASES:
        limit = _target_of(case)
        if limit is None or case not in ratio:
            continue
        targets[case] = {
            "ratio": round(ratio[case], 3),
            "limit": limit,
            "pass": ratio[case] <= limit,
            "ns_over": round(max(0.0, med[case] - limit * ref), 1),
        }
    cp_med = {k: statistics.median(v) for k, v in cp.items()}
    # What capture on (1 in 1,000) adds to a path, and the CPU it was measured on.
    capture_cost = {
        c.removesuffix("_capture"): round(med[c] - med[c.removesuffix("_capture")], 1)
        for c in CAPTURE_CASES
        if c in med and c.removesuffix("_capture") in med
    }
    return {
        "datapath": med,
        "datapath_ratio": {k: round(v, 3) for k, v in ratio.items()},
        # Context: the same numbers without the wrapper's own cost (case - harness).
        "datapath_net": {k: v - harness for k, v in med.items() if k != "harness"},
        "datapath_net_ratio": (
            {k: round((v - harness) / net_ref, 3) for k, v in med.items() if k != "harness"}
            if net_ref > 0
            else {}
        ),
        "datapath_spread": {k: _spread(v) for k, v in dp.items() if v},
        # Context: unwrapped test_run where that is valid (the input never changes), and
        # what the wrapper adds (wrapped harness - bench_nop run directly).
        "direct": {k: statistics.median(v) for k, v in direct.items() if v},
        "wrapper_overhead_ns": (
            harness - statistics.median(direct["harness"]) if direct.get("harness") else None
        ),
        "targets": targets,
        "capture_on_minus_off_ns": capture_cost,
        "control": {k: round(v, 3) for k, v in cp_med.items()},
        "control_spread": {k: _spread(v) for k, v in cp.items()},
        "control_target": {
            "build_push_1000_backends_ms": CONTROL_TARGET_MS,
            "pass": cp_med.get("build_push_1000_backends", float("inf")) < CONTROL_TARGET_MS,
        },
        "valid": not problems,
        "invalid_cases": sorted({p.split(" ", 1)[0].rstrip(":") for p in problems}),
        "problems": problems,
        "meta": {
            "kernel": os.uname().release,
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(),
            "pinned_cpu": cpu,
            "iterations": args.iterations,
            "rounds": args.rounds,
            "control_runs": args.control_runs,
            "health_seconds": args.health_seconds,
            "failover_rounds": args.failover_rounds,
            "unit": "ns per packet (kernel's test_run average), median of rounds",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git": _git_rev(),
        },
    }


def print_tables(res: dict[str, Any]) -> None:
    t = Table(title="Data path: ns per packet (BPF_PROG_TEST_RUN through bench_wrap)")
    t.add_column("case", no_wrap=True)
    for col in ("median ns", "min-max", "spread", "ratio", "net ns", "target"):
        t.add_column(col, justify="right", no_wrap=True)
    for case, ns in res["datapath"].items():
        sp = res["datapath_spread"][case]
        tgt = res["targets"].get(case)
        if tgt is None:
            target = "—"
        elif tgt["pass"]:
            target = f"[green]≤{tgt['limit']} ok[/]"
        else:
            target = f"[red]≤{tgt['limit']} MISS +{tgt['ns_over']:.0f}ns[/]"
        net = res["datapath_net"].get(case)
        t.add_row(
            case,
            f"{ns:.0f}",
            f"{sp['min']:.0f}-{sp['max']:.0f}",
            f"{sp['rel_spread'] * 100:.0f}%",
            f"{res['datapath_ratio'].get(case, 0):.2f}",
            "—" if net is None else f"{net:.0f}",
            target,
        )
    console.print(t)
    cap = res.get("capture_on_minus_off_ns")
    if cap:
        console.print(
            "capture on (1 in 1,000) minus off: "
            + ", ".join(f"{k} {v:+.1f} ns" for k, v in cap.items())
        )
    c = Table(title="Control plane (median): ms, or ns where the name says so")
    for col in ("what", "median", "min-max"):
        c.add_column(col, justify="left" if col == "what" else "right")
    for k, v in res["control"].items():
        sp = res["control_spread"][k]
        mark = ""
        if k == "build_push_1000_backends":
            ok = res["control_target"]["pass"]
            mark = f" [green](< {CONTROL_TARGET_MS:.0f} ok)[/]" if ok else " [red](MISS)[/]"
        c.add_row(k, f"{v:.2f}{mark}", f"{sp['min']:.2f}-{sp['max']:.2f}")
    console.print(c)
    d = res["direct"]
    if d:
        console.print(
            "unwrapped (context): "
            + ", ".join(f"{k} {v:.0f} ns" for k, v in d.items())
            + f"; the wrapper adds {res['wrapper_overhead_ns']:.0f} ns to every case"
        )
    m = res["meta"]
    console.print(
        f"{m['cpu_model']}, kernel {m['kernel']}, {m['cpus']} CPUs (pinned to {m['pinned_cpu']}), "
        f"{m['rounds']} rounds x {m['iterations']:,} iterations, "
        "ratio = case / reference, net = case - harness"
    )
    print_operations(res)
    for p in res["problems"]:
        console.print(f"[red]INVALID[/] {p}")


def print_operations(res: dict[str, Any]) -> None:
    hc = res.get("health_checks")
    if hc is not None:
        t = Table(title=f"Health checks, one core, {hc['meta']['backends']:,} backends")
        for col in ("check", "checks/s", "per CPU-s", "failures", "p50 ms", "p99 ms"):
            t.add_column(col, justify="left" if col == "check" else "right")
        for kind, p in hc["health"].items():
            t.add_row(
                kind,
                f"{p['checks_per_second']:,.0f}",
                f"{p['checks_per_cpu_second']:,.0f}",
                str(p["failures"]),
                f"{p['latency_p50_ms']:.1f}",
                f"{p['latency_p99_ms']:.1f}",
            )
        console.print(t)
    fo = res.get("failover")
    if fo is not None:
        c = fo["meta"]["check"]
        t = Table(
            title=f"Failover, ms (interval {c['interval_ms']}, fall {c['fall_count']}, "
            f"rise {c['rise_count']}; {fo['meta']['rounds']} rounds)"
        )
        for col in ("what", "median", "max", "bound"):
            t.add_column(col, justify="left" if col == "what" else "right")
        b = fo["bound_ms"]
        bounds = {
            f"{k}_{way}_ms": f"{b[k]:.0f} (+1 interval: {b[k + '_plus_interval']:.0f})"
            for k, way in (("failure", "to_out"), ("recovery", "to_in"))
        }
        for k, v in fo["summary"].items():
            if v is not None:
                t.add_row(k, f"{v['median']:.1f}", f"{v['max']:.1f}", bounds.get(k, ""))
        console.print(t)


def _pin_cpu() -> tuple[int | None, set[int] | None]:
    """Pin this thread to the last CPU it may use (test_run may otherwise migrate between
    the iterations of one run, spreading per-CPU LRU lists and caches)."""
    try:
        old = os.sched_getaffinity(0)
        cpu = max(old)
        os.sched_setaffinity(0, {cpu})
        return cpu, old
    except OSError:
        return None, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results.json"))
    ap.add_argument("--rounds", type=int, default=None, help="rounds per case (default 7)")
    ap.add_argument("--iterations", type=int, default=None, help="test_run repeat (200000)")
    ap.add_argument("--control-runs", type=int, default=None, help="runs per control metric")
    ap.add_argument(
        "--health-seconds", type=float, default=None, help="per health phase (3; 0: skip)"
    )
    ap.add_argument("--failover-rounds", type=int, default=None, help="failovers (5; 0: skip)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 x 20,000, 3 runs")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 7
    if args.iterations is None:
        args.iterations = 20_000 if args.quick else 200_000
    if args.control_runs is None:
        args.control_runs = 3 if args.quick else 9
    if args.health_seconds is None:
        args.health_seconds = 1.0 if args.quick else 3.0
    if args.failover_rounds is None:
        args.failover_rounds = 2 if args.quick else 5
    if os.geteuid() != 0:
        console.print("[red]bench needs root (bpf syscalls, network namespaces)[/]")
        return 2

    def _term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds through every cleanup below

    signal.signal(signal.SIGTERM, _term)
    cpu, old_affinity = _pin_cpu()
    try:
        with console.status("data path…"):
            dp, direct, problems = run_datapath(args.rounds, args.iterations)
        with console.status("control plane…"):
            cp = run_control(args.control_runs)
    finally:
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
    ops, op_problems = run_operations(args)
    res = build_results(dp, direct, cp, problems + op_problems, args, cpu)
    res.update(ops)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print_tables(res)
    console.print(f"wrote {args.out}")
    if problems:
        return 2
    missed = [k for k, v in res["targets"].items() if not v["pass"]]
    if not res["control_target"]["pass"]:
        missed.append("build_push_1000_backends")
    if missed:
        console.print(f"[yellow]targets missed:[/] {', '.join(missed)}")
        return 1 if args.strict else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
