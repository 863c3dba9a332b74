"""Connections through a cluster's events (docs/cluster.md): three LB nodes behind the
BIRD router, long-lived TCP streams (every byte verified) and UDP flows to a Maglev VIP
and a Beamer VIP, then one node leaves (:class:`xdplb.lab.cluster.Event`: its daemon
stopped or killed, its uplink down, or the node black-holed) and comes back.

Which node carries each flow is read from the nodes' session tables before and after
the event (:func:`xdplb.lab.cluster.carriers`). ECMP on the router moves the flows of the
node that left, and, hash-threshold being what it is, some flows of nodes that stayed;
both are "moved" here. The facts asserted: the route loses the node, and gets it back
with the node carrying flows again; a flow whose node stayed the same does not break;
every node holds the same tables, so a moved flow reaches the backend it had (Maglev and
Beamer alike) and does not break either; a node whose uplink goes down sees its carrier
go, a black-holed one sees nothing (the router's BFD takes it out). How many moved and
how long the route took is printed, not asserted (``bench/cluster_bench.py`` times the
events).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.cluster import (
    Event,
    RouteReader,
    Tally,
    UdpFlows,
    bgp_section,
    bring_back,
    carriers,
    flow_key,
    log_since,
    session_ages,
    table_differences,
    take_out,
    wait_route,
)
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode, start_nodes
from xdplb.lab.paced import PacedStreams
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

#: table kind -> VIP address (echo on TCP 7, UDP echo on 53 at each).
VIPS = {"maglev": "198.18.100.1", "beamer": "198.18.100.2"}
ECHO, UDP = 7, 53
#: Long-lived TCP streams per VIP (300 in all), each exchanging SIZE bytes every PERIOD s.
STREAMS, SIZE, PERIOD = 150, 512, 0.2
UDP_FLOWS = 16
#: The node each event is done to.
VICTIM = {Event.STOP: 0, Event.KILL: 1, Event.UPLINK_DOWN: 2, Event.BLACKHOLE: 1}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Lab]:
    cleanup_stale()
    with Lab(lbs=3, router=True, vips=list(VIPS.values())) as lab:
        for b in lab.backends:
            attach_host(lab, b)
        lab.start_servers()  # killed at the lab's teardown
        yield lab


def vips(lab: Lab) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    return [
        {"address": addr, "port": port, "protocol": proto, "table": table, "backends": backends}
        for table, addr in VIPS.items()
        for port, proto in ((ECHO, "tcp"), (UDP, "udp"))
    ]


@pytest.fixture(scope="module")
def nodes(cluster: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LbNode]]:
    tmp = tmp_path_factory.mktemp("nodes")
    made = [
        LbNode(cluster, tmp, vips(cluster), node=n, bgp=bgp_section(cluster)) for n in cluster.lbs
    ]
    try:
        start_nodes(made)
        yield made
    finally:
        for n in made:
            n.destroy()


@pytest.fixture
def ready(cluster: Lab, nodes: list[LbNode]) -> list[LbNode]:
    """Every node up and in the route (a failed test may have left one out)."""
    start_nodes([n for n in nodes if n.proc is None or n.proc.poll() is not None])
    wait_route(cluster, list(VIPS.values()), cluster.lbs, "every node in the route")
    assert table_differences(nodes) == []  # what lets a moved flow keep its backend
    return nodes


@pytest.mark.parametrize("event", list(Event), ids=[e.value for e in Event])
def test_flows_through_a_node_leaving_and_coming_back(
    cluster: Lab, ready: list[LbNode], event: Event
) -> None:
    lab, nodes = cluster, ready
    victim = nodes[VICTIM[event]]
    prefixes = list(VIPS.values())
    with ExitStack() as stack:
        streams = {
            t: stack.enter_context(
                PacedStreams(lab.ns("client"), vip, ECHO, n=STREAMS, size=SIZE, period=PERIOD)
            )
            for t, vip in VIPS.items()
        }
        t_start = time.monotonic()
        udp = {t: UdpFlows(lab, vip, UDP_FLOWS, UDP) for t, vip in VIPS.items()}
        for u in udp.values():
            stack.callback(u.close)
        udp_before = {t: u.backends() for t, u in udp.items()}
        keys = {
            (t, "tcp"): [flow_key(lab, vip, p, ECHO) for p in streams[t].ports]
            for t, vip in VIPS.items()
        } | {
            (t, "udp"): [flow_key(lab, vip, p, UDP, socket.IPPROTO_UDP) for p in udp[t].ports]
            for t, vip in VIPS.items()
        }
        every_key = [k for ks in keys.values() for k in ks]
        name = {k: f"{t} {proto} #{i}" for (t, proto), ks in keys.items() for i, k in enumerate(ks)}
        for s in streams.values():
            wait_for(lambda s=s: min(s.verified()), "every stream's first exchange")  # type: ignore[misc]
        before = wait_for(
            lambda: carriers(nodes, every_key, max_age=time.monotonic() - t_start + 1.0),
            "a node for every flow in the session tables",
            until=lambda c: None not in c.values(),
        )
        assert set(before.values()) == set(lab.lbs)  # ECMP spreads them

        log_offset = victim.log_path.stat().st_size
        with RouteReader(lab) as routes:
            t0 = take_out(victim, event)
            gone = routes.wait_out(prefixes, victim.node)
        out_ms = {p: round((at - t0) * 1000) for p, at in gone.items()}
        mark = {t: s.verified() for t, s in streams.items()}
        stalled = {t: s.wait_resumed(mark[t]) for t, s in streams.items()}
        # The newest session of each flow names its node: the node that left sees none.
        # The UDP flows keep exchanging meanwhile, each reply naming its backend.
        udp_seen = {t: [{b} for b in u.backends()] for t, u in udp.items()}

        def on_victim() -> list[str]:
            for t, u in udp.items():
                for seen, b in zip(udp_seen[t], u.backends(), strict=True):
                    seen.add(b)
            ages = session_ages(nodes, every_key)
            return [
                f"{name[k]}: {a}"
                for k, a in ages.items()
                if min(a, key=a.__getitem__) == victim.node
            ]

        wait_for(on_victim, f"no flow carried by {victim.node} any more", until=lambda v: not v)
        after = carriers(nodes, every_key, max_age=time.monotonic() - t0 + 1.0)

        tallies = {kind: Tally() for kind in keys}
        for (t, proto), ks in keys.items():
            if proto == "tcp":
                broken: dict[int, str] = streams[t].why_broken(stalled[t])
            else:
                pairs = zip(udp_before[t], udp_seen[t], strict=True)
                broken = {i: f"{b0}, then {bs}" for i, (b0, bs) in enumerate(pairs) if bs != {b0}}
            for i, k in enumerate(ks):
                tallies[t, proto].add(after[k] != before[k], broken.get(i))
        print(
            f"\n{event.value} of {victim.node}: out of the route after {out_ms} ms; "
            + "; ".join(f"{t} {proto}: {tally}" for (t, proto), tally in tallies.items())
        )
        for kind, tally in tallies.items():
            assert tally.broken_stayed == [], kind
            assert tally.broken_moved == [], kind
        # The node's own flows moved at least.
        assert all(tallies[t, "tcp"].moved for t in VIPS)
        if event is Event.UPLINK_DOWN:  # the node saw its carrier go
            wait_for(
                lambda: log_since(victim, log_offset),
                "the node withdrawing",
                until=lambda t: "eth0 has no carrier" in t,
            )
        elif event is Event.BLACKHOLE:  # it saw nothing: the router's BFD did
            assert "self-check failed" not in log_since(victim, log_offset)

        # Back: the node returns to the route and carries flows again; none breaks.
        bring_back(victim, event)
        wait_route(lab, prefixes, lab.lbs, f"{victim.node} back in the route")
        mark = {t: s.verified() for t, s in streams.items()}
        back_broken = {}
        for t, s in streams.items():
            stalled[t] = s.wait_resumed(mark[t])
            back_broken[t] = s.why_broken(stalled[t])
        udp_back = {t: u.backends() for t, u in udp.items()}
        wait_for(
            lambda: carriers(nodes, every_key).values(),
            f"{victim.node} carrying flows again",
            until=lambda c: victim.node in c,
        )
        print(f"after the return: broken { {t: len(b) for t, b in back_broken.items()} }")
        for t in VIPS:
            assert back_broken[t] == {}, t
            assert udp_back[t] == udp_before[t], t
