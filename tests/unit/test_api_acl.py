"""The ACL routes of the HTTP API over the fake controller: reading, replacing (global and
per VIP), errors naming the field, and the ACL hit metrics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_controller import FakeController
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from xdplb.control.interface import AclView
from xdplb.daemon.api import create_app

pytestmark = pytest.mark.unit

VIP = "/api/v1/vips/198.18.100.1/80/tcp"
V6VIP = "/api/v1/vips/fd78:6470:6c62:100::1/53/udp"


@pytest.fixture
def fake() -> FakeController:
    return FakeController()


@pytest.fixture
def client(fake: FakeController) -> Iterator[TestClient]:
    with TestClient(
        create_app(fake), raise_server_exceptions=False, client=("127.0.0.1", 50000)
    ) as c:
        yield c


def error(resp: Any, status: int) -> tuple[str, str]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error", "field"}
    return body["error"], body["field"]


def test_global_acl_get_put(client: TestClient, fake: FakeController) -> None:
    empty = AclView.model_validate(client.get("/api/v1/acl").json())
    assert (empty.allow, empty.deny, empty.hits.scope) == ([], [], "global")
    body = {"allow": ["198.18.7.0/24"], "deny": ["198.18.0.0/16", "fd78:6470:6c62:9::/64"]}
    r = client.put("/api/v1/acl", json=body)
    assert r.status_code == 200, r.text
    assert r.json() == {"operations": 1, "persisted": False, "runtime_changes": True}
    assert [str(p) for p in fake.cfg.acl.deny] == body["deny"]
    assert [str(p) for p in fake.cfg.acl.allow] == body["allow"]
    fake.acl_hits = {"global": (5, 7, 0)}
    view = AclView.model_validate(client.get("/api/v1/acl").json())
    assert (view.allow, view.deny) == (body["allow"], body["deny"])
    assert (view.hits.allow, view.hits.deny, view.hits.default) == (5, 7, 0)
    # persist writes it to the file as well
    assert client.put("/api/v1/acl?persist=true", json={}).json()["persisted"] is True
    assert fake.cfg.acl.empty and fake.file_cfg is not None and fake.file_cfg.acl.empty


def test_vip_acl_get_put(client: TestClient, fake: FakeController) -> None:
    r = client.put(V6VIP + "/acl", json={"allow": ["fd78:6470:6c62:5::/64"]})
    assert r.status_code == 200, r.text
    assert [str(p) for p in fake.cfg.vips[1].acl.allow] == ["fd78:6470:6c62:5::/64"]
    assert fake.cfg.vips[0].acl.empty and fake.cfg.acl.empty
    fake.acl_hits = {"[fd78:6470:6c62:100::1]:53/udp": (1, 0, 4)}
    view = AclView.model_validate(client.get(V6VIP + "/acl").json())
    assert view.allow == ["fd78:6470:6c62:5::/64"] and view.deny == []
    assert (view.hits.scope, view.hits.allow, view.hits.default) == (
        "[fd78:6470:6c62:100::1]:53/udp",
        1,
        4,
    )
    # The rest of the VIP is untouched.
    assert [b.address for b in fake.cfg.vips[1].backends] == [
        b.address for b in FakeController().cfg.vips[1].backends
    ]


def test_acl_errors_name_the_field(client: TestClient, fake: FakeController) -> None:
    msg, field = error(client.put("/api/v1/acl", json={"deny": ["198.18.7.1/24"]}), 422)
    assert (msg, field) == (
        "198.18.7.1/24 has host bits set (the prefix is 198.18.7.0/24)",
        "deny[0]",
    )
    msg, field = error(client.put(VIP + "/acl", json={"allow": ["10.0.0.0/8", "nope"]}), 422)
    assert (msg, field) == ("'nope' is not an IPv4 or IPv6 prefix", "allow[1]")
    body = {"allow": ["198.18.7.0/24"], "deny": ["198.18.7.0/24"]}
    assert error(client.put("/api/v1/acl", json=body), 422) == (
        "198.18.7.0/24 is also in allow",
        "deny[0]",
    )
    assert error(client.put("/api/v1/acl", json={"permit": []}), 422)[1] == "permit"
    assert error(client.get("/api/v1/vips/198.18.100.9/80/tcp/acl"), 404)[0] == (
        "no VIP 198.18.100.9:80/tcp"
    )
    assert error(client.put("/api/v1/vips/198.18.100.9/80/tcp/acl", json={}), 404)
    assert fake.replaced == 0  # nothing was applied


def test_acl_hit_metrics(client: TestClient, fake: FakeController) -> None:
    fake.acl_hits = {"global": (1, 2, 3), "198.18.100.1:80/tcp": (0, 0, 9)}
    fake.drops = {"rate_limit": 4, "acl": 14}
    got = {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(client.get("/metrics").text)
        for s in fam.samples
    }

    def hits(scope: str, lst: str) -> float:
        return got[("xdplb_acl_hits_total", frozenset({("scope", scope), ("list", lst)}))]

    assert [hits("global", x) for x in ("allow", "deny", "default")] == [1, 2, 3]
    assert hits("198.18.100.1:80/tcp", "default") == 9
    assert got[("xdplb_drops_total", frozenset({("reason", "rate_limit")}))] == 4
