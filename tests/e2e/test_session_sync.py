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

import contextlib
import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from xdplb.datapath.clock import hz, now_ticks
from xdplb.lab.cluster import (
    SYNC_PORT,
    Event,
    RouteReader,
    UdpFlows,
    bgp_section,
    bring_back,
    flow_key,
    log_since,
    sync_section,
    take_out,
    wait_route,
)
from xdplb.lab.cluster_flows import ADDED, PREFIXES, UDP, VIPS, Flows, Kind, cluster, vips
from xdplb.lab.lbnode import LbNode, start_nodes
from xdplb.lab.router import route_nexthops
from xdplb.lab.topology import Lab
from xdplb.lab.wait import wait_for
from xdplb.sync import wire

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
        start_nodes(self.in_route)
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

    def take_out(self, node: LbNode, event: Event, what: str) -> None:
        """Do ``event`` to ``node``, wait until the router has dropped it, settle."""
        mark = self.flows.mark()
        with RouteReader(self.lab) as routes:
            take_out(node, event)
            self.in_route.remove(node)
            routes.wait_out(PREFIXES, node.node)
        self.settle(what, mark)

    def kill(self, node: LbNode) -> None:
        self.take_out(node, Event.KILL, f"SIGKILL of {node.node}")
        node.destroy()  # it comes back as after a reboot: no pin, no session

    def blackhole(self, node: LbNode) -> None:
        self.take_out(node, Event.BLACKHOLE, f"black hole of {node.node}")
        mark = self.flows.mark()
        bring_back(node, Event.BLACKHOLE)
        self.in_route.append(node)
        wait_route(self.lab, PREFIXES, self.names(), f"{node.node} forwarding again")
        self.settle(f"{node.node} out of the black hole", mark)

    def restart(self, node: LbNode) -> None:
        self.take_out(node, Event.STOP, f"stop of {node.node}")
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


class HoldingProxy:
    """A TCP proxy in node ``ns``'s namespace between a subscriber there and its
    publisher ``upstream``: it forwards both ways, but holds the publisher's frames from
    its first END on until :meth:`release` (a peer slow to finish its copy)."""

    def __init__(self, lab: Lab, ns: str, upstream: tuple[str, int]) -> None:
        self.lab, self.ns, self.upstream = lab, ns, upstream
        with lab.enter(ns):
            self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.holding = threading.Event()
        self._release = threading.Event()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            with self.lab.enter(self.ns):
                up = socket.create_connection(self.upstream)
            self._conns += [down, up]
            threading.Thread(target=self._copy, args=(down, up), daemon=True).start()
            threading.Thread(target=self._frames, args=(up, down), daemon=True).start()

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while raw := src.recv(wire.HEADER_SIZE, socket.MSG_WAITALL):
                h = wire.parse_header(raw)
                rest = src.recv(h.body_len + wire.MAC_SIZE, socket.MSG_WAITALL)
                if h.type is wire.MsgType.END and not self._release.is_set():
                    self.holding.set()
                    self._release.wait()
                dst.sendall(raw + rest)

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        for s in [self.sock, *self._conns]:
            s.close()


def table_keys(node: LbNode, keys: list[bytes]) -> set[bytes]:
    with node.maps() as maps:
        return {e.key for e in maps.conns.iter_entries() if e.key in set(keys)}


