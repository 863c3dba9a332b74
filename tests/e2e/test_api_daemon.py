"""The API of the real daemon, over HTTP in the lab's lb namespace: schemathesis sends
generated requests (valid and not) and none gets a 5xx, whatever state earlier requests
left; then the daemon still serves a plain configuration."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from xdplb.daemon.api import openapi_spec
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode

pytestmark = pytest.mark.e2e

PORT = 9181
TOKEN = "schemathesis-real-daemon"
BASE = f"http://127.0.0.1:{PORT}"
schema = schemathesis.openapi.from_dict(openapi_spec())


@pytest.fixture(scope="module")
def daemon(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LbNode]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    node = LbNode(
        lab,
        tmp_path_factory.mktemp("api"),
        [{"address": "198.18.100.1", "port": 80, "backends": backends}],
        api={"listen": f"127.0.0.1:{PORT}", "token": TOKEN},
    )
    node.start()
    with lab.enter("lb"):  # the test's own thread talks from the lb namespace
        yield node
    node.destroy()


@schema.parametrize()
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_no_server_error_from_the_daemon(daemon: LbNode, case: schemathesis.Case) -> None:
    case.call_and_validate(
        base_url=BASE,
        headers={"Authorization": f"Bearer {TOKEN}"},
        checks=[not_a_server_error],
    )
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log_tail()


def test_the_daemon_still_serves(daemon: LbNode, lab: Lab) -> None:
    daemon.write(
        [{"address": "198.18.100.1", "port": 80, "backends": [{"address": str(lab.addr("b1"))}]}]
    )
    with httpx.Client(base_url=BASE, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        r = api.post("/api/v1/reload", params={"force": "true"})  # the fuzz's changes go
        assert r.status_code == 200, r.text
        st = api.get("/api/v1/status").json()
    assert [v["name"] for v in st["vips"]] == ["198.18.100.1:80/tcp"]
    assert Path(daemon.config_path).exists()
