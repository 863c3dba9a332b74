"""Limits with the real daemon: map sizes from ``limits:``, fill levels that move in the
status (API, CLI, metrics) as VIPs, backends and connections are added, a reload that
would resize a map refused with a 422 naming the field while the running configuration
keeps serving, and a restart with changed limits refused until ``xdplb stop``."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.core.errors import LabError
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
LIMITS = {"vips": 8, "backends": 16, "conn_table": 4096}
N_CONNS = 24


def vips(lab: Lab, backends: list[str], *, extra: bool = False) -> list[dict[str, Any]]:
    bes = [{"address": str(lab.addr(b))} for b in backends]
    out = [{"address": VIP, "port": 7, "backends": bes}]
    if extra:
        out.append({"address": VIP, "port": 80, "backends": bes})
    return out


@pytest.fixture
def lb(lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    procs = lab.start_servers()
    node = LbNode(lab, tmp_path, vips(lab, ["b1"]), limits=LIMITS)
    node.start()
    yield node
    node.destroy()
    for p in procs:
        p.kill()
        p.wait()


def fill(lb: LbNode) -> dict[str, tuple[int, int]]:
    with lb.api() as api:
        st = api.get("/api/v1/status").json()
    return {m["name"]: (m["entries"], m["max_entries"]) for m in st["maps"]}


def test_fill_levels_move_and_limits_cannot_change_while_running(lab: Lab, lb: LbNode) -> None:
    before = fill(lb)
    assert before["lb_vips"] == (1, 16)
    assert before["lb_vip_addrs"] == (1, 8)
    assert before["lb_tables"] == (1, 8)
    assert before["lb_backends"] == (1, 16)
    assert before["lb_conns"] == (0, 4096)
    assert before["hc_targets"] == (0, 8192)

    lb.reload(vips(lab, ["b1", "b2"], extra=True), limits=LIMITS)
    streams = [EchoStream.open(lab.ns("client"), VIP, 7) for _ in range(N_CONNS)]
    try:
        for s in streams:
            s.exchange(64)
        after = fill(lb)
        assert after["lb_vips"] == (2, 16)
        assert after["lb_vip_addrs"] == (1, 8)  # one address, two VIPs
        assert after["lb_tables"] == (2, 8)
        assert after["lb_backends"] == (2, 16)
        assert N_CONNS <= after["lb_conns"][0] <= N_CONNS + 4
        assert after["lb_conns"][1] == 4096

        # Prometheus and the CLI say the same.
        with lb.api() as api:
            metrics = api.get("/metrics").text
        assert 'xdplb_map_entries{map="lb_vips"} 2.0' in metrics
        assert 'xdplb_map_max_entries{map="lb_conns"} 4096.0' in metrics
        out = lb.cli("status").stdout
        assert "maps (entries of max, fill, sized by):" in out
        assert any(
            line.split()[:4] == ["lb_vips", "2", "of", "16"] and "limits.vips" in line
            for line in out.splitlines()
        ), out

        # The API refuses a change of limits (422, the field named) and keeps serving.
        with lb.api() as api:
            cfg = api.get("/api/v1/config").json()
            cfg["limits"]["conn_table"] = 8192
            resp = api.put("/api/v1/config", json=cfg)
            assert resp.status_code == 422, resp.text
            assert resp.json()["field"] == "limits.conn_table"
            assert "cannot change while running (4096 -> 8192)" in resp.json()["error"]
            assert api.get("/api/v1/config").json()["limits"]["conn_table"] == 4096
        # So does a SIGHUP with such a file: the log names the field.
        lb.write(vips(lab, ["b1", "b2"], extra=True), limits={**LIMITS, "vips": 4})
        assert lb.proc is not None
        lb.proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: lb.log_tail(50),
            "the daemon refusing limits.vips in its log",
            until=lambda log: "limits.vips: cannot change while running (8 -> 4)" in log,
        )
        for s in streams:
            s.exchange(64)  # every connection still served, by the same backend
        assert fill(lb)["lb_vips"] == (2, 16)
    finally:
        for s in streams:
            s.close()


def test_a_restart_with_changed_limits_is_refused_until_stop(lab: Lab, lb: LbNode) -> None:
    lb.stop_daemon()  # SIGTERM: pins and links stay, as for an upgrade
    lb.write(vips(lab, ["b1"]), limits={**LIMITS, "conn_table": 8192})
    with pytest.raises(LabError) as e:
        lb.start()
    msg = " ".join(str(e.value).split())  # the CLI wraps its message
    assert (
        "limits.conn_table: pinned lb_conns holds 4096 connections, the configuration "
        "asks for 8192" in msg
    ), msg
    assert f"xdplb stop -i {lb.instance}" in msg
    assert lb.proc is not None and lb.proc.wait(5) == 2  # invalid configuration
    lb.proc = None
    # The way out the message gives: stop (detach, unpin), then start afresh.
    assert lb.cli("stop").returncode == 0
    lb.start()
    assert fill(lb)["lb_conns"] == (0, 8192)
