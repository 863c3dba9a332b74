"""Connections through changes of a cluster (docs/cluster.md, "Connections when a node
leaves"): long-lived TCP streams (every byte verified) and UDP flows to a Maglev VIP and
a Beamer VIP over the LB nodes behind the BIRD router, counted per VIP kind as flows that
stayed on their node, moved to another, and broke.

- A fourth node joins three: the router re-splits the flows over four, and every node
  holds the same tables, so no flow breaks (asserted), moved or not.
- A backend is removed and another added while a node is out (its daemon stopped): the
  two nodes in the route are reloaded, then the third comes back with the new
  configuration, either restarted on its pinned maps (its sessions and Beamer tables as
  it left them) or rebuilt (its maps gone, as after a reboot). Without session sync, a
  flow that ECMP moves to a node with no session of it survives only where that node's
  table picks the backend it has: the rebuilt node breaks some, Maglev and Beamer (its
  Beamer table, built afresh, has no history), and that is counted and printed, not
  hidden. Asserted: what is guaranteed (the node leaving breaks nothing; a TCP stream
  that stays on its node keeps its backend, the removed one too; the route gets the node
  back; the Maglev tables are equal at the end).

Which node carries a flow is read from the nodes' session tables
(:func:`xdplb.lab.cluster.carriers`); a UDP flow counts as broken when another backend
answers it (those of a removed backend do by design: its UDP sessions end with it).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from xdplb.lab.cluster import (
    STOP_WAIT,
    Event,
    RouteReader,
    bgp_section,
    bring_back,
    table_differences,
    take_out,
    wait_route,
)
from xdplb.lab.cluster_flows import ADDED, PREFIXES, REMOVED, VIPS, Flows, cluster, summary, vips
from xdplb.lab.lbnode import LbNode, start_nodes

pytestmark = pytest.mark.e2e


def test_a_fourth_node_joining(tmp_path: Path) -> None:
    with cluster(lbs=4, backends=3) as lab, ExitStack() as stack:
        nodes = [
            LbNode(lab, tmp_path, vips(lab, lab.backends), node=n, bgp=bgp_section(lab))
            for n in lab.lbs
        ]
        old, new = nodes[:3], nodes[3]
        start_nodes(old)
        wait_route(lab, PREFIXES, lab.lbs[:3], "three nodes in the route")
        flows = Flows(lab, stack)
        before = flows.carriers(old, lab.lbs[:3], flows.t_start)
        assert set(before.values()) == set(lab.lbs[:3])  # ECMP spreads them

        t0 = time.monotonic()
        new.start()
        assert table_differences(nodes) == []  # what lets a moved flow keep its backend
        took = wait_route(lab, PREFIXES, lab.lbs, f"{new.node} in the route")
        in_ms = round((time.monotonic() - t0) * 1000)
        broke = flows.settle(flows.mark())
        after = flows.carriers(nodes, lab.lbs, t0)

        tallies = flows.tally(before, after, broke)
        to_new = {
            kind: sum(after.get(k) == new.node for k in ks) for kind, ks in flows.keys.items()
        }
        print(
            f"\n{new.node} joining: started and in the route after {in_ms} ms "
            f"(the route {round(took * 1000)} ms after its daemon had started); "
            + "; ".join(
                f"{t} {proto}: {tally}, {to_new[t, proto]} to {new.node}"
                for (t, proto), tally in tallies.items()
            )
        )
        for kind, tally in tallies.items():
            assert tally.broken_stayed == [], kind
            assert tally.broken_moved == [], kind
        # The new node took its share of the streams.
        assert all(to_new[t, "tcp"] for t in VIPS)


@pytest.mark.parametrize("rebuilt", [False, True], ids=["restarted", "rebuilt"])
def test_backends_changed_while_a_node_is_out(tmp_path: Path, rebuilt: bool) -> None:
    """``restarted``: the node's daemon is started again on its pinned maps (its sessions
    and Beamer tables as it left them); ``rebuilt``: its maps are gone too (a machine
    rebooted while out), it starts with no session and builds its tables afresh."""
    with cluster(lbs=3, backends=4) as lab, ExitStack() as stack:
        first = [b for b in lab.backends if b != ADDED]
        then = [b for b in lab.backends if b != REMOVED]
        nodes = [
            LbNode(lab, tmp_path, vips(lab, first), node=n, bgp=bgp_section(lab)) for n in lab.lbs
        ]
        start_nodes(nodes)
        wait_route(lab, PREFIXES, lab.lbs, "every node in the route")
        assert table_differences(nodes) == []
        out = nodes[1]
        rest = [n.node for n in nodes if n is not out]
        flows = Flows(lab, stack)
        before = flows.carriers(nodes, lab.lbs, flows.t_start)
        assert set(before.values()) == set(lab.lbs)

        # 1. The node leaves (its daemon stopped: its maps and sessions stay pinned).
        with RouteReader(lab) as routes:
            t0 = take_out(out, Event.STOP)
            routes.wait_out(PREFIXES, out.node)
        out_ms = round((time.monotonic() - t0) * 1000)
        broke = flows.settle(flows.mark())
        left = flows.carriers(nodes, rest, t0)
        tallies = flows.tally(before, left, broke)
        print(f"\nstop of {out.node}: out of the route after {out_ms} ms; {summary(tallies)}")
        for kind, tally in tallies.items():  # every node holds the same tables
            assert tally.broken_stayed == [], kind
            assert tally.broken_moved == [], kind

        # 2. The nodes in the route drop a backend and take a new one. No flow moves node.
        t0 = time.monotonic()
        for n in nodes:
            if n is not out:
                n.reload(vips(lab, then), bgp=bgp_section(lab))
        assert table_differences([n for n in nodes if n is not out]) == []
        broke = flows.settle(flows.mark())
        moved_on = flows.carriers(nodes, rest, t0)
        on_removed = flows.tally(left, moved_on, broke, on=[REMOVED])
        on_others = flows.tally(left, moved_on, broke, on=[b for b in first if b != REMOVED])
        print(
            f"{REMOVED} removed, {ADDED} added on {rest}: on {REMOVED}: {summary(on_removed)}; "
            f"on the others: {summary(on_others)}"
        )
        for tallies in (on_removed, on_others):
            for kind, tally in tallies.items():
                assert tally.moved == 0, kind
                # A stream's session keeps it on its backend: a removed backend's slot is
                # retired, not reused (Maglev), or stays a later hop (Beamer).
                if kind[1] == "tcp":
                    assert tally.broken_stayed == [], kind

        # 3. The node comes back with the new configuration.
        out.write(vips(lab, then), bgp=bgp_section(lab))
        t0 = time.monotonic()
        if rebuilt:
            assert out.proc is not None
            out.proc.wait(STOP_WAIT)
            out.destroy()  # detached, every pin gone
            out.start()
        else:
            bring_back(out, Event.STOP)
        wait_route(lab, PREFIXES, lab.lbs, f"{out.node} back in the route")
        back_ms = round((time.monotonic() - t0) * 1000)
        broke = flows.settle(flows.mark())
        back = flows.carriers(nodes, lab.lbs, t0)
        on_removed = flows.tally(moved_on, back, broke, on=[REMOVED])
        on_others = flows.tally(moved_on, back, broke, on=[b for b in first if b != REMOVED])
        differ = table_differences(nodes)
        print(
            f"{out.node} back ({'rebuilt' if rebuilt else 'restarted'}) with the new "
            f"configuration after {back_ms} ms: on {REMOVED}: {summary(on_removed)}; "
            f"on the others: {summary(on_others)}; tables that differ: {differ or 'none'}"
        )
        print(f"broken in all: { {kind: len(b) for kind, b in flows.broken.items()} }")
        for tallies in (on_removed, on_others):
            for kind, tally in tallies.items():
                if kind[1] == "tcp":  # a stream that stays on its node has its session
                    assert tally.broken_stayed == [], kind
        assert [d for d in differ if d.startswith(VIPS["maglev"])] == []
        assert all(n.node in back.values() for n in nodes)  # the node carries flows again
