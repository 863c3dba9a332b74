"""A cluster of balancers behind a BIRD router (docs/cluster.md): every node announces
the VIPs over eBGP with BFD, the router installs one multipath route over them and
spreads the client's flows by their ports; a node that stops, or whose daemon is
killed, leaves the route.

Timings (how fast the route changes) are ``bench/cluster_bench.py``'s; here, the facts.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.core.mapops import DeleteVip
from xdplb.datapath.links import Link
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.cluster import bgp_section, wait_route
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode, start_nodes
from xdplb.lab.traffic import http_post
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP4 = "198.18.100.1"
VIP6 = "fd78:6470:6c62:100::1"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Lab]:
    cleanup_stale()
    with Lab(lbs=3, router=True) as lab:
        for b in lab.backends:
            attach_host(lab, b)
        yield lab


def vips(lab: Lab) -> list[dict[str, Any]]:
    return [
        {
            "address": vip,
            "port": 80,
            "backends": [{"address": str(lab.addr(b, fam))} for b in lab.backends],
        }
        for vip, fam in ((VIP4, 4), (VIP6, 6))
    ]


@pytest.fixture
def nodes(cluster: Lab, tmp_path: Path) -> Iterator[list[LbNode]]:
    servers = cluster.start_servers()
    made = [
        LbNode(cluster, tmp_path, vips(cluster), node=n, bgp=bgp_section(cluster))
        for n in cluster.lbs
    ]
    try:
        start_nodes(made)
        yield made
    finally:
        for n in made:
            n.destroy()
        for p in servers:
            p.kill()


def wait_hops(lab: Lab, names: list[str], what: str) -> float:
    """Seconds until the router's routes to both VIPs go through exactly ``names``."""
    return wait_route(lab, [VIP4, VIP6], names, what)


def vip_packets(node: LbNode) -> int:
    with node.maps() as maps:
        return sum(st.packets for st in maps.counters().vips.values())


def test_router_spreads_flows_over_every_node_and_drops_a_stopped_one(
    cluster: Lab, nodes: list[LbNode]
) -> None:
    lab = cluster
    wait_hops(lab, lab.lbs, "the router routing the VIPs over every LB node")
    before = [vip_packets(n) for n in nodes]
    # Connections from 60 source ports: ECMP hashes on them, so each node takes some.
    got = [http_post(lab.ns("client"), VIP4, 80, b"x", src_port=42000 + i) for i in range(60)]
    assert set(got) <= set(lab.backends)
    moved = [vip_packets(n) - b for n, b in zip(nodes, before, strict=True)]
    assert all(m > 0 for m in moved), moved

    # (a) A graceful stop withdraws: the route loses the node, the others keep serving.
    t0 = time.monotonic()
    nodes[0].proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    wait_hops(lab, lab.lbs[1:], "the route without the stopped node")
    stopped = time.monotonic() - t0
    nodes[0].stop_daemon()
    for i in range(20):
        http_post(lab.ns("client"), VIP6, 80, b"y", src_port=43000 + i)

    # (b) A killed daemon takes its BIRD with it: its sessions close, the route follows.
    t0 = time.monotonic()
    nodes[1].proc.kill()  # type: ignore[union-attr]
    nodes[1].proc.wait()  # type: ignore[union-attr]
    wait_hops(lab, lab.lbs[2:], "the route without the killed node")
    killed = time.monotonic() - t0
    print(f"route without the node: {stopped:.3f} s after SIGTERM, {killed:.3f} s after SIGKILL")
    assert (
        "bird"
        not in subprocess.run(
            ["pgrep", "-a", "-f", f"{nodes[1].instance}"], capture_output=True, text=True
        ).stdout
    )

    # The self-check: a link detached behind the daemon's back withdraws the node.
    with Link.from_pinned(nodes[2].link_pin) as link:
        link.detach()
    wait_hops(lab, [], "no route once the last node's program was detached")
    assert "self-check failed: eth0: the tc link was detached" in nodes[2].log_tail()

    # Back: a restarted node announces again once its sessions are up.
    nodes[0].start()
    wait_hops(lab, [lab.lbs[0]], "the restarted node back in the route")
    assert http_post(lab.ns("client"), VIP4, 80, b"z") in lab.backends


