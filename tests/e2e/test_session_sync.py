"""Session sync in the cluster lab (docs/sync.md): the BIRD router spreads 300 long-lived
TCP streams (every byte verified) and 32 UDP flows over the LB nodes by ECMP, to a Maglev
VIP and a Beamer VIP. A backend is added, so that the tables no longer map every old flow
to its backend; only a node's session keeps such a flow where it was. Then the nodes go
through (a) a SIGKILL (the node comes back rebuilt: no pin, no session), (b) a black
hole (its bridge port stops forwarding; then forwards again), (d) a restart of a
daemon, and (c) a fourth node joining.

With sync on, no flow breaks in any of them, and a node that starts announces only after
every peer's copy matched (its log says so before it announces). With sync off the same
events break flows that ECMP moves to a node without their session: counted and printed
for the comparison (and required to be some, or the scenario would prove nothing).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from xdplb.lab.cluster import (
    Event,
    RouteReader,
    bgp_section,
    bring_back,
    log_since,
    sync_section,
    take_out,
    wait_route,
)
from xdplb.lab.cluster_flows import ADDED, PREFIXES, Flows, Kind, cluster, vips
from xdplb.lab.lbnode import LbNode
from xdplb.lab.topology import Lab
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e


def node_config(lab: Lab, node: str, backends: list[str], sync: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {"bgp": bgp_section(lab)}
    if sync:
        # lb4 is a peer from the start, and down until it joins: not waited for long.
        extra["sync"] = sync_section(lab, node, lab.lbs, unreachable_after=1.0)
    # Beamer moves every bucket a change asks for at once (its later hops keep the old
    # owners): the whole change is live when the reload is.
    return {"vips": vips(lab, backends, beamer={"min_interval": 0, "max_step": 1}), **extra}


def sync_status(node: LbNode) -> dict[str, Any]:
    with node.api() as api:
        st = api.get("/api/v1/status").json()
    return st["cluster"]["sync"]  # type: ignore[no-any-return]


def wait_synced(node: LbNode) -> dict[str, Any]:
    return wait_for(
        lambda: sync_status(node),
        f"{node.node} synced with its peers",
        until=lambda s: s["ready"],
        timeout=30,
    )


class Events:
    """The scenario, one event at a time, with the flows' breakage counted per event."""

    def __init__(self, lab: Lab, tmp: Path, stack: ExitStack, sync: bool) -> None:
        self.lab, self.sync = lab, sync
        self.first = [b for b in lab.backends if b != ADDED]
        self.backends = self.first
        self.nodes = [
            LbNode(lab, tmp, node=n, **node_config(lab, n, self.first, sync)) for n in lab.lbs
        ]
        self.in_route = self.nodes[:3]
        for n in self.in_route:
            n.start(wait=False)
        for n in self.in_route:
            n.wait_applied(30)
        wait_route(lab, PREFIXES, [n.node for n in self.in_route], "three nodes in the route")
        self.flows = Flows(lab, stack)
        self.broken: dict[str, dict[Kind, int]] = {}

    def names(self) -> list[str]:
        return [n.node for n in self.in_route]

    def settle(self, what: str, mark: dict[str, list[int]]) -> None:
        broke = self.flows.settle(mark)
        self.broken[what] = {k: len(v) for k, v in broke.items()}
        print(f"{what}: broken {self.broken[what]}")

    def change_backends(self) -> None:
        mark = self.flows.mark()
        self.backends = self.lab.backends
        for n in self.in_route:
            n.reload(**node_config(self.lab, n.node, self.backends, self.sync))
        self.settle(f"{ADDED} added", mark)

    def come_back(self, node: LbNode, what: str, start: Any) -> None:
        """Start ``node`` (``start()``) and wait until the router has it again; with sync,
        its log says it synced before it announced."""
        offset = node.log_path.stat().st_size if node.log_path.exists() else 0
        node.write(**node_config(self.lab, node.node, self.backends, self.sync))
        mark = self.flows.mark()
        start()
        if node not in self.in_route:
            self.in_route.append(node)
        wait_route(self.lab, PREFIXES, self.names(), f"{node.node} in the route")
        if self.sync:
            st = wait_synced(node)
            log = log_since(node, offset)
            synced = log.find("session sync: synced with")
            announced = log.find("xdplb.cluster announcing")
            assert 0 <= synced < announced, log
            for p in st["peers"]:
                if p["node"] in self.names():  # the others are down: not waited for
                    assert p["copies"] >= 1 and p["state"] == "synced", p
            print(f"{what}: copies {[(p['node'], p['last_copy_entries']) for p in st['peers']]}")
        self.settle(what, mark)

    def kill(self, node: LbNode) -> None:
        mark = self.flows.mark()
        with RouteReader(self.lab) as routes:
            take_out(node, Event.KILL)
            self.in_route.remove(node)
            routes.wait_out(PREFIXES, node.node)
        self.settle(f"SIGKILL of {node.node}", mark)
        node.destroy()  # it comes back as after a reboot: no pin, no session

    def blackhole(self, node: LbNode) -> None:
        mark = self.flows.mark()
        with RouteReader(self.lab) as routes:
            take_out(node, Event.BLACKHOLE)
            self.in_route.remove(node)
            routes.wait_out(PREFIXES, node.node)
        self.settle(f"black hole of {node.node}", mark)
        mark = self.flows.mark()
        bring_back(node, Event.BLACKHOLE)
        self.in_route.append(node)
        wait_route(self.lab, PREFIXES, self.names(), f"{node.node} forwarding again")
        self.settle(f"{node.node} out of the black hole", mark)

    def restart(self, node: LbNode) -> None:
        mark = self.flows.mark()
        with RouteReader(self.lab) as routes:
            take_out(node, Event.STOP)
            self.in_route.remove(node)
            routes.wait_out(PREFIXES, node.node)
        self.settle(f"stop of {node.node}", mark)
        self.come_back(node, f"restart of {node.node}", lambda: bring_back(node, Event.STOP))

    def total(self) -> dict[Kind, int]:
        out: dict[Kind, int] = {}
        for per in self.broken.values():
            for k, n in per.items():
                out[k] = out.get(k, 0) + n
        return out


