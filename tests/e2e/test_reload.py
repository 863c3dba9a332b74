"""Hot reload under load: 200 streaming connections live through reloads by SIGHUP and by
the API (weights, a new backend, a new VIP); a configuration that fails validation
changes nothing and names the field; no packet is dropped meanwhile."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream, ExchangeError
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
STREAMS = 200


def vips(lab: Lab, weights: dict[str, int], *, extra: bool = False) -> list[dict[str, Any]]:
    backends = [{"address": str(lab.addr(b)), "weight": w} for b, w in weights.items()]
    out = [{"address": VIP, "port": 7, "backends": backends}]
    if extra:
        out.append({"address": VIP, "port": 80, "backends": backends})
    return out


@pytest.fixture
def lb(lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    procs = lab.start_servers()
    node = LbNode(lab, tmp_path, vips(lab, {"b1": 1, "b2": 1}))
    node.start()
    yield node
    node.destroy()
    for p in procs:
        p.kill()
        p.wait()


class Streams:
    """``STREAMS`` echo connections, exchanging bytes round-robin in a thread."""

    def __init__(self, lab: Lab) -> None:
        ns = lab.ns("client")
        self.streams = [EchoStream.open(ns, VIP, 7) for _ in range(STREAMS)]
        self.broken: list[str] = []
        self._dead: set[int] = set()
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, s in enumerate(self.streams):
                if i in self._dead:
                    continue
                try:
                    s.exchange(512)
                except ExchangeError as e:
                    self._dead.add(i)
                    self.broken.append(str(e))
            self.rounds += 1

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def wait_rounds(self, n: int = 2) -> None:
        """Until every stream has exchanged bytes ``n`` more times."""
        target = self.rounds + n
        wait_for(
            lambda: self.rounds,
            f"{n} more rounds of exchanges (to round {target})",
            until=lambda rounds: rounds >= target or not self._thread.is_alive(),
            interval=0.01,
            detail=lambda: f"broken: {self.broken}",
        )
        assert self._thread.is_alive(), "the streams' thread died"

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for s in self.streams:
            s.close()


def drops(node: LbNode) -> int:
    with node.maps() as maps:
        return sum(maps.counters(exact_conns=False).drops.values())


def test_reloads_under_load_break_nothing(lab: Lab, lb: LbNode) -> None:
    before = drops(lb)
    with Streams(lab) as streams:
        streams.wait_rounds()
        assert {s.backend for s in streams.streams} == {"b1", "b2"}
        # SIGHUP: weights change, a backend joins, a VIP appears.
        lb.reload(vips(lab, {"b1": 2, "b2": 1}))
        streams.wait_rounds()
        lb.reload(vips(lab, {"b1": 2, "b2": 1, "b3": 1}, extra=True))
        streams.wait_rounds()
        # A configuration that fails validation changes nothing.
        bad = lb.config_path.read_text().replace("weight: 2", "weight: 70000")
        lb.config_path.write_text(bad)
        with lb.api() as api:
            resp = api.post("/api/v1/reload")
            assert resp.status_code == 422, resp.text
            assert resp.json()["field"] == "vips[0].backends[0].weight"
            # Through the API: the running configuration with b3 weighted 3.
            cfg = api.get("/api/v1/config").json()
            cfg["vips"][0]["backends"][2]["weight"] = 3
            resp = api.put("/api/v1/config", json=cfg)
            assert resp.status_code == 200, resp.text
            assert resp.json()["runtime_changes"] is True
            streams.wait_rounds()
            st = api.get("/api/v1/status").json()
        (vip7,) = [v for v in st["vips"] if v["port"] == 7]
        assert [b["weight"] for b in vip7["backends"]] == [2, 1, 3]
        assert abs(vip7["backends"][2]["table_share"] - 0.5) < 0.01
        streams.wait_rounds()
    assert streams.broken == []
    assert drops(lb) == before
