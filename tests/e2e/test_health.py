"""Health checks through the real daemon: a backend whose server dies leaves the table,
new connections avoid it, it comes back once its server answers again; checks travel
through the tunnel, so a backend whose decapsulation is broken is down too; when every
backend is down the VIP keeps its last table and says so.

How many checks it takes (fall_count, rise_count) and when they run are the monitor's
(tests/unit/test_health_monitor.py); here the time each change took is printed, not
asserted: a busy machine delays it, and speed is the benchmarks' business.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.datapath import tc_detach
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import ExchangeError, http_post
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
INTERVAL = 0.3
JITTER = 0.1
FALL, RISE = 2, 2
#: How long a change may take before the test gives up on it (it takes about a second).
WAIT = 15.0


def check(**kw: Any) -> dict[str, Any]:
    return {
        "checker": {"http": {"uri": "/", "codes": [200]}},
        "interval_ms": int(INTERVAL * 1000),
        "timeout_ms": 200,
        "fall_count": FALL,
        "rise_count": RISE,
        "jitter": JITTER,
        **kw,
    }


@pytest.fixture
def lb(lab: Lab, tmp_path: Path, lab_servers: Any) -> Iterator[LbNode]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    vips = [{"address": VIP, "port": 80, "health": check(), "backends": backends}]
    node = LbNode(lab, tmp_path, vips)
    node.start()
    yield node
    node.destroy()


def shares(node: LbNode) -> dict[str, float]:
    """Table share per backend address of the VIP, as the maps hold it now."""
    with node.maps() as maps:
        snap = maps.snapshot()
    params = next(iter(snap.vips.values()))
    table = snap.tables.get(params.vip_id)
    if table is None:
        return {}
    return {str(snap.backends[i].addr): n / len(table) for i, n in table.counts().items()}


def wait_shares(node: LbNode, what: str, until: Callable[[dict[str, float]], object]) -> float:
    """Seconds until the table's shares satisfy ``until`` (fails after ``WAIT``, with the
    last shares and the daemon's log)."""
    t0 = time.monotonic()
    wait_for(
        lambda: shares(node), what, until=until, timeout=WAIT, interval=0.01, detail=node.log_tail
    )
    return time.monotonic() - t0


class Traffic:
    """New HTTP connections from the client, one after another, in a thread."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        # (when the connection began, backend or None: failed). The start, not the end:
        # an answer b2 gave just before it was killed can be logged just after.
        self.log: list[tuple[float, str | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ns = self.lab.ns("client")
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                who: str | None = http_post(ns, VIP, 80, b"x", timeout=1.0)
            except ExchangeError:
                who = None
            self.log.append((began, who))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def since(self, t: float) -> Counter[str | None]:
        return Counter(who for at, who in self.log if at >= t)


def test_dead_backend_leaves_and_returns(
    lab: Lab, lb: LbNode, lab_servers: dict[str, subprocess.Popen[str]]
) -> None:
    b2 = str(lab.addr("b2"))
    wait_shares(lb, "three backends in the table", lambda sh: len(sh) == 3)
    with Traffic(lab) as traffic:
        wait_for(
            lambda: traffic.since(0),
            "new connections reaching every backend",
            until=lambda got: all(got[b] > 0 for b in lab.backends),
        )
        lab_servers["b2"].kill()
        lab_servers["b2"].wait()
        killed = time.monotonic()
        out = wait_shares(lb, "b2 out of the table", lambda sh: b2 not in sh)
        gone = time.monotonic()
        # Only connections before b2 was out could fail; after, every one succeeds
        # and none lands on b2.
        after = wait_for(
            lambda: traffic.since(gone),
            "new connections to b1 and b3 after b2 left",
            until=lambda got: got["b1"] > 5 and got["b3"] > 5,
        )
        assert after[None] == 0 and after["b2"] == 0, after
        assert all(who != "b2" for at, who in traffic.log if killed < at)
        lab_servers["b2"] = lab.start_servers(names=["b2"])[0]
        back = wait_shares(lb, "b2 back in the table", lambda sh: b2 in sh)
        returned = time.monotonic()
        wait_for(
            lambda: traffic.since(returned),
            "new connections landing on b2 again",
            until=lambda got: got["b2"] > 0,
        )
    print(f"b2 out {out:.2f} s after its server died, back {back:.2f} s after it returned")
    with lb.api() as api:
        st = api.get("/api/v1/status").json()
    (b,) = [b for b in st["vips"][0]["backends"] if b["address"] == b2]
    assert b["health"] == "up" and b["effective_weight"] == 1


def test_broken_decap_is_down(lab: Lab, lb: LbNode) -> None:
    """The check goes through the tunnel: b3 without host_tc fails it."""
    b3 = str(lab.addr("b3"))
    wait_shares(lb, "three backends in the table", lambda sh: len(sh) == 3)
    att = lab.hosts["b3"]
    with lab.enter("b3"):
        tc_detach(att.ifindex, ingress=True)
    try:
        wait_shares(lb, "b3 out", lambda sh: b3 not in sh)
        with lb.api() as api:
            st = api.get("/api/v1/status").json()
        (b,) = [b for b in st["vips"][0]["backends"] if b["address"] == b3]
        assert b["health"] == "down" and "timeout" in b["health_detail"], b
    finally:
        with lab.enter("b3"):
            att.dp.attach(att.ifindex)
    wait_shares(lb, "b3 back", lambda sh: b3 in sh)


def test_all_down_keeps_the_last_table(
    lab: Lab, lb: LbNode, lab_servers: dict[str, subprocess.Popen[str]]
) -> None:
    b3 = str(lab.addr("b3"))
    wait_shares(lb, "three backends in the table", lambda sh: len(sh) == 3)
    for name in ("b1", "b2"):
        lab_servers[name].kill()
    wait_shares(lb, "only b3 left", lambda sh: list(sh) == [b3])
    lab_servers["b3"].kill()
    with lb.api() as api:
        wait_for(
            lambda: api.get("/api/v1/status").json()["vips"][0],
            "all_down in status",
            until=lambda vip: vip["all_down"],
            timeout=WAIT,
            detail=lb.log_tail,
        )
        metrics = api.get("/metrics").text
    assert list(shares(lb)) == [b3]  # the last table: traffic is not black-holed
    assert f'xdplb_vip_all_down{{vip="{VIP}:80/tcp"}} 1.0' in metrics
    lab_servers.update(zip(lab.backends, lab.start_servers(), strict=True))
    wait_shares(lb, "all three back", lambda sh: len(sh) == 3)
