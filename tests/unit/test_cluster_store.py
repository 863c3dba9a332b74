"""The fleet's state, without a store: the merge of a node's file with the fleet's
document, table digests over addresses, the reports and what the status makes of them."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from xdplb.cluster.store import FleetMember, NodeReport, agreed_down, table_digests
from xdplb.config import fleet_config, parse_config
from xdplb.control.planner import vip_key
from xdplb.core.errors import ConfigError
from xdplb.core.state import BackendState, LookupTable, Snapshot, VipParams

pytestmark = pytest.mark.unit

A = ipaddress.ip_address
LOCAL = {
    "instance": "n1",
    "interfaces": ["eth0"],
    "tunnel": {"source_v4": "198.18.0.2"},
    "cluster": {"store": "etcd://198.18.0.1:2379"},
    "vips": [{"address": "198.18.100.9", "port": 80, "backends": [{"address": "198.18.0.11"}]}],
}
DOC = "vips: [{address: 198.18.100.1, port: 80, backends: [{address: 198.18.0.12}]}]\n"


def test_the_document_replaces_the_fleet_fields_and_keeps_the_nodes_own() -> None:
    local = parse_config(LOCAL)
    cfg = fleet_config(local, DOC, "etcd")
    assert [v.name for v in cfg.vips] == ["198.18.100.1:80/tcp"]
    assert (cfg.instance, cfg.interfaces, cfg.tunnel) == (
        local.instance,
        local.interfaces,
        local.tunnel,
    )
    assert fleet_config(local, "", "etcd") == local  # an empty document changes nothing


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ("interfaces: [eth1]", "interfaces"),
        ("vips: [{address: 198.18.100.1, backends: [{address: nope}]}]", "vips[0].backends[0]"),
        ("vips: [", ""),
        ("- a list", ""),
    ],
)
def test_a_bad_document_names_the_field(doc: str, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        fleet_config(parse_config(LOCAL), doc, "etcd")
    assert e.value.field.startswith(field), e.value


def snapshot(ids: dict[str, int], first: list[str]) -> Snapshot:
    cfg = parse_config(LOCAL)
    vip = cfg.vips[0]
    snap = Snapshot()
    snap.vips[vip_key(vip)] = VipParams(3, table_size=len(first))
    snap.backends.update({i: BackendState(A(a), True, 0) for a, i in ids.items()})
    snap.tables[3] = LookupTable(np.array([ids[a] for a in first], dtype=np.uint32))
    return snap


def test_digests_compare_addresses_not_ids() -> None:
    cfg = parse_config(LOCAL)
    order = ["198.18.0.11", "198.18.0.12", "198.18.0.11"]
    one = table_digests(cfg, snapshot({"198.18.0.11": 1, "198.18.0.12": 2}, order))
    two = table_digests(cfg, snapshot({"198.18.0.11": 7, "198.18.0.12": 4}, order))
    swapped = ["198.18.0.12", "198.18.0.11", "198.18.0.12"]
    other = table_digests(cfg, snapshot({"198.18.0.11": 1, "198.18.0.12": 2}, swapped))
    assert one == two and set(one) == {"198.18.100.9:80/tcp"}
    assert one != other
    assert table_digests(cfg, None) == {}


def test_status_names_the_tables_that_differ() -> None:
    cfg = parse_config(LOCAL)
    assert cfg.cluster is not None
    mine = NodeReport("n1", 5, tables={"a": "1", "b": "2"}, at=1.0)
    member = FleetMember(cfg.cluster, "n1", lambda text, rev: None, lambda: mine)
    member.state.revision = 5
    member.state.nodes = {
        "n1": mine,
        "n2": NodeReport(
            "n2", 4, refused_revision=6, refused_error="vips: bad", tables={"a": "1", "b": "3"}
        ),
    }
    st = member.status()
    assert [(n.node, n.revision, n.tables_differ) for n in st.nodes] == [
        ("n1", 5, []),
        ("n2", 4, ["b"]),
    ]
    assert st.nodes[1].refused_revision == 6
    assert NodeReport.decode(mine.encode()) == mine
    assert NodeReport.decode(b"not json") is None and NodeReport.decode(b"[1]") is None


def test_agreed_down_is_a_majority_of_the_reports_on_a_member() -> None:
    def rep(node: str, **health: bool) -> NodeReport:
        return NodeReport(
            node, 1, health={"v": {a.replace("_", "."): up for a, up in health.items()}}
        )

    a, b = "198_18_0_11", "198_18_0_12"
    three = [
        rep("n1", **{a: False, b: False}),
        rep("n2", **{a: False, b: True}),
        rep("n3", **{a: True}),
    ]
    # a: 2 of 3 down; b: 1 of 2 down (n3 has not checked it), a tie: up.
    assert agreed_down(three) == {("v", A("198.18.0.11"))}
    # Two nodes that disagree: up (a flap seen by one node moves no table).
    assert agreed_down(three[1:]) == frozenset()
    assert agreed_down([rep("n1", **{a: False})]) == {("v", A("198.18.0.11"))}
    assert agreed_down([]) == frozenset()
    # Any order of the same reports: the same answer.
    assert agreed_down(three[::-1]) == agreed_down(three)
    # A name that is no address (another writer's) is not counted.
    assert agreed_down([NodeReport("x", 1, health={"v": {"nope": False}})]) == frozenset()


def test_the_examples_make_a_node_configuration() -> None:
    from pathlib import Path

    from xdplb.config import load_config

    examples = Path(__file__).resolve().parents[2] / "examples"
    node = load_config(examples / "cluster-node.yaml")
    cfg = fleet_config(node, (examples / "fleet.yaml").read_text(), "examples/fleet.yaml")
    assert cfg.cluster is not None and cfg.bgp is not None
    assert [v.name for v in cfg.vips] == ["198.18.100.1:80/tcp", "198.18.100.2:443/tcp"]
    assert cfg.hash_seed == 1234567 and cfg.interfaces == node.interfaces
    assert cfg.sync is not None and cfg.sync_node == "lb" and cfg.sync.peers == []
