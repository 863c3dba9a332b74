"""The daemon's view of drained backends' connections: what the latest report says, for
which VIP, and whether it was measured after the drain began."""

from __future__ import annotations

import ipaddress

import pytest

from xdplb.control.drain import ConnectionCounts, Count, backend_address, drain_done
from xdplb.core.reports import ConnKey, LoadReport

pytestmark = pytest.mark.unit

B1 = ipaddress.ip_address("198.18.0.11")
B2 = ipaddress.ip_address("fd78:6470:6c62::12")
VIP4 = ipaddress.ip_address("198.18.100.1")
VIP6 = ipaddress.ip_address("fd78:6470:6c62:100::1")
MAPPED = ipaddress.ip_address("::ffff:198.18.100.1")


def report(
    backend: str,
    at: float,
    conns: dict[ConnKey, int] | None,
    *,
    truncated: bool = False,
    chain: dict[str, int] | None = None,
) -> LoadReport:
    return LoadReport(backend, 0.5, 1.0, at, conns, truncated, chain)


def test_no_report_yet_is_none() -> None:
    c = ConnectionCounts()
    assert c.established(B1, VIP4, 80) is None
    assert c.chain_events(B1) is None


def test_counts_of_the_latest_report() -> None:
    c = ConnectionCounts()
    c.observe(report("198.18.0.11", 1.0, {(VIP4, 80): 5, (VIP4, 443): 1}), 1.0)
    assert c.established(B1, VIP4, 80) == Count(5, 1.0)
    assert c.established(B1, VIP4, 443) == Count(1, 1.0)
    assert c.established(B1, VIP4, 22) == Count(0, 1.0)  # not listed: none open
    assert c.established(B1, VIP6, 80) == Count(0, 1.0)
    assert c.established(B2, VIP4, 80) is None  # another backend has not reported
    c.observe(report("198.18.0.11", 2.0, {(VIP4, 80): 2}), 2.0)
    assert c.established(B1, VIP4, 80) == Count(2, 2.0)
    assert c.established(B1, VIP4, 443) == Count(0, 2.0)


def test_the_wildcard_vip_sums_every_port_of_its_address() -> None:
    c = ConnectionCounts()
    c.observe(report("198.18.0.11", 1.0, {(VIP4, 80): 5, (VIP4, 443): 2, (VIP6, 80): 7}), 1.0)
    assert c.established(B1, VIP4, 0) == Count(7, 1.0)
    assert c.established(B1, VIP6, 0) == Count(7, 1.0)
    assert c.established(B1, ipaddress.ip_address("198.18.100.2"), 0) == Count(0, 1.0)


def test_ipv4_mapped_addresses_are_ipv4() -> None:
    c = ConnectionCounts()
    c.observe(report("::ffff:198.18.0.11", 1.0, {(VIP4, 80): 3}), 1.0)
    assert c.established(B1, MAPPED, 80) == Count(3, 1.0)
    assert c.established(ipaddress.ip_address("::ffff:198.18.0.11"), VIP4, 0) == Count(3, 1.0)


def test_an_older_report_arriving_late_does_not_replace_a_newer_one() -> None:
    c = ConnectionCounts()
    c.observe(report("198.18.0.11", 5.0, {(VIP4, 80): 1}), 5.0)
    c.observe(report("198.18.0.11", 4.0, {(VIP4, 80): 9}), 4.0)
    assert c.established(B1, VIP4, 80) == Count(1, 5.0)
    assert c.ignored_reports == 1


def test_the_receive_time_defaults_to_the_reports() -> None:
    c = ConnectionCounts()
    c.observe(report("198.18.0.11", 7.0, {(VIP4, 80): 1}))
    assert c.established(B1, VIP4, 80) == Count(1, 7.0)
    c.observe(report("198.18.0.11", 7.0, {}), received_at=8.0)
    assert c.established(B1, VIP4, 80) == Count(0, 8.0)


def test_a_name_that_is_not_an_address_is_kept_out() -> None:
    c = ConnectionCounts()
    c.observe(report("b1.example", 1.0, {(VIP4, 80): 1}), 1.0)
    assert c.ignored_reports == 1
    assert backend_address("b1.example") is None
    assert backend_address("::ffff:198.18.0.11") == B1


def test_a_report_without_counts_is_not_zero() -> None:
    # An older agent, or one that does not count: a drain must not end on its say-so.
    c = ConnectionCounts()
    c.observe(report("198.18.0.11", 1.0, None, chain={"forward": 3}), 1.0)
    assert c.established(B1, VIP4, 80) is None
    assert c.chain_events(B1) == {"forward": 3}
    c.observe(report("198.18.0.11", 2.0, {(VIP4, 80): 4}), 2.0)
    c.observe(report("198.18.0.11", 3.0, None), 3.0)
    assert c.established(B1, VIP4, 80) == Count(4, 2.0)  # the last count, with its time
    assert c.chain_events(B1) is None  # host_tc went away


