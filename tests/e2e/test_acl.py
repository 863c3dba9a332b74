"""Source ACLs in the lab, with the real daemon: a denied prefix gets nothing through (its
connections time out, the ACL drop counters move), an allowed source is served, and an
API change takes effect live without breaking the established connections of allowed
sources nor rewriting any table.

The client sources from secondary addresses of 198.18.0.0/24 (its own is 198.18.0.1).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from xdplb.lab import Lab, netns
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream, http_post

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
#: Secondary client addresses: one inside the denied prefix, one outside every rule.
DENIED_NET = "198.18.0.64/26"
DENIED_SRC = "198.18.0.77"
OTHER_SRC = "198.18.0.150"
ECHO_ACL = f"/api/v1/vips/{VIP}/7/tcp/acl"


def vips(lab: Lab) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    return [
        {"address": VIP, "port": 80, "backends": backends},
        {"address": VIP, "port": 7, "backends": backends},
    ]


@pytest.fixture(scope="module")
def lb(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LbNode]:
    for addr in (DENIED_SRC, OTHER_SRC):
        lab.run("client", ["ip", "addr", "add", f"{addr}/24", "dev", "eth0"])
    lab.start_servers()
    node = LbNode(lab, tmp_path_factory.mktemp("acl"), vips(lab), acl={"deny": [DENIED_NET]})
    node.start()
    yield node
    node.destroy()


def connects(lab: Lab, src: str, port: int = 80, timeout: float = 1.0) -> bool:
    """Whether a TCP connection from ``src`` to the VIP completes within ``timeout``."""
    with netns.enter(lab.ns("client")):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((src, 0))
        sock.settimeout(timeout)
        sock.connect((VIP, port))
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def counters(node: LbNode) -> tuple[int, dict[str, dict[str, int]]]:
    """ACL drops and the hits by scope."""
    with node.api() as api:
        st = api.get("/api/v1/status").json()
    return st["drops"]["acl"], {h["scope"]: h for h in st["acl"]}


def tables(node: LbNode) -> dict[int, Any]:
    maps = node.maps()
    try:
        snap = maps.snapshot()
        return {p.vip_id: snap.tables[p.vip_id] for p in snap.vips.values()}
    finally:
        maps.close()


def test_denied_prefix_gets_nothing_through(lab: Lab, lb: LbNode) -> None:
    drops0, hits0 = counters(lb)
    assert not connects(lab, DENIED_SRC)
    drops1, hits1 = counters(lb)
    # The SYN and its retransmissions within the second: each one dropped in XDP.
    assert drops1 > drops0
    assert hits1["global"]["deny"] - hits0["global"]["deny"] == drops1 - drops0
    # Other sources are served: the client's own address and another secondary one.
    assert http_post(lab.ns("client"), VIP, 80, b"allowed") in lab.backends
    assert connects(lab, OTHER_SRC)
    assert counters(lb)[0] == drops1


def test_api_change_is_live_and_keeps_established_connections(lab: Lab, lb: LbNode) -> None:
    before = tables(lb)
    stream = EchoStream.open(lab.ns("client"), VIP, 7)
    try:
        stream.exchange()
        client = str(lab.addr("client"))
        # The echo VIP becomes an allow list holding only the client's own address.
        with lb.api() as api:
            r = api.put(ECHO_ACL, json={"allow": [f"{client}/32"]})
            assert r.status_code == 200, r.text
            assert r.json()["operations"] > 0
            view = api.get(ECHO_ACL).json()
        assert view["allow"] == [f"{client}/32"]
        stream.exchange()  # established, allowed: untouched
        assert not connects(lab, OTHER_SRC, 7)
        assert connects(lab, OTHER_SRC, 80)  # the other VIP has no such list
        assert connects(lab, client, 7)
        _, hits = counters(lb)
        echo = hits[f"{VIP}:7/tcp"]
        assert echo["default"] > 0 and echo["allow"] > 0
        # The global deny list changes too: the denied source comes back.
        with lb.api() as api:
            assert api.put("/api/v1/acl", json={"deny": []}).status_code == 200
            assert api.put(ECHO_ACL, json={}).status_code == 200
        assert connects(lab, DENIED_SRC)
        assert connects(lab, OTHER_SRC, 7)
        stream.exchange()
    finally:
        stream.close()
    assert tables(lb) == before  # ACL changes rewrite no table
    # And the maps hold what the configuration says: no rule left.
    maps = lb.maps()
    try:
        assert maps.snapshot().acl == {}
    finally:
        maps.close()
