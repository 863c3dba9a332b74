"""The HTTP API over a fake controller: every route, every class of error, the token,
the metrics' series and values, and the published specification."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_controller import FakeController
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from xdplb.config import parse_config
from xdplb.control.interface import DrainStatus
from xdplb.control.status import (
    BackendStatus,
    BgpSession,
    BgpStatus,
    ClusterStatus,
    SocketLbService,
    SocketLbStatus,
    Status,
    VipStatus,
)
from xdplb.daemon.api import create_app, openapi_spec
from xdplb.daemon.metrics import Metrics

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VIP = "/api/v1/vips/198.18.100.1/80/tcp"
V6VIP = "/api/v1/vips/fd78:6470:6c62:100::1/53/udp"
BE = VIP + "/backends/198.18.0.11"


@pytest.fixture
def fake() -> FakeController:
    return FakeController()


@pytest.fixture
def metrics(fake: FakeController) -> Metrics:
    return Metrics(fake)


@pytest.fixture
def client(fake: FakeController, metrics: Metrics) -> Iterator[TestClient]:
    app = create_app(fake, token=TOKEN, metrics=metrics)
    with TestClient(app, headers=AUTH, raise_server_exceptions=False) as c:
        yield c


def error(resp: Any, status: int) -> tuple[str, str]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error", "field"}
    return body["error"], body["field"]


# Reading.


def test_status_config_vips_and_backends(client: TestClient, fake: FakeController) -> None:
    st = Status.model_validate(client.get("/api/v1/status").json())
    assert st == fake.status()
    assert client.get("/api/v1/config").json() == fake.cfg.model_dump(mode="json")
    vips = [VipStatus.model_validate(v) for v in client.get("/api/v1/vips").json()]
    assert [v.name for v in vips] == ["198.18.100.1:80/tcp", "[fd78:6470:6c62:100::1]:53/udp"]
    assert VipStatus.model_validate(client.get(V6VIP).json()) == vips[1]
    # The same VIP however its address is written.
    assert client.get("/api/v1/vips/FD78:6470:6C62:100:0::1/53/udp").json()["name"] == vips[1].name
    bes = [BackendStatus.model_validate(b) for b in client.get(VIP + "/backends").json()]
    assert [(b.address, b.weight, b.table_share) for b in bes] == [
        ("198.18.0.11", 2, 0.5),
        ("198.18.0.12", 1, 0.25),
        ("198.18.0.13", 1, 0.25),
    ]
    assert BackendStatus.model_validate(client.get(BE).json()) == bes[0]


# Changing.


def test_put_config_replaces_it_whole(client: TestClient, fake: FakeController) -> None:
    new = fake.cfg.model_dump(mode="json")
    new["vips"] = new["vips"][:1]
    r = client.put("/api/v1/config", json=new)
    assert r.status_code == 200
    assert r.json() == {"operations": 1, "persisted": False, "runtime_changes": True}
    assert [v.name for v in fake.cfg.vips] == ["198.18.100.1:80/tcp"]
    r = client.put("/api/v1/config", params={"persist": "true"}, json=new)
    assert r.json() == {"operations": 0, "persisted": True, "runtime_changes": False}
    assert fake.persisted == 1


def test_reload_drops_unpersisted_changes(client: TestClient, fake: FakeController) -> None:
    assert client.patch(BE, json={"weight": 9}).status_code == 200
    assert fake.status().runtime_changes
    r = client.post("/api/v1/reload")
    assert r.json() == {"operations": 1, "persisted": False, "runtime_changes": False}
    assert fake.cfg.vips[0].backends[0].weight == 2


def test_a_reload_that_would_drop_changes_is_a_409_naming_them(
    client: TestClient, fake: FakeController
) -> None:
    assert client.patch(BE, json={"weight": 9}).status_code == 200
    fake.refuse_reload = [
        "VIP 198.18.100.1:80/tcp: backend 198.18.0.11 weight 9 (set through the API) would become 2"
    ]
    msg, field = error(client.post("/api/v1/reload"), 409)
    assert msg == (
        "reload refused, the running configuration is kept: VIP 198.18.100.1:80/tcp: backend "
        "198.18.0.11 weight 9 (set through the API) would become 2 (force it to apply the "
        "file anyway, or persist the changes)"
    )
    assert field == ""
    assert fake.cfg.vips[0].backends[0].weight == 9  # nothing changed
    r = client.post("/api/v1/reload", params={"force": "true"})
    assert r.status_code == 200, r.text
    assert fake.cfg.vips[0].backends[0].weight == 2


def test_vip_create_replace_delete(client: TestClient, fake: FakeController) -> None:
    body = {"address": "198.18.100.7", "port": 443, "backends": [{"address": "198.18.0.11"}]}
    r = client.post("/api/v1/vips", json=body)
    assert r.status_code == 201
    assert r.json()["runtime_changes"] is True
    assert fake.cfg.vips[-1].name == "198.18.100.7:443/tcp"
    assert fake.persisted == 0
    body["encap"] = "ipip"
    r = client.put("/api/v1/vips/198.18.100.7/443/tcp", params={"persist": True}, json=body)
    assert r.status_code == 200
    assert r.json()["persisted"] is True
    assert str(fake.cfg.vips[-1].encap) == "ipip"
    assert fake.persisted == 1
    assert client.delete("/api/v1/vips/198.18.100.7/443/tcp").status_code == 200
    assert [v.name for v in fake.cfg.vips] == [
        "198.18.100.1:80/tcp",
        "[fd78:6470:6c62:100::1]:53/udp",
    ]


def test_backend_put_patch_delete(client: TestClient, fake: FakeController) -> None:
    r = client.put(VIP + "/backends/198.18.0.14", json={"address": "198.18.0.14", "weight": 5})
    assert r.status_code == 200
    assert [(str(b.address), b.weight) for b in fake.cfg.vips[0].backends][-1] == (
        "198.18.0.14",
        5,
    )
    # PUT again replaces in place.
    client.put(VIP + "/backends/198.18.0.14", json={"address": "198.18.0.14", "weight": 6})
    assert [b.weight for b in fake.cfg.vips[0].backends] == [2, 1, 1, 6]
    assert client.patch(BE, json={"weight": 0}).status_code == 200
    assert [b.weight for b in fake.cfg.vips[0].backends] == [0, 1, 1, 6]
    assert client.delete(VIP + "/backends/198.18.0.14").status_code == 200
    assert [str(b.address) for b in fake.cfg.vips[0].backends] == [
        "198.18.0.11",
        "198.18.0.12",
        "198.18.0.13",
    ]


def test_drain_enable_and_drain_status(client: TestClient, fake: FakeController) -> None:
    d = DrainStatus.model_validate(client.post(BE + "/drain").json())
    assert (d.vip, d.backend, d.admin, d.established, d.done) == (
        "198.18.100.1:80/tcp",
        "198.18.0.11",
        "draining",
        None,
        None,
    )
    assert fake.status().vips[0].backends[0].effective_weight == 0
    fake.report("198.18.100.1:80/tcp", "198.18.0.11", 0)
    d = DrainStatus.model_validate(client.get(BE + "/drain").json())
    assert (d.admin, d.established, d.done) == ("drained", 0, True)
    d = DrainStatus.model_validate(client.post(BE + "/enable").json())
    assert d.admin == "enabled"
    assert fake.status().vips[0].backends[0].effective_weight == 2


# Errors.


@pytest.mark.parametrize(
    ("method", "path", "field"),
    [
        ("GET", "/api/v1/vips/not-an-ip/80/tcp", "address"),
        ("GET", "/api/v1/vips/198.18.100.1/80/sctp", "protocol"),
        ("GET", "/api/v1/vips/198.18.100.1/70000/tcp", "port"),
        ("GET", "/api/v1/vips/198.18.100.1/http/tcp", "port"),
        ("POST", VIP + "/backends/198.18.0.1111/drain", "backend"),
        ("DELETE", VIP + "?persist=maybe", "persist"),
    ],
)
def test_malformed_path_or_query_is_400(
    client: TestClient, method: str, path: str, field: str
) -> None:
    assert error(client.request(method, path), 400)[1] == field


@pytest.mark.parametrize(
    ("method", "path", "message"),
    [
        ("GET", "/api/v1/vips/198.18.100.1/81/tcp", "no VIP 198.18.100.1:81/tcp"),
        ("DELETE", "/api/v1/vips/198.18.100.1/80/udp", "no VIP 198.18.100.1:80/udp"),
        ("GET", VIP + "/backends/198.18.0.99", "no backend 198.18.0.99 in VIP"),
        ("DELETE", VIP + "/backends/198.18.0.99", "no backend 198.18.0.99 in VIP"),
        ("POST", VIP + "/backends/198.18.0.99/drain", "no backend 198.18.0.99 in VIP"),
        ("GET", "/api/v1/nothing", "Not Found"),
    ],
)
def test_unknown_vip_or_backend_is_404(
    client: TestClient, method: str, path: str, message: str
) -> None:
    assert error(client.request(method, path), 404)[0].startswith(message)


def test_body_errors_are_422_naming_the_field(client: TestClient, fake: FakeController) -> None:
    before = fake.cfg
    msg, field = error(client.patch(BE, json={"weight": 70000}), 422)
    assert (msg, field) == ("Input should be less than or equal to 65535", "weight")
    assert error(client.patch(BE, json={"weight": 1, "x": 1}), 422)[1] == "x"
    bes = [{"address": "198.18.0.1"}, {"address": "198.18.0.2", "weight": -1}]
    body: dict[str, Any] = {"address": "198.18.100.1", "port": 80, "backends": bes}
    assert error(client.put(VIP, json=body), 422)[1] == "backends[1].weight"
    assert fake.cfg is before
    # A model-level check names its field.
    body = {"address": "198.18.100.1", "port": 80, "table_size": 4}
    msg, field = error(client.put(VIP, json=body), 422)
    assert (msg, field) == ("must be a prime (Maglev needs it), got 4", "table_size")
    # The body must describe what the path names.
    msg, field = error(client.put(VIP, json={"address": "198.18.100.1", "port": 81}), 422)
    assert (msg, field) == ("is 81, the path says 80", "port")
    assert error(client.put(VIP, json={"address": "198.18.100.2", "port": 80}), 422)[1] == (
        "address"
    )
    be = {"address": "198.18.0.12", "weight": 1}
    assert error(client.put(BE, json=be), 422)[1] == "address"
    # Cross-field checks of the whole configuration: the field in the configuration.
    be = {"address": "fd78::99"}
    fake.cfg = fake.file_cfg = parse_config(
        {**fake.cfg.model_dump(mode="json"), "tunnel": {"source_v4": "198.18.0.2"}, "vips": []}
    )
    client.post("/api/v1/vips", json={"address": "198.18.100.1", "port": 80})
    msg, field = error(client.put(VIP + "/backends/fd78::99", json=be), 422)
    assert (msg, field) == ("an IPv6 backend needs tunnel.source_v6", "vips[0].backends[0].address")
    # The controller's own refusal (ConfigError).
    cfg = fake.cfg.model_dump(mode="json")
    assert error(client.put("/api/v1/config", json={**cfg, "instance": "other"}), 422) == (
        "cannot change while running",
        "instance",
    )
    # Not JSON at all.
    r = client.put(BE, content=b"{", headers={"Content-Type": "application/json"})
    assert error(r, 422) == ("the body is not valid JSON", "")
    assert fake.cfg.vips[0].backends == []  # every refusal changed nothing


def test_an_existing_vip_is_409(client: TestClient, fake: FakeController) -> None:
    before = fake.cfg
    r = client.post("/api/v1/vips", json={"address": "198.18.100.1", "port": 80})
    assert error(r, 409) == ("VIP 198.18.100.1:80/tcp exists (PUT replaces it)", "address")
    assert fake.cfg is before


def test_a_bug_is_a_logged_500(
    client: TestClient, fake: FakeController, caplog: pytest.LogCaptureFixture
) -> None:
    fake.explode = True
    with caplog.at_level(logging.ERROR, logger="xdplb.daemon.api"):
        r = client.patch(BE, json={"weight": 3})
    assert error(r, 500) == ("internal error (see the daemon's log)", "")
    assert "the fake exploded" in caplog.text  # the traceback is in the log, not the answer
    assert "exploded" not in r.text


def test_method_not_allowed_names_every_method(client: TestClient) -> None:
    r = client.post(VIP)
    assert error(r, 405)[0] == "Method Not Allowed"
    assert r.headers["allow"] == "DELETE, GET, PUT"


# The token.


def test_token(fake: FakeController) -> None:
    app = create_app(fake, token=TOKEN)
    with TestClient(app, raise_server_exceptions=False) as c:
        for path in ("/api/v1/status", "/api/v1/vips", "/metrics"):
            r = c.get(path)
            assert error(r, 401) == ("a bearer token is required", "")
            assert r.headers["www-authenticate"] == "Bearer"
            r = c.get(path, headers={"Authorization": "Bearer wrong"})
            assert error(r, 401) == ("wrong bearer token", "")
            assert r.headers["www-authenticate"] == "Bearer"
            r = c.get(path, headers={"Authorization": f"Basic {TOKEN}"})
            assert r.status_code == 401
            assert c.get(path, headers=AUTH).status_code == 200
        # A change without the token changes nothing, and bad input is not even looked at.
        assert c.patch(BE, json={"weight": 9}).status_code == 401
        assert c.patch(BE, json={"weight": 70000}).status_code == 401
        assert c.get("/api/v1/vips/bad/99999/x").status_code == 401
        assert fake.cfg.vips[0].backends[0].weight == 2
        # What holds no data of the instance needs none.
        r = c.get("/")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/html")
        assert c.get("/static/index.html").text == r.text
        assert c.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("peer", ["127.0.0.1", "::1", ""])
def test_no_token_serves_local_callers(fake: FakeController, peer: str) -> None:
    with TestClient(create_app(fake), client=(peer, 50000)) as c:
        assert c.get("/api/v1/status").status_code == 200
        assert c.get("/metrics").status_code == 200


@pytest.mark.parametrize("peer", ["198.18.0.1", "fd78:6470:6c62::1", "testclient"])
def test_no_token_refuses_remote_callers(fake: FakeController, peer: str) -> None:
    """Without a token only this host is served, whatever socket the request came in on."""
    with TestClient(create_app(fake), client=(peer, 50000)) as c:
        for path in ("/api/v1/status", "/metrics"):
            r = c.get(path)
            assert error(r, 401) == ("a bearer token is required for calls from other hosts", "")
        assert c.patch(BE, json={"weight": 9}).status_code == 401
        assert fake.cfg.vips[0].backends[0].weight == 2


# Metrics.


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics(client: TestClient, fake: FakeController, metrics: Metrics) -> None:
    fake.counters = {"198.18.0.11": (10, 1000, 2), "198.18.0.12": (5, 700, 1)}
    fake.established = {"198.18.0.11": 7}
    client.post(BE + "/drain")
    metrics.observe_rebuild(0.003)
    metrics.observe_rebuild(0.2)
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "# HELP xdplb_vip_packets_total Packets to the VIP" in r.text
    got = samples(r.text)
    vip = ("vip", "198.18.100.1:80/tcp")
    b11, b12 = ("backend", "198.18.0.11"), ("backend", "198.18.0.12")

    def s(name: str, *labels: tuple[str, str]) -> float:
        return got[(name, frozenset(labels))]

    assert s("xdplb_info", ("instance", "fake")) == 1
    assert s("xdplb_vip_packets_total", vip) == 15
    assert s("xdplb_vip_bytes_total", vip) == 1700
    assert s("xdplb_vip_new_flows_total", vip) == 3
    assert s("xdplb_vip_all_down", vip) == 0
    assert s("xdplb_backend_packets_total", b11) == 10
    assert s("xdplb_backend_bytes_total", b12) == 700
    assert s("xdplb_backend_new_flows_total", b11) == 2
    assert s("xdplb_backend_up", vip, b11) == 1
    assert s("xdplb_backend_health", vip, b11, ("state", "up")) == 1
    assert s("xdplb_backend_health", vip, b11, ("state", "down")) == 0
    assert s("xdplb_backend_admin", vip, b11, ("state", "draining")) == 1
    assert s("xdplb_backend_admin", vip, b11, ("state", "enabled")) == 0
    assert s("xdplb_backend_admin", vip, b12, ("state", "enabled")) == 1
    assert s("xdplb_backend_weight", vip, b11) == 2
    assert s("xdplb_backend_effective_weight", vip, b11) == 0
    assert s("xdplb_backend_table_share", vip, b12) == 0.5
    assert s("xdplb_backend_established_connections", vip, b11) == 7
    assert ("xdplb_backend_established_connections", frozenset((vip, b12))) not in got
    assert s("xdplb_drops_total", ("reason", "no_backend")) == 3
    assert s("xdplb_events_total", ("event", "tx")) == 42
    assert s("xdplb_conn_table_capacity") == 1024
    assert s("xdplb_conn_table_used") == 17
    assert s("xdplb_health_checks_total") == 99
    assert s("xdplb_runtime_changes") == 0
    assert s("xdplb_table_rebuilds_total") == 2
    assert s("xdplb_table_rebuild_seconds_count") == 2
    assert s("xdplb_table_rebuild_seconds_bucket", ("le", "0.005")) == 1
    assert s("xdplb_table_rebuild_seconds_bucket", ("le", "0.25")) == 2
    assert s("xdplb_table_rebuild_seconds_sum") == pytest.approx(0.203)
    # Every family is ours and explained.
    for fam in text_string_to_metric_families(r.text):
        assert fam.name.startswith("xdplb_"), fam.name
        assert fam.documentation, fam.name


# The published specification.


def test_docs_openapi_json_is_up_to_date(client: TestClient) -> None:
    spec = openapi_spec()
    assert client.get("/openapi.json").json() == spec
    published = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert published == spec, "run: python -m xdplb.daemon.api --openapi > docs/openapi.json"
    # No Swagger UI or ReDoc: they load their scripts from a CDN.
    assert client.get("/docs").status_code == 404
    assert client.get("/redoc").status_code == 404
    assert set(spec["paths"]) >= {
        "/api/v1/status",
        "/api/v1/config",
        "/api/v1/reload",
        "/api/v1/vips",
        "/api/v1/vips/{address}/{port}/{protocol}",
        "/api/v1/vips/{address}/{port}/{protocol}/backends",
        "/api/v1/vips/{address}/{port}/{protocol}/backends/{backend}",
        "/api/v1/vips/{address}/{port}/{protocol}/backends/{backend}/drain",
        "/api/v1/vips/{address}/{port}/{protocol}/backends/{backend}/enable",
        "/metrics",
    }


# Strict bodies (issue 10, failures 13 and 9).


@pytest.mark.parametrize("weight", ["3", True, 3.0])
def test_a_weight_of_another_type_is_422(
    client: TestClient, fake: FakeController, weight: Any
) -> None:
    before = client.get("/api/v1/config").json()
    assert error(client.patch(BE, json={"weight": weight}), 422) == (
        "Input should be a valid integer",
        "weight",
    )
    be = {"address": "198.18.0.11", "weight": weight}
    assert error(client.put(BE, json=be), 422) == ("Input should be a valid integer", "weight")
    assert client.get("/api/v1/config").json() == before
    assert client.get(BE).json()["weight"] == 2


@pytest.mark.parametrize(
    ("method", "path", "body", "field"),
    [
        ("POST", "/api/v1/vips", {"address": "198.18.100.7", "port": "443"}, "port"),
        ("POST", "/api/v1/vips", {"address": "198.18.100.7", "icmp_echo": 1}, "icmp_echo"),
        ("POST", "/api/v1/vips", {"address": 3232261127}, "address"),
        ("PUT", VIP, {"address": "198.18.100.1", "port": 80.0}, "port"),
        ("PUT", "/api/v1/acl", {"deny": [3232261127]}, "deny[0]"),
        ("PUT", VIP + "/acl", {"allow": "198.18.0.0/16"}, "allow"),
    ],
)
def test_no_body_is_coerced(
    client: TestClient, fake: FakeController, method: str, path: str, body: Any, field: str
) -> None:
    before = fake.cfg
    assert error(client.request(method, path, json=body), 422)[1] == field
    assert fake.cfg is before


def test_the_whole_configuration_is_strict(client: TestClient, fake: FakeController) -> None:
    cfg = client.get("/api/v1/config").json()
    for key, value in (("hash_seed", True), ("table_size", "65537"), ("interfaces", "eth0")):
        assert error(client.put("/api/v1/config", json={**cfg, key: value}), 422)[1] == key
    assert client.get("/api/v1/config").json() == cfg


def test_protocol_in_upper_case(client: TestClient, fake: FakeController) -> None:
    body = {"address": "198.18.100.7", "port": 443, "protocol": "TCP"}
    assert client.post("/api/v1/vips", json=body).status_code == 201
    assert client.get("/api/v1/config").json()["vips"][-1]["protocol"] == "tcp"
    assert client.get("/api/v1/vips/198.18.100.7/443/Tcp").json()["name"] == "198.18.100.7:443/tcp"
    r = client.put("/api/v1/vips/198.18.100.7/443/TCP", json={**body, "protocol": "Tcp"})
    assert r.status_code == 200, r.text


BGP = BgpStatus(
    asn=65001,
    router_id="198.18.0.2",
    announced=["198.18.100.1"],
    withdrawn_because="",
    sessions=[
        BgpSession(peer="198.18.0.3", state="up Established"),
        BgpSession(peer="fd78:6470:6c62::3", state="start Active Socket: Connection refused"),
    ],
    self_checks=40,
    self_check_failures=3,
)
CLUSTER = ClusterStatus(bgp=BGP)


def test_cluster_without_bgp_is_404(client: TestClient) -> None:
    assert error(client.get("/api/v1/cluster"), 404)[0].startswith("this node is in no cluster")
    assert client.get("/api/v1/status").json()["cluster"] is None


def test_cluster_view_and_its_metrics(client: TestClient, fake: FakeController) -> None:
    fake.cluster_view = CLUSTER
    r = client.get("/api/v1/cluster")
    assert r.status_code == 200
    assert ClusterStatus.model_validate(r.json()) == CLUSTER
    assert client.get("/api/v1/status").json()["cluster"]["bgp"]["announced"] == ["198.18.100.1"]
    got = samples(client.get("/metrics").text)

    def s(name: str, *labels: tuple[str, str]) -> float:
        return got[(name, frozenset(labels))]

    assert s("xdplb_bgp_announced", ("address", "198.18.100.1")) == 1
    assert s("xdplb_bgp_session_established", ("peer", "198.18.0.3")) == 1
    assert s("xdplb_bgp_session_established", ("peer", "fd78:6470:6c62::3")) == 0
    assert s("xdplb_bgp_announcing") == 1
    assert s("xdplb_self_checks_total") == 40
    assert s("xdplb_self_check_failures_total") == 3

    fake.cluster_view = ClusterStatus(
        bgp=BGP.model_copy(update={"announced": [], "withdrawn_because": "eth0 is down"})
    )
    got = samples(client.get("/metrics").text)
    assert s("xdplb_bgp_announced", ("address", "198.18.100.1")) == 0
    assert s("xdplb_bgp_announcing") == 0


def test_no_cluster_metrics_without_bgp(client: TestClient) -> None:
    assert "xdplb_bgp_" not in client.get("/metrics").text


SOCKET_LB = SocketLbStatus(
    cgroup="/sys/fs/cgroup/clients",
    attached=True,
    services=[
        SocketLbService(
            name="198.18.100.1:80/tcp",
            address="198.18.100.1",
            port=80,
            protocol="tcp",
            backends=3,
            backends_up=2,
            table_size=65537,
        )
    ],
    events={"connect": 120, "sendmsg": 0, "no_backend": 4},
)


def test_socket_lb_in_the_status_and_its_metrics(client: TestClient, fake: FakeController) -> None:
    assert client.get("/api/v1/status").json()["socket_lb"] is None
    assert "xdplb_socklb_" not in client.get("/metrics").text

    fake.socket_lb_view = SOCKET_LB
    st = Status.model_validate(client.get("/api/v1/status").json())
    assert st.socket_lb == SOCKET_LB
    got = samples(client.get("/metrics").text)
    vip = ("vip", "198.18.100.1:80/tcp")

    def s(name: str, *labels: tuple[str, str]) -> float:
        return got[(name, frozenset(labels))]

    assert s("xdplb_socklb_attached") == 1
    assert s("xdplb_socklb_backends", vip) == 3
    assert s("xdplb_socklb_backends_up", vip) == 2
    assert s("xdplb_socklb_events_total", ("event", "connect")) == 120
    assert s("xdplb_socklb_events_total", ("event", "no_backend")) == 4

    fake.socket_lb_view = SOCKET_LB.model_copy(update={"attached": False})
    assert samples(client.get("/metrics").text)[("xdplb_socklb_attached", frozenset())] == 0
