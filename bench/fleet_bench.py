"""The fleet's store: from a revision written to etcd to its table live on every node.

    .venv/bin/python bench/fleet_bench.py [--rounds 10] [--out FILE]

The lab's cluster (docs/cluster.md, "Fleet state"): a real etcd (Debian's, in the
client's namespace) and three LB nodes running the real daemon, whose files name the
store and no VIP. Each round writes a revision of the fleet's document that changes the
VIP's backends (three, then two, in turn) and times, from just before ``etcdctl put``,
until every node's lookup table in its pinned maps has the new backends' shares (read
back to back). ``put_ms`` is ``etcdctl``'s own time (a process start in a namespace),
included in ``live_ms``. Needs root.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import cpu_model
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.etcd import Etcd
from xdplb.lab.lbnode import LbNode

VIP = "198.18.100.1"
KEY = "/xdplb/config"
TIMEOUT = 30.0


def document(backends: list[str]) -> str:
    vips = [{"address": VIP, "port": 80, "backends": [{"address": b} for b in backends]}]
    return yaml.safe_dump({"vips": vips})


def serving(node: LbNode) -> set[str]:
    """The backends the VIP's table sends new flows to on ``node`` (empty: no table)."""
    with node.maps() as maps:
        snap = maps.snapshot()
    for vip, params in snap.vips.items():
        table = snap.tables.get(params.vip_id)
        if str(vip.addr) == VIP and table is not None:
            return {str(snap.backends[i].addr) for i in table.counts()}
    return set()


def _round(etcd: Etcd, nodes: list[LbNode], backends: list[str]) -> dict[str, float]:
    want = set(backends)
    t0 = time.monotonic()
    etcd.put(KEY, document(backends))
    put = time.monotonic()
    pending = list(nodes)
    at: dict[str, float] = {}
    while pending:
        if time.monotonic() - t0 > TIMEOUT:
            raise TimeoutError(f"{[n.node for n in pending]} not serving {want} after {TIMEOUT} s")
        for n in list(pending):
            if serving(n) == want:
                at[n.node] = time.monotonic()
                pending.remove(n)
    return {
        "put_ms": round((put - t0) * 1000, 1),
        "live_ms": round((max(at.values()) - t0) * 1000, 1),
        "first_node_ms": round((min(at.values()) - t0) * 1000, 1),
    }


def run(rounds: int = 10) -> dict[str, Any]:
    if os.geteuid() != 0:
        raise PermissionError("the fleet benchmark needs root (network namespaces, BPF)")
    cleanup_stale()
    with tempfile.TemporaryDirectory(prefix="xdplb-fleet-") as tmp, Lab(lbs=3, router=True) as lab:
        etcd = Etcd(lab, Path(tmp) / "etcd")
        etcd.start()
        cluster = {"store": etcd.url, "lease_ttl": 3}
        nodes = [LbNode(lab, Path(tmp), [], node=n, cluster=cluster) for n in lab.lbs]
        for n in nodes:
            n.start()
        addrs = [str(lab.addr(b)) for b in lab.backends]
        results = [_round(etcd, nodes, addrs if r % 2 == 0 else addrs[:2]) for r in range(rounds)]
        etcd.kill()
    live = [r["live_ms"] for r in results]
    return {
        "summary": {
            "live_ms": {
                "min": min(live),
                "median": statistics.median(live),
                "max": max(live),
            },
            "put_ms_median": statistics.median(r["put_ms"] for r in results),
        },
        "rounds": results,
        "meta": {
            "lb_nodes": len(nodes),
            "etcd": "Debian etcd-server, one member",
            "table_size": 65537,
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(),
            "kernel": os.uname().release,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    res = run(args.rounds)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    s = res["summary"]["live_ms"]
    print(
        f"revision to every node's table: min {s['min']:.0f} median {s['median']:.0f} "
        f"max {s['max']:.0f} ms; CPU: {res['meta']['cpu_model']}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