def test_no_flow_breaks_with_session_sync(tmp_path: Path) -> None:
    with cluster(lbs=4, backends=4) as lab, ExitStack() as stack:
        ev = Events(lab, tmp_path, stack, sync=True)
        lb1, lb2, lb3, lb4 = ev.nodes
        for n in ev.in_route:
            wait_synced(n)
        ev.change_backends()
        ev.kill(lb3)  # (a)
        ev.come_back(lb3, f"{lb3.node} back, rebuilt", lb3.start)
        ev.blackhole(lb2)  # (b)
        ev.restart(lb1)  # (d)
        ev.come_back(lb4, f"{lb4.node} joining", lb4.start)  # (c)
        assert {n.node for n in ev.in_route} == set(lab.lbs)
        print(f"broken in all: {ev.total()}")
        assert ev.broken and all(n == 0 for n in ev.total().values()), ev.broken
        st = sync_status(lb4)
        assert st["refused"] == {} and st["peers"], st


def test_without_session_sync_flows_break(tmp_path: Path) -> None:
    """The comparison: the same backend change, then (a) and (c) without sync."""
    with cluster(lbs=4, backends=4) as lab, ExitStack() as stack:
        ev = Events(lab, tmp_path, stack, sync=False)
        lb3, lb4 = ev.nodes[2:]
        ev.change_backends()
        ev.kill(lb3)
        ev.come_back(lb3, f"{lb3.node} back, rebuilt", lb3.start)
        ev.come_back(lb4, f"{lb4.node} joining", lb4.start)
        total = ev.total()
        print(f"without session sync, broken in all: {total}")
        assert total[("maglev", "tcp")] > 0, ev.broken
