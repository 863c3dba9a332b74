"""The agent on a backend counts its server-side connections for real: sock_diag in the
backend's namespace, reports over UDP to a receiver in the LB's namespace, the daemon's
tracker (:class:`xdplb.control.drain.ConnectionCounts`) reading them.

No LB runs: connections reach b1 either from inside b1 itself (to the VIPs on its
loopback, so both ends are b1's sockets and its client-side ones must not count) or from
the client straight to b1's own segment address (the servers listen on the wildcard).
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from xdplb.agent.receiver import ReportReceiver
from xdplb.control.drain import ConnectionCounts, Count, drain_done
from xdplb.core.reports import LoadReport
from xdplb.lab import Lab
from xdplb.lab.agents import start_agent
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP4 = ipaddress.ip_address("198.18.100.1")
VIP6 = ipaddress.ip_address("fd78:6470:6c62:100::1")
ECHO = 7


@pytest.fixture(scope="module")
def servers(lab: Lab) -> None:
    lab.start_servers()


@pytest.fixture
def receiver(lab: Lab) -> Iterator[ReportReceiver]:
    with lab.enter("lb"):
        r = ReportReceiver((str(lab.addr("lb")), 0))
    with r:
        yield r


class Reports:
    """What came in, fed to a ConnectionCounts as the daemon will."""

    def __init__(self, receiver: ReportReceiver) -> None:
        self.receiver = receiver
        self.counts = ConnectionCounts()
        self.last: dict[str, LoadReport] = {}

    def wait(self, what: str, ok: Callable[[], bool], timeout: float = 5.0) -> None:
        """Take in the reports until ``ok()``; fails naming ``what`` and the last reports."""

        def take_in() -> bool:
            for r in self.receiver.poll():
                self.counts.observe(r, r.at)
                self.last[r.backend] = r
            return ok()

        wait_for(take_in, what, timeout=timeout, detail=lambda: f"last reports {self.last}")


def connect(
    lab: Lab, node: str, addr: ipaddress.IPv4Address | ipaddress.IPv6Address
) -> socket.socket:
    """An echo connection from ``node`` to ``addr``, past the server's greeting."""
    with lab.enter(node):
        s = socket.create_connection((str(addr), ECHO), timeout=2.0)
    assert s.recv(16) == b"b1\n"  # accepted by b1's server
    return s


def stop(agent: subprocess.Popen[Any]) -> None:
    agent.terminate()
    assert agent.wait(timeout=5) == 0  # SIGTERM is a clean stop


def test_the_agent_counts_established_server_connections(
    lab: Lab, servers: None, receiver: ReportReceiver
) -> None:
    b1 = lab.addr("b1")  # the backend's identity, and where the client connects to
    host, port = receiver.address
    agent = start_agent(lab, "b1", f"{host}:{port}", 0.2)
    seen = Reports(receiver)
    seen.wait("first report", lambda: seen.counts.established(b1, VIP4, ECHO) is not None)
    assert seen.last[str(b1)].conns == {}

    local = [connect(lab, "b1", VIP4) for _ in range(5)]  # both ends in b1
    local6 = connect(lab, "b1", VIP6)
    remote = [connect(lab, "client", b1) for _ in range(2)]
    try:
        expected = {(VIP4, ECHO): 5, (VIP6, ECHO): 1, (b1, ECHO): 2}
        # Exactly these: b1's six client-side sockets (local address a VIP, local port
        # ephemeral) are not in it, nor are the listeners.
        seen.wait("5 + 1 + 2 connections", lambda: seen.last[str(b1)].conns == expected)
        at = seen.last[str(b1)].at
        assert seen.counts.established(b1, VIP4, ECHO) == Count(5, at)
        assert seen.counts.established(b1, VIP4, 0) == Count(5, at)  # the wildcard VIP
        assert seen.counts.established(b1, VIP4, 80) == Count(0, at)

        for s in local[:3]:
            s.close()
        closed_at = time.monotonic()
        seen.wait(
            "2 left",
            lambda: (
                seen.counts.established(b1, VIP4, ECHO) == Count(2, seen.last[str(b1)].at)
                and seen.last[str(b1)].at > closed_at
            ),
        )
        assert drain_done(seen.counts.established(b1, VIP4, ECHO), closed_at) is False
        assert seen.counts.established(b1, b1, ECHO) == Count(2, seen.last[str(b1)].at)
    finally:
        for s in [*local, local6, *remote]:
            s.close()
    drained_at = time.monotonic()
    seen.wait(
        "all closed",
        lambda: (
            drain_done(seen.counts.established(b1, VIP4, ECHO), drained_at) is True
            and seen.last[str(b1)].conns == {}
        ),
    )
    assert drain_done(seen.counts.established(b1, b1, 0), drained_at) is True
    stop(agent)


def test_the_agent_reports_host_tc_counters_when_pinned(
    lab: Lab, servers: None, receiver: ReportReceiver
) -> None:
    host, port = receiver.address
    agents = [
        start_agent(lab, "b1", f"{host}:{port}", 0.2),  # the lab's host_tc pins of b1
        start_agent(lab, "b2", f"{host}:{port}", 0.2, host_instance=f"{lab.prefix}-none"),
    ]
    b1, b2 = lab.addr("b1"), lab.addr("b2")
    seen = Reports(receiver)
    seen.wait("both reporting", lambda: str(b1) in seen.last and str(b2) in seen.last)
    first = seen.counts.chain_events(b1)
    assert first is not None and {"pass", "forward", "decap_gue"} <= set(first)
    assert seen.counts.chain_events(b2) is None  # no pins: no field, not an error
    assert seen.last[str(b2)].chain is None and seen.last[str(b2)].conns == {}

    # Packets into b1's eth0 that are not tunnelled: host_tc passes (and counts) them.
    for _ in range(3):
        connect(lab, "client", b1).close()
    seen.wait(
        "pass counted",
        lambda: (seen.counts.chain_events(b1) or {}).get("pass", 0) >= first["pass"] + 6,
    )
    for a in agents:
        stop(a)
