"""This host's server-side connections, counted per local (address, port): TCP ones (all,
and those not ESTABLISHED), and UDP flows.

A drain waits for a backend's last connection of a VIP to end, and under direct server
return only the backend sees connections end. The agent counts them with a sock_diag
dump (NETLINK_SOCK_DIAG, what ``ss`` uses):

- a connection is every TCP socket that is not LISTEN, TIME_WAIT or CLOSE (so SYN_RECV,
  a handshake under way, counts: its flow was admitted before a drain began);
- it is server-side when its local port has a listening socket on its local address or
  on the wildcard of its family (``[::]`` with IPV6_V6ONLY off covers IPv4 too). Client
  sockets of the backend (to a database, say) use ephemeral ports, which the kernel
  never picks when a listener holds them, so they do not count;
- an IPv4-mapped IPv6 local address (a dual-stack server's IPv4 connection) counts as the
  IPv4 address, which is how the configuration writes VIPs;
- loopback addresses are left out: never a VIP, and a host's local chatter (a proxy to
  its app) would take room in the bounded report.

Of the TCP connections, the ones in another state than ESTABLISHED (a handshake, a close
under way) are also counted apart: ``xdplb list`` shows them as InActConn, as ipvsadm does.

UDP flows are the connected UDP sockets (state ESTABLISHED) whose local port has an
unconnected socket bound on their address or the wildcard (the server's, the UDP
listener); a client socket of the backend uses an ephemeral port no server holds. The
flows of a server that answers from its one unconnected socket are invisible here: a
UDP drain also waits for lb_xdp's packets to the backend to stop
(:mod:`xdplb.control.drain`).

Connections are counted per network namespace: run the agent where the VIP's connections
terminate. The dump is linear in the sockets of the namespace, once per report.

The dump itself is :mod:`xdplb.core.sockdiag`'s.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from xdplb.core.addresses import unmap
from xdplb.core.reports import ConnKey
from xdplb.core.sockdiag import (
    ALL_STATES,
    TCP_CLOSE,
    TCP_ESTABLISHED,
    TCP_LISTEN,
    TCP_TIME_WAIT,
    DiagSocket,
    SockDiag,
)

#: What one dump asks for: listeners and connections, not the dead (TIME_WAIT, CLOSE).
DUMP_STATES = ALL_STATES & ~((1 << TCP_TIME_WAIT) | (1 << TCP_CLOSE))
#: A UDP dump: connected sockets (ESTABLISHED) and bound unconnected ones (CLOSE).
UDP_DUMP_STATES = (1 << TCP_ESTABLISHED) | (1 << TCP_CLOSE)


@dataclass(frozen=True, slots=True)
class ServerConns:
    """One count of the namespace's server-side connections; non-zero entries only."""

    tcp: dict[ConnKey, int]
    """TCP connections in any state but LISTEN, TIME_WAIT and CLOSE (what a drain waits on)."""
    tcp_inactive: dict[ConnKey, int] = field(default_factory=dict)
    """Of ``tcp``, those not ESTABLISHED."""
    udp: dict[ConnKey, int] = field(default_factory=dict)
    """Connected UDP sockets on a served (address, port)."""


def _server_side(sockets: Iterable[DiagSocket], listening: int) -> list[tuple[ConnKey, int]]:
    """(key, state) of every connection whose (address, port) has a socket in state
    ``listening`` on that address or on its family's wildcard."""
    exact: set[ConnKey] = set()
    wildcard: set[tuple[int, int]] = set()  # (IP version, port)
    conns: list[tuple[ConnKey, int]] = []
    for s in sockets:
        local = unmap(s.address)
        if s.state == listening:
            if not local.is_unspecified:
                exact.add((local, s.port))
            elif local.version == 4:
                wildcard.add((4, s.port))
            else:
                wildcard.add((6, s.port))
                if not s.v6only:
                    wildcard.add((4, s.port))
        elif s.state not in (TCP_TIME_WAIT, TCP_CLOSE, TCP_LISTEN) and not local.is_loopback:
            conns.append(((local, s.port), s.state))
    return [(k, st) for k, st in conns if k in exact or (k[0].version, k[1]) in wildcard]


def _counted(keys: Iterable[ConnKey]) -> dict[ConnKey, int]:
    return dict(Counter(keys).most_common())


def count_server_connections(sockets: Iterable[DiagSocket]) -> dict[ConnKey, int]:
    """Server-side TCP connections per (local address, local port); only non-zero entries."""
    return _counted(k for k, _ in _server_side(sockets, TCP_LISTEN))


def count_tcp(sockets: Iterable[DiagSocket]) -> tuple[dict[ConnKey, int], dict[ConnKey, int]]:
    """Server-side TCP connections per (address, port): all of them, and those not
    ESTABLISHED."""
    conns = _server_side(sockets, TCP_LISTEN)
    return _counted(k for k, _ in conns), _counted(k for k, st in conns if st != TCP_ESTABLISHED)


def count_udp_flows(sockets: Iterable[DiagSocket]) -> dict[ConnKey, int]:
    """Connected UDP sockets per served (local address, port): an unconnected socket
    (state CLOSE) bound there or on the wildcard stands for the listener."""
    return _counted(k for k, _ in _server_side(sockets, TCP_CLOSE))


class ConnectionCounter(SockDiag):
    """A sock_diag socket of the namespace it was made in; :meth:`count` dumps and counts."""

    def sockets(self) -> list[DiagSocket]:
        """Every TCP socket of the namespace but TIME_WAIT and CLOSE ones, both families
        (a dump filters by family and state only: ports would need a bytecode filter)."""
        tcp = socket.IPPROTO_TCP
        return self.dump(socket.AF_INET, tcp, DUMP_STATES) + self.dump(
            socket.AF_INET6, tcp, DUMP_STATES
        )

    def udp_sockets(self) -> list[DiagSocket]:
        """Every UDP socket of the namespace, connected or bound, both families."""
        udp = socket.IPPROTO_UDP
        return self.dump(socket.AF_INET, udp, UDP_DUMP_STATES) + self.dump(
            socket.AF_INET6, udp, UDP_DUMP_STATES
        )

    def count(self) -> ServerConns:
        tcp, inactive = count_tcp(self.sockets())
        return ServerConns(tcp, inactive, count_udp_flows(self.udp_sockets()))
