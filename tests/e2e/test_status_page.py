"""The status page in headless Chromium, inside the lab's ``lb`` namespace.

A small FastAPI app stands in for the daemon's API: it serves the page the way the
daemon does (``/`` and ``/static``), a scripted :class:`~xdplb.control.status.Status` whose
counters grow with every poll (ACL hits, a refused reload when told), a scripted
:class:`~xdplb.daemon.history.HistoryView` (the sparklines: a known number of rates per
backend, gaps included), takes drain/enable POSTs, wants a bearer token, and can be told
to fail. The browser and the app both listen on 127.0.0.1 of the namespace, as the
browser and the real daemon will. The page is driven only through its documented hooks
(see app.js), so the same checks can run against the real daemon. The screenshot is
kept under build/artifacts/.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from xdplb.control.interface import DrainStatus
from xdplb.control.status import (
    AclHits,
    Admin,
    BackendStatus,
    ConnTableStatus,
    Health,
    Status,
    VipStatus,
)
from xdplb.daemon.history import HistoryView, Series
from xdplb.lab import Lab, netns
from xdplb.lab.browser import Browser
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
WEB = ROOT / "src" / "xdplb" / "daemon" / "web"
#: Where the screenshots stay after the run (build/ is not in git).
ARTIFACTS = ROOT / "build" / "artifacts"
TOKEN = "s3cret-token"


# -- the stand-in daemon -----------------------------------------------------------------


@dataclass
class FakeBackend:
    address: str
    weight: int
    share: float
    health: Health = "up"
    health_detail: str = "HTTP 200"
    admin: Admin = "enabled"
    established: int | None = 3
    health_changed_ago: float | None = 12.5


@dataclass
class FakeVip:
    address: str
    port: int
    protocol: str
    table: str
    table_size: int
    encap: str
    backends: list[FakeBackend]
    all_down: bool = False
    polls: int = 0

    @property
    def name(self) -> str:
        addr = ipaddress.ip_address(self.address)
        host = f"[{addr}]" if addr.version == 6 else str(addr)
        return f"{host}:{self.port}/{self.protocol}"

    def drain(self, address: str, admin: Admin) -> FakeBackend:
        """Change a backend's admin state and hand its share to the others (or back)."""
        target = next((b for b in self.backends if b.address == address), None)
        if target is None:
            raise KeyError(address)
        target.admin = admin
        live = [b for b in self.backends if b.admin == "enabled"]
        total = sum(b.weight for b in live)
        for b in self.backends:
            b.share = b.weight / total if b in live else 0.0
        return target


