"""The status page of the real daemon in headless Chromium, inside the lab's lb
namespace: it shows the backends with their health and table share, a screenshot is
taken, and draining a backend from the page takes it out of the table and changes its
row without a reload."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from xdplb.lab import Lab
from xdplb.lab.browser import Browser
from xdplb.lab.lbnode import LbNode

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
VIP_NAME = f"{VIP}:80/tcp"
PORT = 9180
TOKEN = "status-page-token-0123"


def row(backend: str) -> str:
    return f'[data-vip="{VIP_NAME}"] tr[data-backend="{backend}"]'


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
            shot = b.screenshot(tmp_path / "status.png")
            data = shot.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n"
            assert struct.unpack(">II", data[16:24]) == (1280, 900)

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
