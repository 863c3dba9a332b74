"""Load-aware weights through the real daemon: reports from the backends' namespaces move
the live table away from the loaded backend, and only for the VIP that asked for it."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from xdplb.agent.wire import WireReport, encode_report
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

PORT = 19700


@pytest.fixture
def lb(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LbNode]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    vips = [
        {"address": "198.18.100.1", "port": 80, "load_feedback": True, "backends": backends},
        {"address": "198.18.100.1", "port": 443, "backends": backends},
    ]
    feedback = {
        "min_interval": 1.0,
        "settle": 0.2,
        "max_age": 2.0,
        "gain": 1.0,
    }
    agents = {"listen": f"{lab.addr('lb')}:{PORT}"}
    node = LbNode(lab, tmp_path_factory.mktemp("fb"), vips, agents=agents, load_feedback=feedback)
    node.start(wait=False)
    yield node
    node.destroy()


def shares(node: LbNode, port: int) -> dict[str, float]:
    """Table share of each backend address for the TCP VIP on ``port``."""
    try:
        maps = node.maps()
    except FileNotFoundError:  # the daemon has not pinned its maps yet
        return {}
    with maps:
        snap = maps.snapshot()
    vip = next((p for v, p in snap.vips.items() if v.port == port), None)
    if vip is None or vip.vip_id not in snap.tables:
        return {}
    table = snap.tables[vip.vip_id]
    return {str(snap.backends[i].addr): c / len(table) for i, c in table.counts().items()}


def report(lab: Lab, backend: str, cpu: float, seq: int) -> None:
    """One agent report, sent from the backend's own namespace to the LB."""
    with lab.enter(backend):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with sock:
        wire = WireReport(backend=str(lab.addr(backend)), cpu=cpu, rps=100.0, seq=seq)
        sock.sendto(encode_report(wire), (str(lab.addr("lb")), PORT))


def test_a_loaded_backend_loses_weight(lab: Lab, lb: LbNode) -> None:
    wait_for(
        lambda: shares(lb, 80),
        "three backends in the table",
        until=lambda sh: len(sh) == 3,
        detail=lb.log_tail,
    )
    b1 = str(lab.addr("b1"))
    assert shares(lb, 80)[b1] == pytest.approx(1 / 3, abs=0.01)
    seq = iter(range(1, 1 << 30))

    def reports_then_shares() -> dict[str, float]:
        """One round of reports (b1 loaded, the others not), then the table."""
        n = next(seq)
        for name, cpu in (("b1", 0.9), ("b2", 0.3), ("b3", 0.3)):
            report(lab, name, cpu, n)
        return shares(lb, 80)

    # Reports every 0.2 s, as agents send them, until the table has moved.
    after = wait_for(
        reports_then_shares,
        "b1's share below 0.25",
        until=lambda sh: sh.get(b1, 0.0) <= 0.25,
        timeout=15,
        interval=0.2,
        detail=lb.log_tail,
    )
    b2, b3 = after[str(lab.addr("b2"))], after[str(lab.addr("b3"))]
    # What b1 lost went to the others. Each report moves one backend's weight, so the
    # table may be read between b2's step and b3's: neither lost any share (Maglev
    # rounds a third to 0.33299), together they gained.
    assert b2 + b3 > 0.75 - 1e-3 and min(b2, b3) > 1 / 3 - 0.01, after
    # The VIP that did not ask for load feedback keeps its configured weights.
    assert shares(lb, 443)[b1] == pytest.approx(1 / 3, abs=0.01)
    assert "load feedback" in lb.log_tail(40)
