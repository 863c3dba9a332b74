"""``make demo``, second part: a cluster of three balancers behind a router.

1. builds the cluster lab: the client behind a router (BIRD 2, ECMP over the balancers),
   three LB nodes, three backends with host_tc and a server each;
2. starts the real daemon on each node: each syncs its sessions with the other two
   (docs/sync.md) and announces the VIP over eBGP with BFD while its self-check passes,
   and the router's route spreads the flows over all three;
3. opens 150 long-lived TCP connections (every byte echoed and checked) and sends 150
   short HTTP requests: which node carried each is read from the nodes' session tables,
   and every node holds every stream's session (session sync);
4. stops one node (``xdplb stop``: it withdraws, then drains): the route loses it in a
   few milliseconds, the router moves its flows to the others, which pick the same
   backends (the same Maglev tables), and no connection breaks;
5. ``xdplb cluster status`` on a node that stayed; then everything is torn down.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.cluster import (
    RouteReader,
    bgp_section,
    carriers,
    flow_key,
    sync_section,
    wait_route,
)
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode, start_nodes
from xdplb.lab.paced import PacedStreams
from xdplb.lab.traffic import http_post
from xdplb.lab.wait import wait_for

VIP = "198.18.100.1"
STREAMS = 150
REQUESTS = range(21000, 21150)

console = Console()


def say(text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _vips(lab: Lab) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    return [{"address": VIP, "port": p, "backends": backends} for p in (7, 80)]


def _spread(title: str, lab: Lab, landed: dict[str, Counter[str]]) -> Table:
    table = Table(title=title)
    table.add_column("LB node")
    for what in landed:
        table.add_column(what, justify="right")
    for node in lab.lbs:
        table.add_row(f"{node} ({lab.addr(node)})", *(str(c[node]) for c in landed.values()))
    return table


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a kill tears the lab down, as Ctrl-C does
    cleanup_stale()
    console.print(
        Panel.fit(
            "client ─► router rt (BIRD 2, ECMP by ports) ─► LB nodes lb · lb2 · lb3 "
            "(eBGP + BFD, each announcing the VIP) ─GUE─► b1 · b2 · b3",
            title="xdplb demo: a cluster of balancers",
        )
    )
    with tempfile.TemporaryDirectory() as tmp, Lab(lbs=3, router=True) as lab:
        for b in lab.backends:
            attach_host(lab, b)
        lab.start_servers()
        nodes = [
            LbNode(
                lab,
                Path(tmp),
                _vips(lab),
                node=n,
                bgp=bgp_section(lab),
                sync=sync_section(lab, n, lab.lbs, unreachable_after=2.0),
            )
            for n in lab.lbs
        ]
        start_nodes(nodes)
        wait_route(lab, [VIP], lab.lbs, "the router routing the VIP over every node")
        with RouteReader(lab) as routes:
            say(f"router: {VIP} via {', '.join(routes.nexthops(VIP))} (one multipath route)\n")
            tour(lab, nodes, routes)
    say("cluster torn down: namespaces, BIRD, daemons, pins and run files removed.")
    return 0


def _sessions(node: LbNode, keys: list[bytes]) -> set[bytes]:
    """The flows of ``keys`` that have a session in the node's table (its own or synced)."""
    want = set(keys)
    with node.maps() as maps:
        return {e.key for e in maps.conns.iter_entries() if e.key in want}


def tour(lab: Lab, nodes: list[LbNode], routes: RouteReader) -> None:
    client = lab.ns("client")
    with PacedStreams(client, VIP, 7, n=STREAMS, size=512, period=0.2) as streams:
        keys = [flow_key(lab, VIP, p, 7) for p in streams.ports]
        wait_for(lambda: min(streams.verified()), "every stream's first exchange")
        before = wait_for(
            lambda: carriers(nodes, keys),
            "every stream seen by a node",
            until=lambda c: None not in c.values(),
        )
        for p in REQUESTS:
            http_post(client, VIP, 80, os.urandom(64), src_port=p)
        requests = [flow_key(lab, VIP, p, 80) for p in REQUESTS]
        short = Counter(str(n) for n in carriers(nodes, requests, max_age=30.0).values())
        console.print(
            _spread(
                "Where the flows went (the router hashes their ports)",
                lab,
                {"long-lived": Counter(str(n) for n in before.values()), "HTTP requests": short},
            )
        )

        held = {n.node: len(_sessions(n, keys)) for n in nodes}
        say(
            "\nsession sync: every node holds every stream's session, its own and its "
            "peers' (" + ", ".join(f"{n} {k} of {STREAMS}" for n, k in held.items()) + ")"
        )

        leaving = nodes[1]
        say(f"\nxdplb stop on {leaving.node}: it withdraws the VIP, drains 0.5 s, exits ...")
        t0 = time.monotonic()
        assert leaving.proc is not None
        leaving.proc.send_signal(signal.SIGTERM)
        gone = routes.wait_out([VIP], leaving.node)
        say(
            f"the router's route lost {leaving.node} {1000 * (gone[VIP] - t0):.0f} ms later: "
            f"{VIP} via {', '.join(routes.nexthops(VIP))}"
        )
        stalled = streams.wait_resumed(streams.verified())
        after = wait_for(
            lambda: carriers(nodes, keys),
            "every stream on a node that stayed",
            until=lambda c: leaving.node not in c.values() and None not in c.values(),
        )
        moved = sum(before[k] != after[k] for k in keys)
        broken = streams.why_broken(stalled)
        say(
            f"{moved} of {STREAMS} long-lived connections moved to another node, "
            f"{len(broken)} broke: every node holds the same Maglev table and every "
            "flow's session, so a moved flow reaches the backend it had."
        )
        assert leaving.proc is not None
        leaving.proc.wait(10)  # its drain, then its exit
    out = nodes[0].cli("cluster", "status")
    say(f"\nxdplb cluster status -i {nodes[0].instance}:\n{out.stdout or out.stderr}")


if __name__ == "__main__":
    raise SystemExit(main())