def test_a_peer_that_delays_its_end_keeps_the_joining_node_withdrawn(tmp_path: Path) -> None:
    """lb2 joins lb; lb's copy reaches lb2 through a proxy that holds its END. Meanwhile
    lb2 stays out of the route, and new flows through lb make sessions that lb sends
    after the END: once it arrives, lb2 is synced, announces, and holds those too."""
    vip = VIPS["maglev"]
    with cluster(lbs=2, backends=3) as lab, ExitStack() as stack:
        a = LbNode(lab, tmp_path, node="lb", **node_config(lab, "lb", lab.backends, True))
        a.start()
        wait_route(lab, PREFIXES, ["lb"], "lb in the route")
        before = UdpFlows(lab, vip, 8, UDP)
        stack.callback(before.close)
        before.backends()
        proxy = HoldingProxy(lab, "lb2", (str(lab.addr("lb")), SYNC_PORT))
        stack.callback(proxy.close)
        cfg = node_config(lab, "lb2", lab.backends, True)
        cfg["sync"]["peers"] = [{"node": "lb", "address": f"127.0.0.1:{proxy.port}"}]
        b = LbNode(lab, tmp_path, node="lb2", **cfg)
        b.start()
        wait_for(proxy.holding.is_set, "lb's END held on its way to lb2")
        during = UdpFlows(lab, vip, 8, UDP)  # through lb alone: lb2 does not announce
        stack.callback(during.close)
        during.backends()
        new_keys = [flow_key(lab, vip, p, UDP, socket.IPPROTO_UDP) for p in during.ports]
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:  # withdrawn for as long as the END is held
            st = sync_status(b)
            assert not st["ready"] and "lb (copying)" in st["waiting_for"], st
            assert route_nexthops(lab, vip) == [str(lab.addr("lb"))]
            time.sleep(0.1)
        assert table_keys(b, new_keys) == set()  # held behind the END too
        proxy.release()
        wait_route(lab, PREFIXES, ["lb", "lb2"], "lb2 in the route after the END")
        st = sync_status(b)
        assert st["ready"] and st["peers"][0]["copies"] == 1, st
        assert wait_for(
            lambda: table_keys(b, new_keys),
            "the sessions made during the copy on lb2",
            until=lambda got: got == set(new_keys),
        )
        log = b.log_path.read_text()
        assert 0 <= log.find("session sync: synced with") < log.find("xdplb.cluster announcing")


def session_ages_all(node: LbNode, keys: list[bytes]) -> dict[bytes, float]:
    """Seconds since each flow's session on ``node`` saw a packet (or was moved on by a
    peer's refresh), imported or not; flows without a session left out."""
    want = set(keys)
    with node.maps() as maps:
        now = now_ticks()
        return {e.key: e.age(now) / hz() for e in maps.conns.iter_entries() if e.key in want}


def test_a_session_in_use_stays_alive_everywhere_and_a_dead_one_expires_everywhere(
    tmp_path: Path,
) -> None:
    """UDP sessions live 3 s idle here; refreshes go every 0.5 s. Flows that keep
    exchanging for three timeouts stay alive on the node that does not carry them (its
    copy moved on by the carrier's refreshes); once they stop, both nodes' sessions age
    past the timeout together."""
    vip, timeout = VIPS["maglev"], 3.0
    with cluster(lbs=2, backends=3) as lab, ExitStack() as stack:
        nodes = []
        for n in lab.lbs:
            cfg = node_config(lab, n, lab.backends, True)
            cfg["sync"]["refresh_interval"] = 0.5
            nodes.append(LbNode(lab, tmp_path, node=n, sessions={"udp_timeout": timeout}, **cfg))
        start_nodes(nodes)
        wait_route(lab, PREFIXES, lab.lbs, "both nodes in the route")
        flows = UdpFlows(lab, vip, 8, UDP)
        stack.callback(flows.close)
        keys = [flow_key(lab, vip, p, UDP, socket.IPPROTO_UDP) for p in flows.ports]
        t_end = time.monotonic() + 3 * timeout
        while time.monotonic() < t_end:  # alive: a datagram a flow every 0.3 s
            flows.backends()
            time.sleep(0.3)
        ages = [session_ages_all(n, keys) for n in nodes]
        for node, got in zip(nodes, ages, strict=True):
            # Each node has every flow, seen within a refresh (and a batch) of now.
            assert set(got) == set(keys), node.node
            assert max(got.values()) < 1.5, (node.node, got)
        # Stopped: idle on both, by the same clock (within a refresh interval).
        t_stop = time.monotonic()
        with nodes[0].maps() as maps:
            udp_ticks = maps.snapshot().config.conn_timeouts[0]  # the same on both
        for node in nodes:
            wait_for(
                lambda node=node: session_ages_all(node, keys),  # type: ignore[misc]
                f"{node.node}: every flow's session idle past the timeout",
                until=lambda got: min(got.values()) * hz() > udp_ticks,
                timeout=2 * timeout,
            )
        expired_after = time.monotonic() - t_stop
        assert expired_after < timeout + 2.0, expired_after
