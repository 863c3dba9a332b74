"""Cluster events: from an LB node leaving to the router's kernel route without it.

    .venv/bin/python bench/cluster_bench.py [--rounds 5] [--events stop,kill,...] [--out FILE]

The lab's cluster (docs/cluster.md): three LB nodes running the real daemon, each
announcing an IPv4 and an IPv6 VIP over eBGP with BFD (100 ms x 3, hold time 3 s) to the
BIRD router ``rt``, which installs one multipath route per VIP. Each round does one event
(:class:`xdplb.lab.cluster.Event`) to one node (the rounds take the nodes in turn):

- ``stop``: SIGTERM to the daemon (it withdraws, drains 0.5 s, exits; ``xdplb stop``);
- ``kill``: SIGKILL to the daemon (its BIRD gets SIGTERM and closes its sessions);
- ``uplink_down``: the node's bridge port down (the node loses its carrier);
- ``blackhole``: the node's bridge port disabled (every frame to and from it dropped,
  links up on both ends: only BFD can tell);

and times it to the moment the router's kernel routes to both VIPs no longer list the
node, read over netlink inside ``rt`` back to back (a read takes well under a
millisecond; a time is late by at most one read). The clock starts just before the act:
a signal sent, or the ``ip``/``bridge`` command started (a few ms before it acts). Then
the node is brought back (daemon restarted, port up or forwarding) and the round ends
when the route lists every node again (``back_ms``: BGP's connect retry and error wait,
the node's hold-down).

The issue's targets: ``stop`` and ``uplink_down`` within 500 ms, ``kill`` and
``blackhole`` within 1 s. ``run(rounds)`` returns the dict printed as JSON. Needs root.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import cpu_model
from xdplb.lab import DEFAULT_VIPS, Lab, cleanup_stale
from xdplb.lab.cluster import Event, RouteReader, bgp_section, bring_back, take_out, wait_route
from xdplb.lab.lbnode import LbNode

PREFIXES = [str(v) for v in DEFAULT_VIPS]
#: s between a stopping daemon's withdrawal and its exit (its programs still forward).
DRAIN = 0.5
#: ms from the event to the route without the node (the issue's targets).
TARGET_MS = {Event.STOP: 500, Event.KILL: 1000, Event.UPLINK_DOWN: 500, Event.BLACKHOLE: 1000}


def vips(lab: Lab) -> list[dict[str, Any]]:
    return [
        {
            "address": vip,
            "port": 80,
            "backends": [
                {"address": str(lab.addr(b, 6 if ":" in vip else 4))} for b in lab.backends
            ],
        }
        for vip in PREFIXES
    ]


def _round(lab: Lab, routes: RouteReader, node: LbNode, event: Event) -> dict[str, Any]:
    wait_route(lab, PREFIXES, lab.lbs, "every node in the route")
    t0 = take_out(node, event)
    gone = routes.wait_out(PREFIXES, node.node)
    t1 = time.monotonic()
    bring_back(node, event)
    wait_route(lab, PREFIXES, lab.lbs, f"{node.node} back in the route")
    return {
        "node": node.node,
        "out_ms": round((max(gone.values()) - t0) * 1000, 1),
        "per_vip_ms": {p: round((at - t0) * 1000, 1) for p, at in gone.items()},
        "back_ms": round((time.monotonic() - t1) * 1000),
    }


def _stats(xs: list[float]) -> dict[str, float]:
    return {
        "min": round(min(xs), 1),
        "median": round(statistics.median(xs), 1),
        "max": round(max(xs), 1),
    }


def run(rounds: int = 5, events: list[Event] | None = None) -> dict[str, Any]:
    """``rounds`` of each event (all four by default); results as a dict (module doc)."""
    if os.geteuid() != 0:
        raise PermissionError("the cluster benchmark needs root (network namespaces, BPF)")
    events = list(Event) if events is None else events
    cleanup_stale()
    per_event: dict[str, list[dict[str, Any]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="xdplb-cluster-") as tmp,
        Lab(lbs=3, router=True) as lab,
        RouteReader(lab) as routes,
    ):
        # The lab's teardown destroys the nodes (their pins, their BIRD).
        nodes = [
            LbNode(lab, Path(tmp), vips(lab), node=n, bgp=bgp_section(lab, drain=DRAIN))
            for n in lab.lbs
        ]
        for n in nodes:
            n.start()
        for event in events:
            per_event[event.value] = [
                _round(lab, routes, nodes[r % len(nodes)], event) for r in range(rounds)
            ]
    summary = {}
    for event in events:
        out = [r["out_ms"] for r in per_event[event.value]]
        summary[event.value] = {
            "out_ms": _stats(out),
            "target_ms": TARGET_MS[event],
            "pass": max(out) <= TARGET_MS[event],
            "back_ms": _stats([r["back_ms"] for r in per_event[event.value]]),
        }
    return {
        "summary": summary,
        "rounds": per_event,
        "meta": {
            "rounds": rounds,
            "lb_nodes": 3,
            "vips": PREFIXES,
            "bfd": "100 ms x 3",
            "hold_time_s": 3,
            "drain_s": DRAIN,
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(),
            "kernel": os.uname().release,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of each event")
    ap.add_argument(
        "--events",
        default=",".join(e.value for e in Event),
        help="comma-separated: " + ", ".join(e.value for e in Event),
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    try:
        events = [Event(e) for e in args.events.split(",") if e]
    except ValueError as e:
        ap.error(str(e))
    res = run(args.rounds, events)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for name, s in res["summary"].items():
        o = s["out_ms"]
        mark = "ok" if s["pass"] else "MISSED"
        print(
            f"{name:12} out of the route: min {o['min']:.0f} median {o['median']:.0f} "
            f"max {o['max']:.0f} ms (target {s['target_ms']} ms: {mark})",
            file=sys.stderr,
        )
    print(f"CPU: {res['meta']['cpu_model']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