def test_a_truncated_report_cannot_tell_what_it_left_out() -> None:
    c = ConnectionCounts()
    c.observe(report("198.18.0.11", 1.0, {(VIP4, 80): 40}, truncated=True), 1.0)
    assert c.established(B1, VIP4, 80) == Count(40, 1.0)
    assert c.established(B1, VIP4, 443) is None
    assert c.established(B1, VIP4, 0) is None


def test_chain_events_are_the_latest_reports() -> None:
    c = ConnectionCounts()
    c.observe(report("fd78:6470:6c62::12", 1.0, {}, chain={"forward": 1, "pass": 9}), 1.0)
    c.observe(report("fd78:6470:6c62::12", 2.0, {}, chain={"forward": 4, "pass": 9}), 2.0)
    assert c.chain_events(B2) == {"forward": 4, "pass": 9}


@pytest.mark.parametrize(
    ("desc", "count", "started", "margin", "expected"),
    [
        ("no report", None, 10.0, 0.0, None),
        ("measured before the drain", Count(0, 9.0), 10.0, 0.0, None),
        ("measured as it began", Count(0, 10.0), 10.0, 0.0, None),
        ("zero after", Count(0, 10.5), 10.0, 0.0, True),
        ("some left after", Count(3, 10.5), 10.0, 0.0, False),
        ("zero, but within the margin", Count(0, 10.5), 10.0, 1.0, None),
        ("zero, past the margin", Count(0, 11.5), 10.0, 1.0, True),
    ],
)
def test_drain_done(
    desc: str, count: Count | None, started: float, margin: float, expected: bool | None
) -> None:
    assert drain_done(count, started, margin=margin) is expected, desc


def test_drain_done_follows_the_counts() -> None:
    c = ConnectionCounts()
    c.observe(report("198.18.0.11", 1.0, {(VIP4, 80): 2}), 1.0)
    started = 1.5
    assert drain_done(c.established(B1, VIP4, 80), started) is None
    c.observe(report("198.18.0.11", 2.0, {(VIP4, 80): 1}), 2.0)
    assert drain_done(c.established(B1, VIP4, 80), started) is False
    c.observe(report("198.18.0.11", 3.0, {(VIP4, 443): 1}), 3.0)
    assert drain_done(c.established(B1, VIP4, 80), started) is True
    assert drain_done(c.established(B1, VIP4, 0), started) is False  # 443 still open


def test_a_udp_drain_waits_for_no_connected_socket_and_no_packet_for_the_idle_time() -> None:
    """Failure 7: an agent's UDP count makes a UDP drain's state known; it is done once
    the counter of packets to the backend stood still for the VIP's idle time."""
    from xdplb.control.drain import ConnectionCounts, PacketIdle, udp_drain_done
    from xdplb.core.reports import LoadReport

    vip, be = ipaddress.ip_address("198.18.100.1"), ipaddress.ip_address("198.18.0.11")
    counts = ConnectionCounts()
    assert counts.udp_flows(be, vip, 53) is None  # no report: cannot tell
    counts.observe(LoadReport(str(be), 0.1, 0.0, 5.0, {}, False, None, {}, {(vip, 53): 1}))
    flows = counts.udp_flows(be, vip, 53)
    assert flows is not None and flows.value == 1
    assert udp_drain_done(flows, 1.0, 1.0, 100.0, 10.0) is False  # a connected flow left
    counts.observe(LoadReport(str(be), 0.1, 0.0, 6.0, {}, False, None, {}, {}))
    flows = counts.udp_flows(be, vip, 53)
    assert flows is not None and flows.value == 0
    idle = PacketIdle()
    assert idle.observe(be, 100, 6.0) == 6.0
    assert idle.observe(be, 130, 7.0) == 7.0  # packets still flow
    assert idle.observe(be, 130, 12.0) == 7.0
    assert udp_drain_done(flows, 1.0, 7.0, 12.0, 10.0) is False  # idle 5 s of 10
    assert udp_drain_done(flows, 1.0, 7.0, 17.0, 10.0) is True
    # Idle only counts within the drain: a counter idle since before it began waits.
    assert udp_drain_done(flows, 2.0, 1.5, 11.0, 10.0) is False
    assert udp_drain_done(flows, 2.0, 1.5, 12.0, 10.0) is True
    assert udp_drain_done(flows, 8.0, 7.0, 17.0, 10.0) is None  # no count since it began
    assert udp_drain_done(None, 1.0, 7.0, 17.0, 10.0) is None


def test_inactive_is_known_from_a_v2_report_only() -> None:
    from xdplb.control.drain import ConnectionCounts
    from xdplb.core.reports import LoadReport

    vip, be = ipaddress.ip_address("198.18.100.1"), ipaddress.ip_address("198.18.0.11")
    counts = ConnectionCounts()
    counts.observe(LoadReport(str(be), 0.1, 0.0, 5.0, {(vip, 80): 4}))
    assert counts.inactive(be, vip, 80) is None
    counts.observe(
        LoadReport(str(be), 0.1, 0.0, 6.0, {(vip, 80): 4}, False, None, {(vip, 80): 1}, {})
    )
    assert counts.inactive(be, vip, 80) == 1 and counts.inactive(be, vip, 81) == 0