@dataclass
class FakeDaemon:
    vips: list[FakeVip]
    token: str
    fail: bool = False
    polls: int = 0
    #: Status.last_reload_error while set.
    reload_error: str | None = None
    #: The ``since`` of every history request (None: the whole history).
    history_queries: list[float | None] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def status(self) -> Status:
        """One more poll: every counter grows by a step proportional to the poll count."""
        with self.lock:
            self.polls += 1
            n = self.polls
            vips = []
            for i, v in enumerate(self.vips, start=1):
                packets = 1000 * i * n
                vips.append(
                    VipStatus(
                        name=v.name,
                        address=v.address,
                        port=v.port,
                        protocol=v.protocol,
                        encap=v.encap,
                        hash="5tuple",
                        table=v.table,
                        table_size=v.table_size,
                        id=i,
                        all_down=v.all_down,
                        health_checked=True,
                        packets=packets,
                        bytes=packets * 100,
                        new_flows=10 * i * n,
                        backends=[
                            BackendStatus(
                                address=b.address,
                                id=j,
                                weight=b.weight,
                                effective_weight=0
                                if b.health == "down" or b.admin != "enabled"
                                else b.weight,
                                health=b.health,
                                health_detail=b.health_detail,
                                health_changed_ago=b.health_changed_ago,
                                admin=b.admin,
                                established=b.established,
                                table_share=b.share,
                                packets=packets // 3,
                                bytes=packets * 33,
                                new_flows=n,
                                second_hop_forwards=None,
                            )
                            for j, b in enumerate(v.backends)
                        ],
                    )
                )
            return Status(
                source="daemon",
                instance="webtest",
                config_path="/etc/xdplb/lb.yaml",
                attached=["eth0"],
                runtime_changes=any(b.admin != "enabled" for v in self.vips for b in v.backends),
                uptime=time.monotonic() - self.started + 3600,
                vips=vips,
                drops={"no_backend": 0, "bad_header": 2 + n},
                events={"conn_table_full": 0, "new_flow": 30 * n},
                conn_table=ConnTableStatus(capacity=65536, used=1200 + n),
                rebuilds=4,
                last_rebuild_ms=1.7,
                health_checks=20 * n,
                acl=[
                    AclHits(scope="global", allow=0, deny=17 * n, default=0),
                    AclHits(scope=self.vips[0].name, allow=5 * n, deny=0, default=40),
                ],
                last_reload_error=self.reload_error,
            )

    def history(self, since: float | None) -> HistoryView:
        """20 intervals ending at 1000..1019: backend k is missing from the first 2k (added
        later), backend 0 has a gap at interval 10 (its counters went back); VIPs have all."""
        with self.lock:
            self.history_queries.append(since)
        times = [1000.0 + i for i in range(HISTORY_INTERVALS)]
        keep = [i for i, t in enumerate(times) if since is None or t > since]

        def series(values: list[float | None]) -> Series:
            picked = [values[i] for i in keep]
            return Series(packets=picked, bytes=[v and v * 100 for v in picked], new_flows=picked)

        backends = {}
        for k, b in enumerate(b for v in self.vips for b in v.backends):
            backends[b.address] = series(
                [None if i < 2 * k or (k, i) == (0, 10) else 10.0 * (k + 1) + i for i in range(20)]
            )
        return HistoryView(
            interval=1.0,
            length=60,
            times=[times[i] for i in keep],
            vips={v.name: series([100.0 + i for i in range(20)]) for v in self.vips},
            backends=backends,
        )

    def vip(self, address: str, port: int, protocol: str) -> FakeVip:
        for v in self.vips:
            if (ipaddress.ip_address(v.address), v.port, v.protocol) == (
                ipaddress.ip_address(address),
                port,
                protocol,
            ):
                return v
        raise HTTPException(404, f"no VIP {address}:{port}/{protocol}")


def make_app(daemon: FakeDaemon) -> FastAPI:
    app = FastAPI()

    def authorize(request: Request) -> None:
        if request.headers.get("authorization") != f"Bearer {daemon.token}":
            raise HTTPException(401, "bearer token required")

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(WEB / "index.html")

    @app.get("/api/v1/status")
    def status(request: Request) -> Any:
        authorize(request)
        if daemon.fail:
            raise HTTPException(503, "scripted failure")
        return daemon.status().model_dump(mode="json")

    @app.get("/api/v1/history")
    def history(request: Request, since: float | None = None) -> Any:
        authorize(request)
        if daemon.fail:
            raise HTTPException(503, "scripted failure")
        return daemon.history(since).model_dump(mode="json")

    def change(
        request: Request, address: str, port: int, protocol: str, backend: str, admin: Admin
    ) -> Any:
        authorize(request)
        with daemon.lock:
            vip = daemon.vip(address, port, protocol)
            try:
                b = vip.drain(backend, admin)
            except KeyError:
                raise HTTPException(404, f"no backend {backend}") from None
            return DrainStatus(
                vip=vip.name, backend=b.address, admin=b.admin, established=None, done=None
            ).model_dump(mode="json")

    @app.post("/api/v1/vips/{address}/{port}/{protocol}/backends/{backend}/drain")
    def drain(request: Request, address: str, port: int, protocol: str, backend: str) -> Any:
        return change(request, address, port, protocol, backend, "draining")

    @app.post("/api/v1/vips/{address}/{port}/{protocol}/backends/{backend}/enable")
    def enable(request: Request, address: str, port: int, protocol: str, backend: str) -> Any:
        return change(request, address, port, protocol, backend, "enabled")

    app.mount("/static", StaticFiles(directory=WEB), name="static")
    return app


