#!/usr/bin/env python3
"""A/B: lb_xdp cases of two or more builds, measured side by side (docs/benchmarks.md).

    .venv/bin/python bench/ab.py old=/path/to/other/checkout new=. [--reps 6] [--rounds 3]
                                 [--iterations 200000] [--cases reference,ipv4_new_flow]
                                 [--conn-table 4096]

Each NAME=ROOT is a checkout whose ``make build`` has run. The builds never share a
process: for each repetition, every build in turn gets a fresh process (its own
``ROOT/src`` and ``ROOT/build``, its own maps), pinned to the last CPU, that warms up
and then measures every case ``--rounds`` times through that checkout's own
bench/bench_harness.py; the order of the builds alternates between repetitions, so
that drift on a shared host falls on all of them. The figure per case is the median of
every sample (and the minimum); a case whose checks fail in a build is reported.
Needs root, like ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

#: The measuring process, run with a checkout's src and build: it loads that checkout's
#: harness and answers "CASE ITERATIONS" lines with "[ns, problems]".
WORKER = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
cpu = max(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpu})
import bench_harness as bh
if os.environ.get("AB_CONN_TABLE"):
    from xdplb.config import parse_config
    entries = int(os.environ["AB_CONN_TABLE"])
    base = bh.lb_config
    def sized(instance):
        d = base(instance)
        d["limits"] = {"conn_table": entries}
        return d
    bh.lb_config = sized
    lim = parse_config(sized("x")).limits
    datapath = bh.LbDatapath
    bh.LbDatapath = lambda instance: datapath(instance, lim=lim)
with bh.Harness(f"ab{os.getpid()}") as h:
    print("ready", flush=True)
    for line in sys.stdin:
        case, n = line.split()
        run = h.measure(case, int(n))
        print(json.dumps([run.ns_per_packet, run.problems[:2]]), flush=True)
"""

DEFAULT_CASES = (
    "reference,ipv4_non_vip,ipv4_known_flow,ipv4_new_flow,"
    "ipv6_non_vip,ipv6_known_flow,ipv6_new_flow"
)


def measure(
    root: Path, cases: list[str], rounds: int, iterations: int, env: dict[str, str]
) -> tuple[dict[str, list[float]], dict[str, list[str]]]:
    """One process of the build at ``root``: a warm-up run of each case, then ``rounds``
    runs of every case; ns per packet of each, and the problems of each case."""
    env = dict(env, PYTHONPATH=str(root / "src"), XDPLB_BUILD_DIR=str(root / "build"))
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(root / "bench")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    samples: dict[str, list[float]] = {c: [] for c in cases}
    problems: dict[str, list[str]] = {}
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the harness of {root} did not start")

        def ask(case: str, n: int) -> tuple[float, list[str]]:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{case} {n}\n")
            proc.stdin.flush()
            ns, probs = json.loads(proc.stdout.readline())
            return float(ns), list(probs)

        for case in cases:
            ask(case, max(iterations // 4, 1000))
        for _ in range(rounds):
            for case in cases:
                ns, probs = ask(case, iterations)
                samples[case].append(ns)
                if probs:
                    problems.setdefault(case, probs)
    finally:
        proc.stdin.close()
        proc.wait()
    return samples, problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", metavar="NAME=ROOT")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=200_000)
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--conn-table", type=int, help="limits.conn_table (default: the bench's)")
    ap.add_argument("--out", type=Path, help="every sample, as JSON")
    args = ap.parse_args(argv)
    builds = [(n, Path(r).resolve()) for n, r in (b.split("=", 1) for b in args.builds)]
    cases = args.cases.split(",")
    env = dict(os.environ)
    if args.conn_table:
        env["AB_CONN_TABLE"] = str(args.conn_table)
    samples = {n: {c: [] for c in cases} for n, _ in builds}
    problems: dict[str, dict[str, list[str]]] = {n: {} for n, _ in builds}
    for rep in range(args.reps):
        for name, root in builds if rep % 2 == 0 else builds[::-1]:
            got, probs = measure(root, cases, args.rounds, args.iterations, env)
            for c in cases:
                samples[name][c] += got[c]
            for c, p in probs.items():
                problems[name].setdefault(c, p)
    print(f"{'ns per packet: median / min':30s}" + "".join(f"{n:>18s}" for n, _ in builds))
    for c in cases:
        row = "".join(
            f"{statistics.median(samples[n][c]):11.1f} /{min(samples[n][c]):5.0f}"
            for n, _ in builds
        )
        print(f"{c:30s}{row}")
    for n, by_case in problems.items():
        for c, p in by_case.items():
            print(f"INVALID {n} {c}: {'; '.join(p)}")
    if args.out:
        args.out.write_text(json.dumps({"samples": samples, "problems": problems}, indent=1))
    return 2 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
