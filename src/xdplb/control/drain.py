"""When a drained backend is done: its agent's connection counts, as the daemon keeps them.

Draining a backend stops new connections to it; it is done when the last connection it
had for the VIP has ended. Under direct server return the LB never sees a connection
end, so the backend's agent counts its server-side connections
(:mod:`xdplb.agent.serverconns`) and this module keeps the latest count per backend.

Sans-I/O, like :mod:`xdplb.control.weight_law`: reports and receive times go in, counts come
out. A count is only as new as the report it came in: :func:`drain_done` will not call a
drain done on a count measured before the drain began.

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
            self._conns[backend] = _Latest(at, report.conns, report.conns_truncated)

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