def scripted_daemon() -> FakeDaemon:
    return FakeDaemon(
        token=TOKEN,
        vips=[
            FakeVip(
                "198.18.100.1",
                80,
                "tcp",
                "maglev",
                65537,
                "gue",
                [
                    FakeBackend("198.18.0.11", 2, 0.5),
                    FakeBackend("198.18.0.12", 1, 0.25, health_changed_ago=3725.0),
                    FakeBackend("198.18.0.13", 1, 0.25, established=None, health_changed_ago=None),
                ],
            ),
            FakeVip(
                "fd78:6470:6c62:100::1",
                53,
                "udp",
                "beamer",
                4099,
                "ipip",
                [
                    FakeBackend("fd78:6470:6c62::11", 3, 0.6, "down", "HTTP 503"),
                    FakeBackend("fd78:6470:6c62::12", 2, 0.4, "down", "timeout after 1000 ms"),
                ],
                all_down=True,
            ),
        ],
    )


@pytest.fixture
def served(lab_factory: Callable[..., Lab]) -> Iterator[tuple[Lab, FakeDaemon, int]]:
    """The stand-in daemon on 127.0.0.1 of a lab's ``lb`` namespace: (lab, daemon, port)."""
    lab = lab_factory(backends=1)
    daemon = scripted_daemon()
    with netns.enter(lab.ns("lb")):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # No access log: the page is opened with ?token= in its URL.
    server = uvicorn.Server(uvicorn.Config(make_app(daemon), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), "uvicorn starting", timeout=5)
    assert thread.is_alive(), "uvicorn died"
    yield lab, daemon, port
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


# -- helpers on the page's hooks ---------------------------------------------------------


def vip_sel(name: str) -> str:
    return f'[data-vip="{name}"]'


def row_sel(vip: str, backend: str) -> str:
    return f'{vip_sel(vip)} tr[data-backend="{backend}"]'


SEGMENT_WIDTHS = """
const card = [...document.querySelectorAll('[data-vip]')]
    .find((c) => c.dataset.vip === arguments[0]);
const bar = card.querySelector('[data-field="share_bar"]');
const total = bar.getBoundingClientRect().width;
const out = {};
for (const seg of bar.querySelectorAll('[data-segment]')) {
  out[seg.dataset.segment] = seg.getBoundingClientRect().width / total;
}
return out;
"""


def widths_match(b: Browser, vip: FakeVip) -> bool:
    """One segment per backend, each as wide as its share of the bar (within 1%)."""
    widths: dict[str, float] = b.js(SEGMENT_WIDTHS, vip.name)
    if set(widths) != {x.address for x in vip.backends}:
        return False
    return all(abs(widths[x.address] - x.share) <= 0.01 for x in vip.backends)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def updated(b: Browser) -> int:
    return int(b.attr("body", "data-updated") or 0)


HISTORY_INTERVALS = 20
#: Rates drawn per backend, in the order scripted_daemon lists them (see FakeDaemon.history).
POINTS = [19, 18, 16, 14, 12]

#: Vertices of a sparkline's line (one M or L per point).
SPARK_VERTICES = """
const svg = document.querySelector(arguments[0]);
const d = svg.querySelector('path.line').getAttribute('d') || '';
return (d.match(/[ML]/g) || []).length;
"""


