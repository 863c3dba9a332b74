"""UDP flows through the real daemon when their backend goes (issue 11, found by running
another balancer's tests): a backend whose server dies is taken out by its health check,
and its UDP flows move to the others at once, whether or not its address serves another
VIP; a drained backend keeps its UDP flows until they go idle (``sessions.udp_timeout``),
then they move; the other backends' flows never move.

Each flow is one connected UDP socket of the client, kept for the whole test, so that its
5-tuple stays the same: the backend that answers a datagram is the flow's backend.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import open_socket
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
#: A second VIP on another address whose backends include every one of the first's: the
#: outcome must not depend on whether the backend's address still serves another VIP.
OTHER_VIP = "198.18.100.2"
PORT = 53
FLOWS = 24
#: Idle time after which a UDP session expires (and a drained backend's flow moves).
UDP_TIMEOUT = 3.0
WAIT = 15.0


def udp_check() -> dict[str, Any]:
    return {
        "checker": {"udp": {}},
        "interval_ms": 300,
        "timeout_ms": 200,
        "fall_count": 2,
        "rise_count": 2,
    }


@pytest.fixture
def lb(lab: Lab, tmp_path: Path, lab_servers: Any) -> Iterator[LbNode]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    vips = [
        {"address": VIP, "port": PORT, "protocol": "udp", "health": udp_check(),
         "backends": backends},
        {"address": OTHER_VIP, "port": PORT, "protocol": "udp", "backends": backends},
    ]  # fmt: skip
    node = LbNode(lab, tmp_path, vips, sessions={"udp_timeout": UDP_TIMEOUT})
    node.start()
    yield node
    node.destroy()


class Flow:
    """One client UDP flow to the VIP: a connected socket that keeps its 5-tuple."""

    def __init__(self, lab: Lab) -> None:
        self.sock = open_socket(lab.ns("client"), VIP, socket.SOCK_DGRAM, None)
        self.sock.connect((VIP, PORT))
        self.sock.settimeout(0.3)
        self.n = 0

    def ask(self, tries: int = 3) -> str | None:
        """One numbered datagram; the backend that echoed it, None if none did."""
        for _ in range(tries):
            self.n += 1
            payload = f"flow {self.sock.getsockname()[1]} #{self.n}".encode()
            self.sock.send(payload)
            try:
                while True:
                    data = self.sock.recv(65536)
                    name, _, echoed = data.partition(b"\n")
                    if echoed == payload:
                        return name.decode()
                    # an echo of an earlier, late datagram: read on
            except (TimeoutError, ConnectionRefusedError):
                continue
        return None


@pytest.fixture
def flows(lab: Lab) -> Iterator[list[Flow]]:
    with ExitStack() as stack:
        out = [Flow(lab) for _ in range(FLOWS)]
        for f in out:
            stack.callback(f.sock.close)
        yield out


def backends_of(flows: list[Flow]) -> list[str | None]:
    return [f.ask() for f in flows]


def wait_for_share(node: LbNode, lab: Lab, name: str, present: bool) -> None:
    addr = str(lab.addr(name))

    def share() -> bool:
        with node.maps() as maps:
            snap = maps.snapshot()
        params = next(p for v, p in snap.vips.items() if str(v.addr) == VIP)
        table = snap.tables.get(params.vip_id)
        ids = {i for i, b in snap.backends.items() if str(b.addr) == addr}
        return table is not None and bool(ids & set(table.counts())) == present

    wait_for(share, f"{name} {'in' if present else 'out of'} {VIP}'s table", timeout=WAIT)


def test_a_dead_backends_udp_flows_move_at_once(
    lab: Lab, lb: LbNode, lab_servers: dict[str, subprocess.Popen[str]], flows: list[Flow]
) -> None:
    before = backends_of(flows)
    assert None not in before, f"every flow answered: {before}"
    counts = {b: before.count(b) for b in set(before)}
    victim = max(counts, key=lambda b: counts[b])
    assert counts[victim] >= 2 and len(counts) >= 2, counts
    lab_servers[victim].kill()
    lab_servers[victim].wait()
    t0 = time.monotonic()
    wait_for_share(lb, lab, victim, present=False)
    took_health = time.monotonic() - t0

    # Its flows move, each to another backend, at once (well within the UDP timeout);
    # the others stay where they were.
    def moved() -> list[str | None] | None:
        now = backends_of(flows)
        return now if None not in now else None

    after = wait_for(moved, "every flow answered after its backend died", timeout=UDP_TIMEOUT)
    took = time.monotonic() - t0
    for i, (b0, b1) in enumerate(zip(before, after, strict=True)):
        if b0 == victim:
            assert b1 != victim, f"flow {i} still goes to the dead {victim}"
        else:
            assert b1 == b0, f"flow {i} moved from {b0} to {b1}, its backend did not fail"
    print(f"health took {victim} out in {took_health:.2f} s; its flows answered "
          f"again {took:.2f} s after the kill")  # fmt: skip


def test_a_drained_backend_keeps_its_udp_flows_until_they_go_idle(
    lab: Lab, lb: LbNode, flows: list[Flow]
) -> None:
    before = backends_of(flows)
    assert None not in before
    counts = {b: before.count(b) for b in set(before)}
    victim = max(counts, key=lambda b: counts[b])
    mine = [i for i, b in enumerate(before) if b == victim]
    addr = str(lab.addr(victim))
    with lb.api() as api:
        r = api.post(f"/api/v1/vips/{VIP}/{PORT}/udp/backends/{addr}/drain")
        assert r.status_code < 300, r.text
    wait_for_share(lb, lab, victim, present=False)

    # Busy flows stay on the drained backend, past the idle timeout: they are not idle.
    end = time.monotonic() + UDP_TIMEOUT + 1.0
    while time.monotonic() < end:  # the scenario: traffic for longer than the timeout
        now = backends_of([flows[i] for i in mine])
        assert now == [victim] * len(mine), f"a busy flow of the drained {victim} moved: {now}"
        time.sleep(0.3)
    # A new flow goes elsewhere.
    fresh = Flow(lab)
    try:
        assert fresh.ask() not in (victim, None)
    finally:
        fresh.sock.close()
    # Idle past the timeout, they move.
    time.sleep(UDP_TIMEOUT + 0.5)  # the scenario: silence for longer than the timeout
    after = [flows[i].ask() for i in mine]
    assert None not in after and victim not in after, (
        f"idle flows of the drained {victim} did not move: {after}"
    )
