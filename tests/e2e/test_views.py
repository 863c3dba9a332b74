"""``xdplb list`` against the real daemon: ``--connections`` shows exactly the TCP
connections a test holds through lb_xdp (client ports and the backends that answered),
its filters narrow them, the VIP view counts them per backend; and a UDP drain with
``--wait`` returns once the flow has stopped for the VIP's idle time, not before."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from xdplb.lab import Lab
from xdplb.lab.agents import start_agent
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream, udp_exchange
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
PORT = 19702
IDLE = 1.5


@pytest.fixture
def lb(lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    procs = lab.start_servers()
    to = f"{lab.addr('lb')}:{PORT}"
    agents = [start_agent(lab, b, to=to, interval=0.2) for b in lab.backends]
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    node = LbNode(
        lab,
        tmp_path,
        [
            {"address": VIP, "port": 7, "backends": backends},
            {
                "address": VIP,
                "port": 53,
                "protocol": "udp",
                "udp_drain_idle": IDLE,
                "backends": backends,
            },
        ],
        agents={"listen": to},
    )
    node.start()
    yield node
    node.destroy()
    for p in [*procs, *agents]:
        p.kill()
        p.wait()


def listed(lb: LbNode, *args: str) -> list[dict[str, object]]:
    r = lb.cli("list", "--connections", "--json", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_list_connections_shows_the_live_connections(lab: Lab, lb: LbNode) -> None:
    ns = lab.ns("client")
    streams = [EchoStream.open(ns, VIP, 7) for _ in range(12)]
    try:
        # What the backends saw: each greeting names the backend that accepted.
        held = {s.sock.getsockname()[1]: str(lab.addr(s.backend)) for s in streams}
        client = str(lab.addr("client"))
        got = listed(lb)
        assert {c["client_port"]: c["backend"] for c in got} == held
        assert len(got) == len(held)
        assert {(c["protocol"], c["client"], c["vip"]) for c in got} == {
            ("tcp", client, f"{VIP}:7/tcp")
        }
        # Filters narrow them.
        b1 = str(lab.addr("b1"))
        on_b1 = {p for p, b in held.items() if b == b1}
        assert {c["client_port"] for c in listed(lb, "--backend", b1)} == on_b1
        assert listed(lb, "--vip", f"{VIP}:53/udp") == []
        assert len(listed(lb, "--vip", f"{VIP}:7/tcp", "--limit", "5")) == 5
        assert len(listed(lb, "--client", f"{client}/32")) == len(held)
        assert listed(lb, "--client", "203.0.113.0/24") == []
        text = lb.cli("list", "--connections", "--backend", b1)
        assert text.returncode == 0 and len(text.stdout.splitlines()) == 1 + len(on_b1)

        # The VIP view: the agents count each backend's connections (ESTABLISHED).
        def active() -> dict[str, object]:
            r = lb.cli("list", "--json")
            assert r.returncode == 0, r.stderr
            (tcp,) = [v for v in json.loads(r.stdout) if v["port"] == 7]
            return {
                b["address"]: (b["active"], b["inactive"], b["conns_source"])
                for b in tcp["backends"]
            }

        want = {
            str(lab.addr(b)): (sum(1 for x in held.values() if x == str(lab.addr(b))), 0, "agent")
            for b in lab.backends
        }
        wait_for(active, "the agents' counts of the held connections", until=lambda a: a == want)
        # The same listing from the pins.
        off = listed(lb, "--offline")
        assert {c["client_port"]: c["backend"] for c in off} == held
    finally:
        for s in streams:
            s.close()


def test_udp_drain_wait_returns_when_the_flow_stops(lab: Lab, lb: LbNode) -> None:
    """Failure 7: the agents count UDP, so a UDP drain's --wait ends; it ends once the
    flow's packets have stopped for ``udp_drain_idle``, and they reach the drained
    backend until then."""
    ns = lab.ns("client")
    sport = 45053
    first = udp_exchange(ns, VIP, 53, b"hello", src_port=sport)
    backend = str(lab.addr(first))
    stop = threading.Event()
    answered: list[str] = []

    def flow() -> None:
        while not stop.is_set():
            answered.append(udp_exchange(ns, VIP, 53, b"ping", src_port=sport))
            time.sleep(0.1)

    t = threading.Thread(target=flow, daemon=True)
    t.start()
    drain = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xdplb.cli.app",
            "backend",
            "drain",
            f"{VIP}:53/udp",
            backend,
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
        path = f"/api/v1/vips/{VIP}/53/udp/backends/{backend}/drain"
        with lb.api() as api:
            st = wait_for(
                lambda: api.get(path).json(),
                "a drain status that knows (an agent's UDP count after the drain began)",
                until=lambda st: st["done"] is not None,
            )
            assert st["done"] is False and st["admin"] == "draining"
            n = len(answered)
            # The flow keeps going to the drained backend, and the drain keeps waiting.
            wait_for(lambda: len(answered), "more echoes", until=lambda k: k >= n + 3 * IDLE / 0.1)
            assert drain.poll() is None
            assert set(answered) == {first}
            stop.set()
            t.join(5)
            stopped = time.monotonic()
            out, _ = drain.communicate(timeout=30)
            took = time.monotonic() - stopped
            assert drain.returncode == 0, out
            assert took >= IDLE - 0.3, (took, out)  # not before the idle time passed
            st = api.get(path).json()
            assert st["admin"] == "drained" and st["done"] is True and st["idle"] >= IDLE
    finally:
        stop.set()
        drain.kill()
        drain.wait()
