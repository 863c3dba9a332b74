"""The fleet's configuration in a real etcd (docs/cluster.md, "Fleet state"): two LB
nodes behind the lab's router, whose files name the store and no VIP, follow the fleet's
document, publish what they serve under a lease, agree on every table; a revision that
fails validation is refused by both while the previous one keeps serving; a node that
loses the store keeps serving and says so, and catches up once it is back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.cluster import SYNC_KEY, SYNC_PORT, bgp_section, wait_route
from xdplb.lab.etcd import Etcd
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode, start_nodes
from xdplb.lab.traffic import http_post
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
KEY = "/xdplb/config"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    cleanup_stale()
    with Lab(lbs=2, router=True) as lab:
        for b in lab.backends:
            attach_host(lab, b)
        lab.start_servers()
        yield lab


@pytest.fixture
def fleet(lab: Lab, tmp_path: Path) -> Iterator[tuple[Etcd, list[LbNode]]]:
    etcd = Etcd(lab, tmp_path / "etcd")
    etcd.start()
    cluster = {"store": etcd.url, "lease_ttl": 2}
    # They announce the VIPs (the client reaches them through the router) once served.
    # Session sync with no peer in the files: the store's live nodes are the peers.
    nodes = [
        LbNode(
            lab,
            tmp_path,
            [],
            node=n,
            cluster=cluster,
            bgp=bgp_section(lab),
            sync={"listen": f"{lab.addr(n)}:{SYNC_PORT}", "node": n, "key": SYNC_KEY},
        )
        for n in lab.lbs
    ]
    try:
        start_nodes(nodes)
        yield etcd, nodes
    finally:
        for n in nodes:
            n.destroy()
        etcd.kill()


def document(lab: Lab, backends: list[str]) -> str:
    vips = [{"address": VIP, "port": 80, "backends": [{"address": b} for b in backends]}]
    return yaml.safe_dump({"vips": vips})


def cluster(node: LbNode) -> dict[str, Any]:
    with node.api() as api:
        r = api.get("/api/v1/cluster")
        r.raise_for_status()
        store: dict[str, Any] = r.json()["store"]
        return store


def sync_of(node: LbNode) -> dict[str, Any]:
    with node.api() as api:
        return api.get("/api/v1/cluster").json()["sync"]  # type: ignore[no-any-return]


def wait_all(nodes: list[LbNode], what: str, until: Any) -> None:
    for n in nodes:
        wait_for(lambda n=n: cluster(n), f"{n.node}: {what}", until=until, timeout=20)


def announced(lab: Lab) -> None:
    """Until the router routes the VIP over both nodes (they announce what they serve)."""
    wait_route(lab, [VIP], lab.lbs, "the router routing the VIP over both nodes")


def tables(node: LbNode) -> dict[str, Any]:
    with node.maps() as maps:
        snap = maps.snapshot()
    return {str(v.addr): snap.tables[p.vip_id] for v, p in snap.vips.items()}


def test_nodes_serve_each_revision_and_refuse_a_bad_one_alike(
    lab: Lab, fleet: tuple[Etcd, list[LbNode]]
) -> None:
    etcd, nodes = fleet
    addrs = [str(lab.addr(b)) for b in lab.backends]
    rev = etcd.put(KEY, document(lab, addrs))
    wait_all(
        nodes,
        f"serving revision {rev}, both nodes' reports in, tables alike",
        until=lambda st: (
            st["revision"] == rev
            and {n["node"] for n in st["nodes"]} == {n.instance for n in nodes}
            and all(n["revision"] == rev and not n["tables_differ"] for n in st["nodes"])
        ),
    )
    announced(lab)
    wait_all(
        nodes,
        "every node's report saying it announces the VIP over established sessions",
        until=lambda st: all(
            n["announced"] == [VIP]
            and n["sessions"]
            and all(v.endswith("Established") for v in n["sessions"].values())
            for n in st["nodes"]
        ),
    )
    assert http_post(lab.ns("client"), VIP, 80, b"x") in lab.backends
    for n in nodes:  # each follows the other's sessions, a peer it learnt from the store
        others = [o.node for o in nodes if o is not n]
        wait_for(
            lambda n=n: sync_of(n),  # type: ignore[misc]
            f"{n.node} following {others}",
            until=lambda s, others=others: (  # type: ignore[misc]
                s["ready"]
                and [(p["node"], p["state"]) for p in s["peers"]] == [(o, "synced") for o in others]
            ),
        )
    before = [tables(n) for n in nodes]
    assert list(before[0]) == [VIP] and before[0][VIP] == before[1][VIP]

    # A revision that fails validation: both refuse it, the previous one keeps serving.
    bad = etcd.put(KEY, document(lab, [*addrs, "198.18.0.999"]))
    wait_all(
        nodes,
        f"refusing revision {bad}",
        until=lambda st: st["refused_revision"] == bad and st["revision"] == rev,
    )
    for n in nodes:
        st = cluster(n)
        assert st["refused_error"].startswith("vips[0].backends[3].address"), st
        assert f"store revision {bad} refused" in n.log_tail()
    assert [tables(n) for n in nodes] == before
    assert http_post(lab.ns("client"), VIP, 80, b"y") in lab.backends

    # A good one after it: served by both, the refusal stays on record.
    good = etcd.put(KEY, document(lab, addrs[:2]))
    wait_all(nodes, f"serving revision {good}", until=lambda st: st["revision"] == good)
    after = [tables(n) for n in nodes]
    assert after[0][VIP] == after[1][VIP] != before[0][VIP]
    assert len(after[0][VIP].counts()) == 2


def test_a_node_that_loses_the_store_keeps_serving_and_catches_up(
    lab: Lab, fleet: tuple[Etcd, list[LbNode]]
) -> None:
    etcd, nodes = fleet
    addrs = [str(lab.addr(b)) for b in lab.backends]
    rev = etcd.put(KEY, document(lab, addrs))
    wait_all(nodes, f"serving revision {rev}", until=lambda st: st["revision"] == rev)
    announced(lab)

    etcd.kill()
    wait_all(nodes, "the store unreachable", until=lambda st: not st["connected"] and st["error"])
    for n in nodes:
        assert cluster(n)["revision"] == rev
    assert http_post(lab.ns("client"), VIP, 80, b"z") in lab.backends

    etcd.start()
    wait_all(nodes, "the store back", until=lambda st: st["connected"])
    again = etcd.put(KEY, document(lab, addrs[:1]))
    wait_all(nodes, f"serving revision {again}", until=lambda st: st["revision"] == again)
    # BFD detects in 300 ms: on a starved machine a session can flap meanwhile (the
    # route was gone for a moment in a loaded run); what is shown here is the revision.
    announced(lab)
    assert http_post(lab.ns("client"), VIP, 80, b"w") == lab.backends[0]

    # A node that stops leaves the others' view when its lease ends.
    nodes[1].stop_daemon()
    wait_for(
        lambda: [n["node"] for n in cluster(nodes[0])["nodes"]],
        "the stopped node's report gone",
        until=lambda names: names == [nodes[0].instance],
        timeout=20,
    )


def checked_document(lab: Lab) -> str:
    check = {
        "checker": {"http": {"uri": "/", "codes": [200]}},
        "interval_ms": 300,
        "timeout_ms": 200,
        "fall_count": 2,
        "rise_count": 2,
    }
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    vips = [{"address": VIP, "port": 80, "health": check, "backends": backends}]
    return yaml.safe_dump({"vips": vips})


def backend_views(node: LbNode, addr: str) -> tuple[str, int]:
    """The node's own health verdict on ``addr`` and its effective weight (what the
    table is built from)."""
    with node.api() as api:
        st = api.get("/api/v1/status").json()
    (b,) = [b for b in st["vips"][0]["backends"] if b["address"] == addr]
    return b["health"], b["effective_weight"]


def test_health_is_agreed_a_flap_seen_by_one_node_moves_no_table(
    lab: Lab, fleet: tuple[Etcd, list[LbNode]]
) -> None:
    """Each node publishes what its checks see; a backend is down where more than half of
    the live nodes see it down. One node of two losing its checks of b1 (b1 cannot answer
    that node) changes nobody's table; both losing them takes b1 out of both."""
    etcd, nodes = fleet
    b1 = str(lab.addr(lab.backends[0]))
    rev = etcd.put(KEY, checked_document(lab))
    wait_all(
        nodes,
        "b1 checked up by both nodes, tables alike",
        until=lambda st: (
            st["revision"] == rev
            and len(st["nodes"]) == 2
            and not any(n["tables_differ"] for n in st["nodes"])
        ),
    )
    for n in nodes:
        wait_for(
            lambda n=n: backend_views(n, b1),
            f"{n.node} checking b1 up",
            until=lambda v: v[0] == "up",
        )
    before = [tables(n)[VIP] for n in nodes]
    assert before[0] == before[1]

    def blackhole(node: LbNode, on: bool) -> None:
        """b1's answers to ``node``'s checks go nowhere."""
        verb = "add" if on else "del"
        lab.run(lab.backends[0], ["ip", "route", verb, "blackhole", f"{lab.addr(node.node)}/32"])

    blackhole(nodes[0], True)
    try:
        wait_for(
            lambda: backend_views(nodes[0], b1), "lb seeing b1 down", until=lambda v: v[0] == "down"
        )
        # The other node sees it up: 1 of 2 is no majority. Nobody's table moves.
        assert backend_views(nodes[1], b1)[0] == "up"
        for n in nodes:
            assert backend_views(n, b1)[1] > 0
        assert [tables(n)[VIP] for n in nodes] == before
        assert "by the fleet's agreement" not in nodes[0].log_tail(50)

        blackhole(nodes[1], True)
        wait_for(
            lambda: [tables(n)[VIP] for n in nodes],
            "b1 out of both tables, alike",
            until=lambda t: t[0] == t[1] and t[0] != before[0],
            timeout=20,
        )
        for n in nodes:
            assert backend_views(n, b1) == ("down", 0)
            assert f"backend {b1} is down by the fleet's agreement" in n.log_tail(50)
    finally:
        blackhole(nodes[0], False)
        blackhole(nodes[1], False)
    wait_for(
        lambda: [tables(n)[VIP] for n in nodes],
        "b1 back in both tables",
        until=lambda t: t == before,
        timeout=20,
    )


