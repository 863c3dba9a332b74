"""The fleet's store: from a revision written to etcd to its table live on every node,
and from a backend failing to every node agreeing it is down.

    .venv/bin/python bench/fleet_bench.py [--rounds 10] [--out FILE]

The lab's cluster (docs/cluster.md, "Fleet state"): a real etcd (Debian's, in the
client's namespace) and three LB nodes running the real daemon, whose files name the
store and no VIP. Each round writes a revision of the fleet's document that changes the
VIP's backends (three, then two, in turn) and times, from just before ``etcdctl put``,
until every node's lookup table in its pinned maps has the new backends' shares (read
back to back). ``put_ms`` is ``etcdctl``'s own time (a process start in a namespace),
included in ``live_ms``.

Then the failures: the VIP checked over HTTP every 300 ms (fall and rise after 2), each
round makes b1 stop answering every node's checks (a blackhole route on b1 to the three
nodes' addresses, set one after the other, a few ms) and times until every node's table has
dropped b1 (``agreed_ms``: the checks' fall, each node's report, the others reading it
every 0.5 s, the plan); then b1 answers again and the round waits for it to be back
everywhere. Needs root.
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
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.wait import wait_for

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


def checked(backends: list[str]) -> str:
    check = {
        "checker": {"http": {"uri": "/", "codes": [200]}},
        "interval_ms": 300,
        "timeout_ms": 200,
        "fall_count": 2,
        "rise_count": 2,
    }
    vip = {
        "address": VIP,
        "port": 80,
        "health": check,
        "backends": [{"address": b} for b in backends],
    }
    return yaml.safe_dump({"vips": [vip]})


def wait_serving(nodes: list[LbNode], want: set[str], t0: float) -> list[float]:
    """Until every node's table sends to ``want``; seconds from ``t0``, per node."""
    pending, at = list(nodes), {}
    while pending:
        if time.monotonic() - t0 > TIMEOUT:
            raise TimeoutError(f"{[n.node for n in pending]} not serving {want} after {TIMEOUT} s")
        for n in list(pending):
            if serving(n) == want:
                at[n.node] = time.monotonic() - t0
                pending.remove(n)
    return list(at.values())


def checks_up(node: LbNode) -> bool:
    with node.api() as api:
        st = api.get("/api/v1/status").json()
    return bool(st["vips"]) and all(b["health"] == "up" for b in st["vips"][0]["backends"])


def _failure(lab: Lab, nodes: list[LbNode], addrs: list[str]) -> dict[str, float]:
    """b1 stops answering every node's checks; until every table has dropped it."""
    b1 = lab.backends[0]
    routes = [f"{lab.addr(n.node)}/32" for n in nodes]

    def blackholes(verb: str) -> None:
        for r in routes:
            lab.run(b1, ["ip", "route", verb, "blackhole", r])

    t0 = time.monotonic()
    blackholes("add")
    agreed = wait_serving(nodes, set(addrs[1:]), t0)
    t1 = time.monotonic()
    blackholes("del")
    back = wait_serving(nodes, set(addrs), t1)
    return {"agreed_ms": round(max(agreed) * 1000, 1), "back_ms": round(max(back) * 1000, 1)}


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
        for b in lab.backends:
            attach_host(lab, b)  # host_tc: the checks come through the tunnel
        lab.start_servers()
        etcd.put(KEY, checked(addrs))
        wait_serving(nodes, set(addrs), time.monotonic())
        for n in nodes:  # every node's own checks up (not the fail-open of all down)
            wait_for(lambda n=n: checks_up(n), f"{n.node}'s checks up", timeout=TIMEOUT)
        failures = [_failure(lab, nodes, addrs) for _ in range(rounds)]
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
            "agreed_ms": {
                "min": min(f["agreed_ms"] for f in failures),
                "median": statistics.median(f["agreed_ms"] for f in failures),
                "max": max(f["agreed_ms"] for f in failures),
            },
        },
        "rounds": results,
        "failures": failures,
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
    for key, what in (
        ("live_ms", "revision to every node's table"),
        ("agreed_ms", "failure to every node agreeing"),
    ):
        s = res["summary"][key]
        print(
            f"{what}: min {s['min']:.0f} median {s['median']:.0f} max {s['max']:.0f} ms",
            file=sys.stderr,
        )
    print(f"CPU: {res['meta']['cpu_model']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
