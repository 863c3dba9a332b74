"""Graceful drain through the real daemon and the real CLI: a drained backend gets no new
connection, its established connections finish their transfers intact, and
``xdplb backend drain --wait`` returns once the last one has closed (the backends' agents
count their open connections), not before. ``backend enable`` brings it back."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from xdplb.lab import Lab
from xdplb.lab.agents import start_agent
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
VIP_NAME = f"{VIP}:7/tcp"
PORT = 19701


@pytest.fixture
def lb(lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    procs = lab.start_servers()
    to = f"{lab.addr('lb')}:{PORT}"
    agents = [start_agent(lab, b, to=to, interval=0.2) for b in lab.backends]
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    node = LbNode(
        lab,
        tmp_path,
        [{"address": VIP, "port": 7, "backends": backends}],
        agents={"listen": to},
    )
    node.start()
    yield node
    node.destroy()
    for p in [*procs, *agents]:
        p.kill()
        p.wait()


def first_hops(node: LbNode) -> set[str]:
    with node.maps() as maps:
        snap = maps.snapshot()
    (params,) = snap.vips.values()
    table = snap.tables[params.vip_id]
    return {str(snap.backends[i].addr) for i in table.counts()}


def test_drain_wait_enable(lab: Lab, lb: LbNode) -> None:
    b1 = str(lab.addr("b1"))
    ns = lab.ns("client")
    streams = [EchoStream.open(ns, VIP, 7) for _ in range(30)]
    on_b1 = [s for s in streams if s.backend == "b1"]
    assert len(on_b1) >= 3, [s.backend for s in streams]
    drain = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xdplb.cli.app",
            "backend",
            "drain",
            VIP_NAME,
            b1,
            "--wait",
            "--timeout",
            "60",
            "-i",
            lb.instance,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(
            lambda: first_hops(lb),
            "b1 out of the table",
            until=lambda hops: b1 not in hops,
            detail=lb.log_tail,
        )
        # No new connection lands on b1.
        fresh = [EchoStream.open(ns, VIP, 7) for _ in range(30)]
        assert "b1" not in {s.backend for s in fresh}
        for s in fresh:
            s.close()
        # Its established connections go on, byte for byte, and the agent counts them.
        for _ in range(20):
            for s in streams:
                s.exchange(2048)
        with lb.api() as api:
            path = f"/api/v1/vips/{VIP}/7/tcp/backends/{b1}/drain"
            # A count from a report sent after the drain began (done is None before).
            st = wait_for(
                lambda: api.get(path).json(),
                f"the agent's count of b1's {len(on_b1)} connections",
                until=lambda st: st["done"] is not None and st["established"] == len(on_b1),
                interval=0.05,
            )
            assert st["admin"] == "draining" and st["done"] is False
            assert drain.poll() is None  # still waiting
            for s in streams:
                if s.backend != "b1":
                    s.close()
            # Nothing must happen: 0.5 s holds two agent reports (every 0.2 s) of the closes.
            time.sleep(0.5)
            assert drain.poll() is None  # other backends' connections do not count
            for s in on_b1:
                s.close()
            closed = time.monotonic()
            # Well before its --timeout of 60 s: it returns on the agent's count.
            out, _ = drain.communicate(timeout=30)
            assert drain.returncode == 0, out
            print(f"--wait returned {time.monotonic() - closed:.2f} s after the last close")
            st = api.get(path).json()
            assert st["admin"] == "drained" and st["established"] == 0 and st["done"] is True
        done = lb.cli("backend", "enable", VIP_NAME, b1)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(
            lambda: first_hops(lb),
            "b1 back in the table",
            until=lambda hops: b1 in hops,
            detail=lb.log_tail,
        )
    finally:
        drain.kill()
        drain.wait()
        for s in streams:
            s.close()