def keep(shot: Path, name: str) -> Path:
    """Copy a screenshot to build/artifacts/ (the run's artefact) and say where."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    kept = ARTIFACTS / name
    kept.write_bytes(shot.read_bytes())
    print(f"status page screenshot: {kept}")
    return kept


# -- the test ----------------------------------------------------------------------------


def test_status_page(served: tuple[Lab, FakeDaemon, int], tmp_path: Path) -> None:
    lab, daemon, port = served
    v4, v6 = daemon.vips
    with Browser(ns=lab.ns("lb")) as b:
        b.open(f"http://127.0.0.1:{port}/?token={TOKEN}")
        # The page took the token out of the address bar, and its fetches carry it (the
        # app answers 401 without): two polls and more went through.
        assert "token" not in b.url
        b.wait_for(lambda b: updated(b) >= 2, message="two successful polls")
        assert b.attr("body", "data-connection") == "live"
        assert b.text('[data-field="connection"]') == "live"
        assert "every 1 s" in b.text(".poll")
        assert [m for m in b.console() if m.startswith("SEVERE")] == []
        assert b.text('[data-field="instance"]') == "webtest"
        assert b.text('[data-field="attached"]') == "eth0"
        assert "65,536" in b.text('[data-field="conn_table"]')
        assert b.text('[data-field="uptime"]').startswith("1h ")

        # Every backend of every VIP, with its health (detail on hover) and admin state.
        assert b.count("[data-vip]") == 2
        for vip in (v4, v6):
            assert b.count(f"{vip_sel(vip.name)} tr[data-backend]") == len(vip.backends)
            for x in vip.backends:
                row = row_sel(vip.name, x.address)
                assert b.text(f'{row} [data-field="address"]') == x.address
                assert b.text(f'{row} [data-field="health"]') == x.health
                assert x.health_detail in (b.attr(f'{row} [data-field="health"]', "title") or "")
                assert b.text(f'{row} [data-field="admin"]') == "enabled"
                assert b.text(f'{row} [data-field="weight"]') == str(x.weight)
                effective = "0" if x.health == "down" else str(x.weight)
                assert b.text(f'{row} [data-field="effective_weight"]') == effective
                assert float(b.attr(f'{row} [data-field="share"]', "data-value") or -1) == x.share
            b.wait_for(lambda b, vip=vip: widths_match(b, vip), message=f"{vip.name} share bar")
            assert b.count(f'{vip_sel(vip.name)} [data-field="legend"] [data-legend]') == len(
                vip.backends
            )
        assert b.text(f'{row_sel(v4.name, "198.18.0.13")} [data-field="established"]') == "\u2013"
        assert b.text(f'{vip_sel(v4.name)} [data-field="table"]') == "maglev · 65,537"
        assert b.text(f'{vip_sel(v6.name)} [data-field="encap"]') == "ipip"

        # The all-down banner shows on the VIP whose backends are all down, only there.
        b.wait_for(f'{vip_sel(v6.name)} [data-field="all_down"]', visible=True)
        assert b.text(f'{vip_sel(v4.name)} [data-field="all_down"]') == ""

        # Rates from the counter deltas between two polls; the app counts 100 bytes per
        # packet, so bits/s is exactly 800 x packets/s whatever the polls' timing. The
        # three are read in one script, so from one render (a poll between two separate
        # reads would pair rates of different intervals).
        def rates(b: Browser) -> tuple[float, float, float] | None:
            values = b.js(
                "return ['rate_packets', 'rate_bits', 'rate_new_flows'].map((f) => {"
                "  const n = document.querySelector(`${arguments[0]} [data-field='${f}']`);"
                "  return n && n.getAttribute('data-value'); });",
                vip_sel(v4.name),
            )
            if not values or not all(values):
                return None
            pps, bps, cps = (float(v or 0) for v in values)
            return (pps, bps, cps) if pps > 0 else None

        pps, bps, cps = b.wait_for(rates, message="rates after two polls") or (0, 0, 0)
        assert pps > 0 and cps > 0
        assert bps / pps == pytest.approx(800)

        # Drops and events: the non-zero ones only.
        assert b.count('[data-field="drops"] [data-drop="bad_header"]') == 1
        assert b.count('[data-field="drops"] [data-drop="no_backend"]') == 0
        assert b.count('[data-field="events"] [data-event="new_flow"]') == 1
        assert b.count('[data-field="events"] [data-event="conn_table_full"]') == 0

        # Sparklines: one per backend row with the rates the history holds (a gap where it
        # has none), one per VIP; the page asked for only what is newer after the first.
        backends = [(vip, x.address) for vip in (v4, v6) for x in vip.backends]
        assert len(backends) == len(POINTS)
        for k, ((vip, addr), points) in enumerate(zip(backends, POINTS, strict=True)):
            row = row_sel(vip.name, addr)
            spark = f'{row} svg[data-field="spark"]'
            assert b.attr(spark, "data-points") == str(points), addr
            assert b.js(SPARK_VERTICES, spark) == points, addr
            pps = float(b.attr(f'{row} [data-field="pps"]', "data-value") or 0)
            assert pps == 10.0 * (k + 1) + HISTORY_INTERVALS - 1, addr  # the newest rate
        for vip in (v4, v6):
            spark = f'{vip_sel(vip.name)} svg[data-field="vip_spark"]'
            assert b.attr(spark, "data-points") == str(HISTORY_INTERVALS)
        assert daemon.history_queries[0] is None
        b.wait_for(lambda b: len(daemon.history_queries) >= 3, message="three history polls")
        assert daemon.history_queries[1:3] == [1019.0, 1019.0]

        # How long each health state has lasted; nothing where it was never checked.
        for addr, text, value in (
            ("198.18.0.11", "for 12s", "12.5"),
            ("198.18.0.12", "for 1h 2m", "3725"),
            ("198.18.0.13", "", ""),
        ):
            cell = f'{row_sel(v4.name, addr)} [data-field="health_for"]'
            assert (b.text(cell), b.attr(cell, "data-value")) == (text, value), addr

        # ACL hits per scope.
        b.wait_for(lambda b: b.count('[data-field="acl"] tr[data-acl]') == 2, message="ACL rows")
        assert b.texts('[data-field="acl"] tr[data-acl] td:first-child') == ["global", v4.name]
        glob = '[data-field="acl"] tr[data-acl="global"]'
        assert int(b.attr(f'{glob} [data-field="deny"]', "data-value") or 0) % 17 == 0
        assert b.text(f'[data-field="acl"] tr[data-acl="{v4.name}"] [data-field="default"]') == "40"

        # A refused reload: the banner says why until a reload applies.
        assert b.text('[data-field="reload_error"]') == ""
        refusal = (
            "the file drops the runtime ACL deny 203.0.113.0/24 of the global scope; "
            "reload with --force to drop it"
        )
        daemon.reload_error = refusal
        b.wait_for('[data-field="reload_error"]', visible=True, message="the refusal banner")
        assert b.text('[data-field="reload_error_text"]') == refusal
        assert "Last reload refused" in b.text('[data-field="reload_error"]')

        shot = b.screenshot(tmp_path / "status.png")
        width, height = png_size(keep(shot, "status-page.png"))
        assert width == 1280 and 850 <= height <= 900
        assert [m for m in b.console() if m.startswith("SEVERE")] == []
        daemon.reload_error = None
        b.wait_for(lambda b: b.text('[data-field="reload_error"]') == "", message="banner gone")

        # Drain from the page: the row turns "draining" and the bar hands its share to
        # the others, all without a reload (the marker set in the page survives).
        b.js("window.__notReloaded = true")
        drained = row_sel(v4.name, "198.18.0.12")
        b.click(f'{drained} button[data-action="drain"]')
        b.wait_for(
            lambda b: b.text(f'{drained} [data-field="admin"]') == "draining",
            message="drained row",
        )
        assert v4.backends[1].admin == "draining"
        b.wait_for(lambda b: widths_match(b, v4), message="share bar after the drain")
        b.wait_for(
            lambda b: b.text(f'{drained} [data-field="effective_weight"]') == "0",
            message="effective weight after the drain",
        )
        assert b.attr(f"{drained} button", "data-action") == "enable"
        assert b.js("return window.__notReloaded") is True

        # A failed poll says so; the next good one says live again.
        daemon.fail = True
        b.wait_for('body[data-connection="disconnected"]', timeout=5)
        assert b.text('[data-field="connection"]') == "disconnected"
        assert "503" in b.text('[data-field="error"]')
        daemon.fail = False
        b.wait_for('body[data-connection="live"]', timeout=5)
        assert b.text('[data-field="error"]') == ""

        # And back: enable from the page.
        b.click(f'{drained} button[data-action="enable"]')
        b.wait_for(lambda b: b.text(f'{drained} [data-field="admin"]') == "enabled")
        b.wait_for(lambda b: widths_match(b, v4), message="share bar after the enable")
        assert b.js("return window.__notReloaded") is True
        # No script error all along: the only errors are the scripted 503s' failed loads.
        errors = [m for m in b.console() if m.startswith("SEVERE")]
        assert [m for m in errors if "status of 503" not in m] == [], errors


def test_browser_without_namespace(tmp_path: Path) -> None:
    """The harness on its own, in the test's namespace: a file page, its text and a click."""
    page = tmp_path / "page.html"
    page.write_text("<p id=out>0</p><button onclick=\"out.textContent = 'clicked'\">go</button>")
    with Browser() as b:
        b.open(page.as_uri())
        assert b.text("#out") == "0"
        b.click("button")
        b.wait_for(lambda b: b.text("#out") == "clicked")
        assert b.attr("p", "id") == "out"
        assert png_size(b.screenshot(tmp_path / "shot.png"))[0] == 1280