def beamer_document(lab: Lab, weights: tuple[int, ...]) -> str:
    backends = [
        {"address": str(lab.addr(b)), "weight": w}
        for b, w in zip(lab.backends, weights, strict=True)
    ]
    policy = {"min_interval": 0, "max_step": 1.0}
    vips = [{"address": VIP, "port": 80, "table": "beamer", "beamer": policy, "backends": backends}]
    return yaml.safe_dump({"vips": vips})


def test_beamer_tables_and_their_history_live_in_the_store(
    lab: Lab, fleet: tuple[Etcd, list[LbNode]]
) -> None:
    """One node steps the Beamer tables (the live one with the lowest name) and publishes
    them; the others serve them as they are. A node that was down through three weight
    changes comes back to the same hop lists, history included (built on its own from
    the last weights it would hold one run per backend and no previous hop); when the
    stepping node dies, the other steps on from the store's table."""
    etcd, nodes = fleet

    def same_tables(rev: int) -> None:
        wait_all(
            nodes,
            f"serving revision {rev}, Beamer tables alike",
            until=lambda st: (
                st["revision"] == rev
                and len(st["nodes"]) == 2
                and all(n["revision"] == rev and not n["tables_differ"] for n in st["nodes"])
            ),
        )
        first, second = (tables(n)[VIP] for n in nodes)
        assert first == second

    same_tables(etcd.put(KEY, beamer_document(lab, (1, 1, 1))))

    nodes[1].stop_daemon()
    for weights in ((2, 1, 1), (1, 2, 1), (1, 1, 3)):
        rev = etcd.put(KEY, beamer_document(lab, weights))
        wait_for(
            lambda: cluster(nodes[0]),
            f"lb serving {weights}",
            until=lambda st, rev=rev: st["revision"] == rev,  # type: ignore[misc]
        )
    stepped = tables(nodes[0])[VIP]
    assert stepped.rest is not None  # buckets that moved keep their previous owners

    nodes[1].start(wait=False)  # its file has no VIP: the store's document brings it
    same_tables(rev)

    # The stepping node dies; the other steps on from the table in the store.
    nodes[0].proc.kill()  # type: ignore[union-attr]
    nodes[0].proc.wait()  # type: ignore[union-attr]
    wait_for(
        lambda: [n["node"] for n in cluster(nodes[1])["nodes"]],
        "lb's report gone (its lease ended)",
        until=lambda names: names == [nodes[1].instance],
        timeout=20,
    )
    rev = etcd.put(KEY, beamer_document(lab, (1, 1, 1)))
    wait_for(
        lambda: cluster(nodes[1]),
        "lb2 serving the new weights",
        until=lambda st: st["revision"] == rev,
    )
    nodes[0].start(wait=False)
    same_tables(rev)
    final = tables(nodes[1])[VIP]
    # Stepped on from the stored history, not rebuilt: previous hops still there.
    assert final.rest is not None and final != stepped
