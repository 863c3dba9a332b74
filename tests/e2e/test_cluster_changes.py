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

import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.cluster import (
    STOP_WAIT,
    Event,
    RouteReader,
    Tally,
    UdpFlows,
    bgp_section,
    bring_back,
    carriers,
    flow_key,
    table_differences,
    take_out,
    wait_route,
)
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.paced import PacedStreams
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

#: table kind -> VIP address (echo on TCP 7, UDP echo on 53 at each).
VIPS = {"maglev": "198.18.100.1", "beamer": "198.18.100.2"}
PREFIXES = list(VIPS.values())
ECHO, UDP = 7, 53
#: Long-lived TCP streams per VIP (300 in all), each exchanging SIZE bytes every PERIOD s.
STREAMS, SIZE, PERIOD = 150, 512, 0.2
UDP_FLOWS = 16
#: The backend removed and the one added while a node is out.
REMOVED, ADDED = "b2", "b4"

Kind = tuple[str, str]  # (table kind, "tcp" or "udp")


def vips(lab: Lab, backends: Sequence[str]) -> list[dict[str, Any]]:
    members = [{"address": str(lab.addr(b))} for b in backends]
    return [
        {"address": addr, "port": port, "protocol": proto, "table": table, "backends": members}
        for table, addr in VIPS.items()
        for port, proto in ((ECHO, "tcp"), (UDP, "udp"))
    ]


@contextmanager
def cluster(lbs: int, backends: int) -> Iterator[Lab]:
    """A router lab with host_tc and the servers on every backend."""
    cleanup_stale()
    with Lab(lbs=lbs, backends=backends, router=True, vips=PREFIXES) as lab:
        for b in lab.backends:
            attach_host(lab, b)
        lab.start_servers()  # killed at the lab's teardown
        yield lab


class Flows:
    """STREAMS TCP streams and UDP_FLOWS UDP flows to each VIP, their flow keys, and what
    they went through."""

    def __init__(self, lab: Lab, stack: ExitStack) -> None:
        self.t_start = time.monotonic()
        self.streams = {
            t: stack.enter_context(
                PacedStreams(lab.ns("client"), vip, ECHO, n=STREAMS, size=SIZE, period=PERIOD)
            )
            for t, vip in VIPS.items()
        }
        self.udp = {t: UdpFlows(lab, vip, UDP_FLOWS, UDP) for t, vip in VIPS.items()}
        for u in self.udp.values():
            stack.callback(u.close)
        self.keys: dict[Kind, list[bytes]] = {
            (t, "tcp"): [flow_key(lab, vip, p, ECHO) for p in self.streams[t].ports]
            for t, vip in VIPS.items()
        } | {
            (t, "udp"): [flow_key(lab, vip, p, UDP, socket.IPPROTO_UDP) for p in self.udp[t].ports]
            for t, vip in VIPS.items()
        }
        self.every_key = [k for ks in self.keys.values() for k in ks]
        #: The backend of each flow at the start.
        self.backends: dict[Kind, list[str]] = {
            (t, "tcp"): s.backends for t, s in self.streams.items()
        } | {(t, "udp"): u.backends() for t, u in self.udp.items()}
        for s in self.streams.values():
            wait_for(lambda s=s: min(s.verified()), "every stream's first exchange")  # type: ignore[misc]
        #: Why each flow broke (index -> reason), per kind, accumulated over the phases.
        self.broken: dict[Kind, dict[int, str]] = {k: {} for k in self.keys}

    def carriers(
        self, nodes: Sequence[LbNode], names: Sequence[str], since: float
    ) -> dict[bytes, str | None]:
        """The node of every flow: the newest of its sessions that saw a packet after
        ``since`` (time.monotonic()), once every flow that did not break has one on a node
        of ``names`` (the UDP flows exchange first, so their newest session is of now). A
        flow that broke is where its last packet went."""
        live = [
            k
            for kind, ks in self.keys.items()
            for i, k in enumerate(ks)
            if i not in self.broken[kind]
        ]

        def read() -> dict[bytes, str | None]:
            self.exchange_udp()
            return carriers(nodes, self.every_key, max_age=time.monotonic() - since + 1.0)

        return wait_for(
            read,
            f"a node of {sorted(names)} for every flow in the session tables",
            until=lambda c: all(c[k] in names for k in live),
        )

    def exchange_udp(self) -> None:
        """One exchange on every UDP flow; a flow answered by another backend than at
        the start, or not at all, is broken."""
        for t, u in self.udp.items():
            was = self.backends[t, "udp"]
            for i, b in enumerate(u.backends()):
                if b != was[i]:
                    self.broken[t, "udp"].setdefault(i, f"{was[i]}, then {b}")

    def mark(self) -> dict[str, list[int]]:
        return {t: s.verified() for t, s in self.streams.items()}

    def settle(self, mark: dict[str, list[int]]) -> dict[Kind, dict[int, str]]:
        """Wait until every stream that did not break moved on since ``mark``; the flows
        broken since the last call, per kind."""
        before = {k: dict(v) for k, v in self.broken.items()}
        for t, s in self.streams.items():
            self.broken[t, "tcp"].update(s.why_broken(s.wait_resumed(mark[t])))
        self.exchange_udp()
        return {
            k: {i: r for i, r in v.items() if i not in before[k]} for k, v in self.broken.items()
        }

    def tally(
        self,
        before: dict[bytes, str | None],
        after: dict[bytes, str | None],
        broke: dict[Kind, dict[int, str]],
        on: Sequence[str] | None = None,
    ) -> dict[Kind, Tally]:
        """Per kind, the flows (on a backend of ``on`` at the start, or all) live at
        ``before`` (not broken by then): moved (another node at ``after``) or not, and
        those that ``broke`` since."""
        out = {kind: Tally() for kind in self.keys}
        for kind, ks in self.keys.items():
            for i, k in enumerate(ks):
                if i in self.broken[kind] and i not in broke[kind]:
                    continue  # broke before
                if on is not None and self.backends[kind][i] not in on:
                    continue
                out[kind].add(after[k] != before[k], broke[kind].get(i))
        return out


def summary(tallies: dict[Kind, Tally]) -> str:
    return "; ".join(f"{t} {proto}: {tally}" for (t, proto), tally in tallies.items())


def test_a_fourth_node_joining(tmp_path: Path) -> None:
    with cluster(lbs=4, backends=3) as lab, ExitStack() as stack:
        nodes = [
            LbNode(lab, tmp_path, vips(lab, lab.backends), node=n, bgp=bgp_section(lab))
            for n in lab.lbs
        ]
        old, new = nodes[:3], nodes[3]
        for n in old:
            n.start()
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
        for n in nodes:
            n.start()
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
