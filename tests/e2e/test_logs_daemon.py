"""The daemon's log as an SRE reads it, from a real daemon in the lab (``--log-format
json``): a startup line naming version, config, API address, interfaces and hook; no
line per successful health check; a backend going down and up logs exactly one line
each, naming VIP, backend and the check's reason; a reload logs its diff; every line is
a JSON object."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
NAME = f"{VIP}:80/tcp"
CHECK = {
    "checker": {"http": {"uri": "/", "codes": [200]}},
    "interval_ms": 200,
    "timeout_ms": 200,
    "fall_count": 2,
    "rise_count": 2,
}
#: Successful checks that must add no line.
CHECKS = 30


def vips(lab: Lab, weights: dict[str, int]) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b)), "weight": w} for b, w in weights.items()]
    return [{"address": VIP, "port": 80, "health": CHECK, "backends": backends}]


@pytest.fixture
def lb(lab: Lab, tmp_path: Path, lab_servers: Any) -> Iterator[LbNode]:
    node = LbNode(lab, tmp_path, vips(lab, dict.fromkeys(lab.backends, 1)))
    node.start(args=["--log-format", "json"])
    yield node
    node.destroy()


def records(node: LbNode) -> list[dict[str, Any]]:
    """Every line of the daemon's log, each of which must be one JSON object."""
    out = []
    for line in node.log_path.read_text().splitlines():
        doc = json.loads(line)
        assert {"time", "level", "logger", "message"} <= set(doc), line
        out.append(doc)
    return out


def checks(node: LbNode) -> int:
    with node.api() as api:
        return int(api.get("/api/v1/status").json()["health_checks"])


def health_lines(node: LbNode, backend: str) -> list[dict[str, Any]]:
    return [r for r in records(node) if r.get("backend") == backend and "health" in r]


def test_what_the_daemon_logs(
    lab: Lab, lb: LbNode, lab_servers: dict[str, subprocess.Popen[str]]
) -> None:
    (banner,) = wait_for(
        lambda: [r for r in records(lb) if r["message"].startswith("xdplb ")],
        "the startup line",
        until=lambda r: r,
        detail=lb.log_tail,
    )
    assert banner["level"] == "INFO"
    assert banner["version"] == importlib.metadata.version("xdplb")
    assert banner["config"] == str(lb.config_path)
    assert banner["api"] == f"unix:{lb.api_socket}"
    assert banner["interfaces"] == ["eth0"] and banner["hook"] == "eth0:auto"
    assert str(lb.config_path) in banner["message"] and "eth0" in banner["message"]

    # Successful checks: not one line.
    start = checks(lb)
    lines = len(records(lb))
    wait_for(lambda: checks(lb), f"{CHECKS} more checks", until=lambda n: n >= start + CHECKS)
    assert records(lb)[lines:] == []

    # b2's server dies, then comes back: one line each, naming VIP, backend, reason.
    b2 = str(lab.addr("b2"))
    lab_servers["b2"].kill()
    lab_servers["b2"].wait()
    (down,) = wait_for(
        lambda: health_lines(lb, b2), "b2 down in the log", until=lambda r: r, detail=lb.log_tail
    )
    assert (down["level"], down["vip"], down["health"]) == ("WARNING", NAME, "down")
    assert down["reason"] and down["reason"] in down["message"]
    assert down["message"] == f"VIP {NAME}: backend {b2} is down: {down['reason']}"
    lab_servers["b2"] = lab.start_servers(names=["b2"])[0]
    down_, up = wait_for(
        lambda: health_lines(lb, b2),
        "b2 up in the log",
        until=lambda r: len(r) >= 2,
        detail=lb.log_tail,
    )
    assert down_ == down
    assert (up["level"], up["vip"], up["health"]) == ("INFO", NAME, "up")
    assert up["message"] == f"VIP {NAME}: backend {b2} is up: {up['reason']}"
    assert up["reason"] == "HTTP 200"
    # Nothing else named b2, nothing repeated the change as a Python repr.
    assert [r for r in records(lb) if b2 in r["message"]] == [down, up]
    assert not [r for r in records(lb) if r["logger"].startswith(("httpx", "httpcore"))]

    # A reload logs its diff, one line per change, naming VIP and backend.
    b1 = str(lab.addr("b1"))
    lines = len(records(lb))
    lb.reload(vips(lab, {"b1": 3, "b2": 1, "b3": 1}))
    # The reload is applied when its plan is; its log lines may follow a moment later.
    diff = wait_for(
        lambda: [r for r in records(lb)[lines:] if r["message"].startswith("reload (")],
        "the reload's diff in the log",
        until=lambda d: any("change" in r for r in d),
        detail=lb.log_tail,
    )
    changes = [r for r in diff if "change" in r]
    assert [r["change"] for r in changes] == [f"VIP {NAME}: backend {b1} weight 1 -> 3"], diff
    assert (changes[0]["vip"], changes[0]["backend"], changes[0]["level"]) == (NAME, b1, "INFO")
    # (A second reload of the same file, by SIGHUP after the watcher's: "no change".)
    assert all(r["message"].endswith(": no change") for r in diff if r not in changes)