def test_probe_withdraws_a_node_whose_maps_lost_a_vip(cluster: Lab, nodes: list[LbNode]) -> None:
    """The self-check's probe: a VIP deleted from a node's maps behind its daemon's back
    (its program passes that VIP's packets to the kernel now) withdraws the node, though
    the program is attached and the maps answer; a reload writes the VIP back, and the
    node announces again after its hold-down of passing checks."""
    lab = cluster
    wait_hops(lab, lab.lbs, "the router routing the VIPs over every LB node")
    node = nodes[1]
    with node.maps() as maps:
        vip = next(v for v in maps.snapshot().vips if str(v.addr) == VIP4)
        maps.apply([DeleteVip(vip)])
    wait_hops(lab, [n for n in lab.lbs if n != node.node], "the route without the broken node")
    assert f"self-check failed: probe of {VIP4}:80/tcp: to {VIP4}," in node.log_tail()

    node.reload(vips(lab), bgp=bgp_section(lab))  # the plan finds the VIP missing
    wait_hops(lab, lab.lbs, "the repaired node back in the route")
    assert "self-check passing for" in node.log_tail()


def test_a_crashing_daemon_takes_its_node_out(cluster: Lab, nodes: list[LbNode]) -> None:
    """SIGSEGV, SIGABRT, SIGBUS: a daemon that dies of a crash signal takes its BIRD with
    it (PR_SET_PDEATHSIG: the kernel's own crash handler, which runs whatever state the
    process is in), whose sessions end with a Cease: the router drops the node."""
    lab = cluster
    wait_hops(lab, lab.lbs, "the router routing the VIPs over every LB node")
    left = list(lab.lbs)
    for node, sig in zip(nodes, (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS), strict=True):
        proc = node.proc
        assert proc is not None
        proc.send_signal(sig)
        assert proc.wait(10) == -sig
        left.remove(node.node)
        wait_hops(lab, left, f"the route without the node killed by {sig.name}")
        wait_for(
            lambda node=node: (
                subprocess.run(  # type: ignore[misc]
                    ["pgrep", "-a", "-f", f"{node.instance}.bird"], capture_output=True, text=True
                ).stdout
            ),
            "its BIRD gone",
            until=lambda out: out == "",
        )


def test_uplink_down_fences_a_failing_node(cluster: Lab, nodes: list[LbNode]) -> None:
    """``bgp.uplink_down``: a node whose self-check starts failing also sets its uplink
    down, and leaves it down; once an operator has fixed the node and set the link up, it
    announces again."""
    lab = cluster
    node = nodes[2]
    # IPv6 addresses go with a link set down, unless kept (docs/cluster.md).
    lab.run(node.node, ["sysctl", "-qw", "net.ipv6.conf.eth0.keep_addr_on_down=1"])
    node.reload(vips(lab), bgp={**bgp_section(lab), "uplink_down": ["eth0"]})
    wait_hops(lab, lab.lbs, "the router routing the VIPs over every LB node")
    with node.maps() as maps:
        vip = next(v for v in maps.snapshot().vips if str(v.addr) == VIP4)
        maps.apply([DeleteVip(vip)])
    wait_for(
        lambda: lab.run(node.node, ["ip", "-o", "link", "show", "eth0"]).stdout,
        "the node's uplink down",
        until=lambda out: "state DOWN" in out,
    )
    wait_hops(lab, lab.lbs[:2], "the route without the fenced node")
    assert "bgp.uplink_down: took eth0 down (self-check failed: probe of" in node.log_tail()

    node.reload(vips(lab), bgp={**bgp_section(lab), "uplink_down": ["eth0"]})  # fixed
    assert "state DOWN" in lab.run(node.node, ["ip", "-o", "link", "show", "eth0"]).stdout
    lab.run(node.node, ["ip", "link", "set", "eth0", "up"])  # by the operator
    wait_hops(lab, lab.lbs, "the fenced node back once its link is up")
