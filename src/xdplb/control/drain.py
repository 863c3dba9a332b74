"""When a drained backend is done: its agent's connection counts, as the daemon keeps them.

Draining a backend stops new connections to it; it is done when the last connection it
had for the VIP has ended. Under direct server return the LB never sees a connection
end, so the backend's agent counts its server-side connections
(:mod:`xdplb.agent.serverconns`) and this module keeps the latest count per backend.

Sans-I/O, like :mod:`xdplb.control.weight_law`: reports and receive times go in, counts come
out. A count is only as new as the report it came in: :func:`drain_done` will not call a
drain done on a count measured before the drain began.

UDP: an agent counts the connected UDP sockets of a served port, but the flows of a
server answering from one unconnected socket are invisible to it. A UDP drain is done
when the agent counts no connected socket and lb_xdp has forwarded no packet to the
backend for the VIP's ``udp_drain_idle`` seconds since the drain began
(:class:`PacketIdle`, :func:`udp_drain_done`). The counter is the backend's over all
VIPs: traffic of another VIP to it keeps the drain waiting (on the safe side).

A backend is known by its agent's ``--name``, which is the backend's address as the
configuration writes it; a report whose name is not an IP address is kept out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from xdplb.core.addresses import IPAddress, unmap
from xdplb.core.reports import ConnKey, LoadReport


@dataclass(frozen=True, slots=True)
class Count:
    """Connections a backend had open for one VIP, and when that was so."""

    value: int
    measured_at: float
    """When the report carrying it arrived, on the receiver's (monotonic) clock; the agent
    measures right before sending."""


@dataclass(frozen=True, slots=True)
class _Latest:
    at: float
    conns: Mapping[ConnKey, int]
    truncated: bool
    inactive: Mapping[ConnKey, int] | None = None
    udp: Mapping[ConnKey, int] | None = None


def backend_address(name: str) -> IPAddress | None:
    """The address an agent's ``--name`` stands for; None when it is not an address."""
    try:
        return unmap(ipaddress.ip_address(name))
    except ValueError:
        return None


class ConnectionCounts:
    """The latest connection counts and host_tc counters of every reporting backend."""

    def __init__(self) -> None:
        self._conns: dict[IPAddress, _Latest] = {}
        self._chain: dict[IPAddress, tuple[float, Mapping[str, int] | None]] = {}
        self.ignored_reports = 0
        """Reports not taken: the name is not an address, or an older report than one
        already taken (reordered on the way)."""

    def observe(self, report: LoadReport, received_at: float | None = None) -> None:
        """Take ``report``, received at ``received_at`` (default: ``report.at``).

        A report from an agent that does not count connections (``conns`` None) leaves
        the backend's counts as they were, and only updates its host_tc counters.
        """
        at = report.at if received_at is None else received_at
        backend = backend_address(report.backend)
        last = self._chain.get(backend) if backend is not None else None
        if backend is None or (last is not None and at < last[0]):
            self.ignored_reports += 1
            return
        self._chain[backend] = (at, report.chain)
        if report.conns is not None:
            self._conns[backend] = _Latest(
                at, report.conns, report.conns_truncated, report.conns_inactive, report.udp
            )

    def established(
        self, backend: IPAddress, vip_address: IPAddress, vip_port: int
    ) -> Count | None:
        """Connections ``backend`` has open to ``vip_address`` port ``vip_port`` (0: the
        wildcard VIP, every port of the address summed), as of its latest counting report.

        None when no report can tell: none with counts from that backend yet, or the
        latest one was truncated and does not hold the entry (or ``vip_port`` is 0).
        """
        latest = self._conns.get(unmap(backend))
        if latest is None:
            return None
        vip = unmap(vip_address)
        if vip_port == 0:
            if latest.truncated:
                return None
            total = sum(n for (addr, _), n in latest.conns.items() if addr == vip)
            return Count(total, latest.at)
        value = latest.conns.get((vip, vip_port))
        if value is None and latest.truncated:
            return None
        return Count(value or 0, latest.at)

    def inactive(self, backend: IPAddress, vip_address: IPAddress, vip_port: int) -> int | None:
        """Of :meth:`established`'s count, the connections not ESTABLISHED; None when the
        report cannot tell (an agent of format 1, a truncated report, a wildcard VIP)."""
        latest = self._conns.get(unmap(backend))
        if latest is None or latest.inactive is None or vip_port == 0:
            return None
        key = (unmap(vip_address), vip_port)
        if key not in latest.conns and latest.truncated:
            return None
        return latest.inactive.get(key, 0)

    def udp_flows(self, backend: IPAddress, vip_address: IPAddress, vip_port: int) -> Count | None:
        """Connected UDP sockets ``backend`` has on ``vip_address`` port ``vip_port`` (0:
        every port summed); None when no report can tell (none from a UDP-counting agent,
        or truncated without the entry)."""
        latest = self._conns.get(unmap(backend))
        if latest is None or latest.udp is None:
            return None
        vip = unmap(vip_address)
        if vip_port == 0:
            if latest.truncated:
                return None
            return Count(sum(n for (a, _), n in latest.udp.items() if a == vip), latest.at)
        value = latest.udp.get((vip, vip_port))
        if value is None and latest.truncated:
            return None
        return Count(value or 0, latest.at)

    def chain_events(self, backend: IPAddress) -> Mapping[str, int] | None:
        """host_tc's counters on ``backend`` by lower-case event name, as of its latest
        report; None: no report yet, or host_tc is not pinned there."""
        latest = self._chain.get(unmap(backend))
        if latest is None or latest[1] is None:
            return None
        return MappingProxyType(dict(latest[1]))


def drain_done(count: Count | None, drain_started: float, *, margin: float = 0.0) -> bool | None:
    """Whether a drain that began at ``drain_started`` (receiver's clock) is over.

    True: a count measured since has found no connection left; False: one found some.
    None: cannot tell yet, as no count was measured after ``drain_started + margin``.
    ``margin`` covers what was under way when the drain began: a handshake in flight,
    the time the datapath took to apply it; set it to at least the network's delay.
    """
    if count is None or not count.measured_at > drain_started + margin:
        return None
    return count.value == 0


class PacketIdle:
    """Since when each backend's packet counter (lb_xdp's, over all VIPs) has not moved,
    as far as the samples fed to it show: a counter is idle from the sample that first
    saw its current value, never from before."""

    def __init__(self) -> None:
        self._seen: dict[IPAddress, tuple[int, float]] = {}

    def observe(self, backend: IPAddress, packets: int, now: float) -> float:
        """Take a sample; returns when the counter took the value it has (<= ``now``)."""
        last = self._seen.get(backend)
        if last is None or last[0] != packets:
            self._seen[backend] = (packets, now)
            return now
        return last[1]


def udp_drain_done(
    count: Count | None, drain_started: float, idle_since: float, now: float, idle: float
) -> bool | None:
    """Whether a UDP drain that began at ``drain_started`` is over: the agent counted no
    connected socket since it began (``count``, :meth:`ConnectionCounts.udp_flows`), and
    no packet went to the backend for ``idle`` seconds within it (``idle_since``: from
    :meth:`PacketIdle.observe`). None: no count measured since the drain began."""
    done = drain_done(count, drain_started)
    if not done:
        return done
    return now - max(idle_since, drain_started) >= idle
