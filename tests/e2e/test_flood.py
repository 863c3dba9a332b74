"""A spoofed-SYN flood at the lab's highest rate against the real daemon: 100 legitimate
long-lived connections keep their throughput within 20% of the unflooded run measured in
the same test, none breaks, and new legitimate connections made during the flood all
succeed.

The flood (:mod:`xdplb.lab.flood`) is XDP live frames from the client: random sources in
198.19.0.0/16, random source ports, to the VIP's echo port. Everything it causes --
the bridge, lb_xdp, the backends' SYN cookies and SYN-ACKs -- runs in softirq on the
generator's core, so on this 2-core machine one core is the flood's and the other
carries the legitimate load, the daemon and the test. The legitimate load is therefore
paced, not saturating: 100 streams x 1 KiB every 100 ms (1,000 exchanges/s, ~1 MB/s
each way, a few percent of a core in one selector thread). A saturating load would
measure how the scheduler splits two cores between the generator and this process, not
the balancer; a paced one only loses throughput when packets are lost or delayed on
the path (an exchange still outstanding at its next tick skips it).

Backends: SYN cookies on (``net.ipv4.tcp_syncookies = 1``, the default, set here
explicitly) and the echo server's listen backlog of 128 (``xdplb.lab.apps``): the
SYN queue fills with the flood within milliseconds, and from then on every SYN,
legitimate or not, is answered with a cookie, so the accept queue only ever holds
legitimate connections.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.abi import Event
from xdplb.lab import Lab
from xdplb.lab.flood import SynFlood
from xdplb.lab.lbnode import LbNode
from xdplb.lab.paced import PacedStreams, one_shot

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
PORT = 7
STREAMS = 100
#: Seconds of each measured window (unflooded, then flooded).
WINDOW = 8.0
NEW_CONNECTIONS = 50
#: Extra top-level configuration of the LB, e.g. an insert budget (``flood:``) once the
#: configuration has one; the default budget (12,500 inserts per 100 ms per CPU) is
#: above what the lab can send, so the flood is recorded in the table (CONN_MISS).
LB_EXTRA: dict[str, Any] = {}
#: The LB must have seen at least this many of the flood's SYNs as new flows.
MIN_FLOOD_SEEN = 100_000


@pytest.fixture
def lb(lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    for b in lab.backends:
        lab.run(b, ["sysctl", "-q", "-w", "net.ipv4.tcp_syncookies=1"])
    procs = lab.start_servers()
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    node = LbNode(lab, tmp_path, [{"address": VIP, "port": PORT, "backends": backends}], **LB_EXTRA)
    node.start()
    yield node
    node.destroy()
    for p in procs:
        p.kill()
        p.wait()


def new_flows(node: LbNode) -> int:
    """Flows lb_xdp balanced by table: recorded (CONN_MISS) or over budget (CONN_FLOOD)."""
    with node.maps() as maps:
        ev = maps.counters(exact_conns=False).events
    return ev[Event.CONN_MISS] + ev[Event.CONN_FLOOD]


def test_syn_flood_keeps_legit_throughput(lab: Lab, lb: LbNode) -> None:
    ns = lab.ns("client")
    with SynFlood(lab, VIP, PORT) as flood, PacedStreams(ns, VIP, PORT, n=STREAMS) as streams:
        assert len(set(streams.backends)) == len(lab.backends)
        time.sleep(1.0)  # every stream past its first exchanges
        t0 = streams.totals()
        time.sleep(WINDOW)
        t1 = streams.totals()
        baseline = t1.rate(t0)

        seen0 = new_flows(lb)
        flood.start(seconds=WINDOW + 2)
        time.sleep(0.5)  # the SYN queues are full and cookies are in use from here
        f0 = streams.totals()
        fresh: list[str] = []
        slowest = 0.0
        for _ in range(NEW_CONNECTIONS):
            t = time.monotonic()
            fresh.append(one_shot(ns, VIP, PORT))  # raises if any step fails
            slowest = max(slowest, time.monotonic() - t)
            time.sleep(max(0.0, WINDOW / NEW_CONNECTIONS - (time.monotonic() - t)))
        f1 = streams.totals()
        flooded = f1.rate(f0)
        result = flood.wait()
        seen = new_flows(lb) - seen0 - NEW_CONNECTIONS

    report = (
        f"baseline {baseline / 1e3:.0f} kB/s, flooded {flooded / 1e3:.0f} kB/s "
        f"(nominal {streams.nominal_rate / 1e3:.0f}); missed ticks {f0.missed - t1.missed}"
        f" -> {f1.missed - f0.missed}; slowest exchange {streams.max_latency * 1e3:.0f} ms; "
        f"flood sent {result.sent} ({result.pps / 1e3:.0f} kpps), LB saw {seen} new flows "
        f"({seen / result.seconds / 1e3:.0f} k/s); slowest new connection {slowest * 1e3:.0f} ms"
    )
    print(report)
    assert streams.broken == [], report
    assert baseline > 0.9 * streams.nominal_rate, report
    assert flooded >= 0.8 * baseline, report
    assert len(fresh) == NEW_CONNECTIONS and set(fresh) <= set(lab.backends), report
    # The flood arrived. (What the generator sent but lb_xdp never saw was dropped by a
    # full veth ring on the way: the generator outruns the path; see the report.)
    assert seen >= MIN_FLOOD_SEEN, report
