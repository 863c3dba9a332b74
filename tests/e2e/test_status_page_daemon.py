"""The status page of the real daemon in headless Chromium, inside the lab's lb
namespace: it shows the backends with their health (and for how long), table share and
a sparkline of the rates the daemon samples once a second (traffic through the VIP
shows in them), the ACL hits, no refused-reload banner; a screenshot is kept under
build/artifacts/, and draining a backend from the page takes it out of the table and
changes its row without a reload."""

from __future__ import annotations

import itertools
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from xdplb.lab import Lab
from xdplb.lab.browser import Browser
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import http_post

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
VIP_NAME = f"{VIP}:80/tcp"
PORT = 9180
TOKEN = "status-page-token-0123"


ARTIFACTS = Path(__file__).resolve().parents[2] / "build" / "artifacts"
#: The daemon's history as the page fetches it (awaited by WebDriver).
FETCH_HISTORY = """
return fetch('/api/v1/history', {headers: {Authorization: 'Bearer ' + arguments[0]}})
    .then((r) => r.json());
"""


def row(backend: str) -> str:
    return f'[data-vip="{VIP_NAME}"] tr[data-backend="{backend}"]'


def points(b: Browser, backend: str) -> int:
    return int(b.attr(f'{row(backend)} svg[data-field="spark"]', "data-points") or 0)


def test_status_page_of_the_daemon(lab: Lab, tmp_path: Path) -> None:
    procs = lab.start_servers()
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    check = {"checker": {"http": {"uri": "/"}}, "interval_ms": 300, "timeout_ms": 200}
    node = LbNode(
        lab,
        tmp_path,
        [{"address": VIP, "port": 80, "health": check, "backends": backends}],
        api={"listen": f"127.0.0.1:{PORT}", "token": TOKEN},
    )
    node.start()
    try:
        with Browser(ns=lab.ns("lb")) as b:
            b.open(f"http://127.0.0.1:{PORT}/?token={TOKEN}")
            b.wait_for(lambda b: int(b.attr("body", "data-updated") or 0) >= 2, message="two polls")
            assert b.attr("body", "data-connection") == "live"
            assert b.text('[data-field="instance"]') == node.instance
            addrs = [str(lab.addr(n)) for n in lab.backends]
            assert b.count(f'[data-vip="{VIP_NAME}"] tr[data-backend]') == 3
            for a in addrs:
                b.wait_for(lambda b, a=a: b.text(f'{row(a)} [data-field="health"]') == "up")
                assert b.text(f'{row(a)} [data-field="admin"]') == "enabled"
                share = float(b.attr(f'{row(a)} [data-field="share"]', "data-value") or 0)
                assert abs(share - 1 / 3) < 0.01
            # How long each health state has lasted (the checks brought them up).
            for a in addrs:
                assert re.fullmatch(r"for \d+s", b.text(f'{row(a)} [data-field="health_for"]'))

            # Rates the daemon samples about once a second, drawn per backend: traffic
            # through the VIP shows in the sparklines of the backends it reached.
            b.wait_for(lambda b: all(points(b, a) >= 2 for a in addrs), message="two rates each")
            for port in range(40000, 40030):
                http_post(lab.ns("client"), VIP, 80, b"sparkline", src_port=port)

            def drawn(b: Browser) -> bool:
                maxes = [
                    float(b.attr(f'{row(a)} svg[data-field="spark"]', "data-max") or 0)
                    for a in addrs
                ]
                return sum(m > 0 for m in maxes) >= 2

            b.wait_for(drawn, message="the traffic in the sparklines")
            history: dict[str, Any] = b.js(FETCH_HISTORY, TOKEN)
            assert set(history["backends"]) == set(addrs)
            times = history["times"]
            assert 2 <= len(times) <= history["length"] == 60
            gaps = [t1 - t0 for t0, t1 in itertools.pairwise(times)]
            assert all(0.9 <= g <= 2.0 for g in gaps), gaps
            for a in addrs:
                assert points(b, a) <= len(times) + 2  # the page's copy, a poll or two behind
            assert sum(x or 0 for x in history["vips"][VIP_NAME]["packets"]) > 0

            # ACL hits (the global scope always), no refused reload, no script error.
            assert b.count('[data-field="acl"] tr[data-acl="global"]') == 1
            assert b.text('[data-field="reload_error"]') == ""
            assert [m for m in b.console() if m.startswith("SEVERE")] == []

            shot = b.screenshot(tmp_path / "status.png")
            data = shot.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            assert struct.unpack(">II", data[16:24]) == (1280, 900)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            kept = ARTIFACTS / "status-page-daemon.png"
            kept.write_bytes(data)
            print(f"status page screenshot: {kept}")

            marker = b.js("window.__kept = 1; return window.__kept;")
            b.click(f'{row(addrs[0])} button[data-action="drain"]')
            b.wait_for(
                lambda b: b.text(f'{row(addrs[0])} [data-field="admin"]') == "draining",
                message="b1 draining",
            )
            b.wait_for(
                lambda b: b.attr(f'{row(addrs[0])} [data-field="share"]', "data-value") == "0",
                message="b1's share 0",
            )
            assert b.js("return window.__kept;") == marker  # updated in place, no reload
            b.screenshot(tmp_path / "drained.png")
        with node.maps() as maps:
            snap = maps.snapshot()
        (params,) = snap.vips.values()
        in_table = {str(snap.backends[i].addr) for i in snap.tables[params.vip_id].counts()}
        assert in_table == set(addrs[1:])
    finally:
        node.destroy()
        for p in procs:
            p.kill()
            p.wait()
