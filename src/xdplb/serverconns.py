"""This host's server-side TCP connections, counted per local (address, port).

A drain waits for a backend's last connection of a VIP to end, and under direct server
return only the backend sees connections end. The agent counts them with sock_diag
(NETLINK_SOCK_DIAG, what ``ss`` uses), through pyroute2's :class:`DiagSocket`:

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

Connections are counted per network namespace: run the agent where the VIP's connections
terminate. Dumping is linear in the sockets of the namespace (tens of thousands per
second in Python), measured once per report.
"""

from __future__ import annotations

import ipaddress
import socket
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from pyroute2 import DiagSocket
from pyroute2.netlink.exceptions import NetlinkError

from xdplb.abi import IPAddress
from xdplb.loadfeedback import ConnKey

#: TCP states as sock_diag numbers them (include/net/tcp_states.h).
TCP_ESTABLISHED = 1
TCP_SYN_RECV = 3
TCP_TIME_WAIT = 6
TCP_CLOSE = 7
TCP_LISTEN = 10
_ALL_STATES = (1 << 12) - 1
#: What one dump asks for: listeners and connections, not the dead (TIME_WAIT, CLOSE).
DUMP_STATES = _ALL_STATES & ~((1 << TCP_TIME_WAIT) | (1 << TCP_CLOSE))


def unmap(addr: IPAddress) -> IPAddress:
    """``::ffff:a.b.c.d`` as ``a.b.c.d``; any other address as it is."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@dataclass(frozen=True, slots=True)
class TcpSocket:
    """One socket of a sock_diag dump, as far as counting needs it."""

    family: int
    """AF_INET or AF_INET6: the socket's own family (a dual-stack socket is AF_INET6)."""
    state: int
    """TCP state, ``TCP_*``."""
    local: IPAddress
    """Local address as the kernel has it (possibly IPv4-mapped)."""
    port: int
    """Local port."""
    v6only: bool = False
    """IPV6_V6ONLY of an AF_INET6 socket; only listeners' matters."""


def count_server_connections(sockets: Iterable[TcpSocket]) -> dict[ConnKey, int]:
    """Server-side connections per (local address, local port); only non-zero entries."""
    exact: set[ConnKey] = set()
    wildcard: set[tuple[int, int]] = set()  # (IP version, port)
    conns: list[ConnKey] = []
    for s in sockets:
        local = unmap(s.local)
        if s.state == TCP_LISTEN:
            if not local.is_unspecified:
                exact.add((local, s.port))
            elif local.version == 4:
                wildcard.add((4, s.port))
            else:
                wildcard.add((6, s.port))
                if not s.v6only:
                    wildcard.add((4, s.port))
        elif s.state not in (TCP_TIME_WAIT, TCP_CLOSE) and not local.is_loopback:
            conns.append((local, s.port))
    return dict(
        Counter(k for k in conns if k in exact or (k[0].version, k[1]) in wildcard).most_common()
    )


def _from_diag(msg: Any) -> TcpSocket:
    """A pyroute2 ``inet_diag_msg`` (addresses already decoded to text)."""
    return TcpSocket(
        family=int(msg["idiag_family"]),
        state=int(msg["idiag_state"]),
        local=ipaddress.ip_address(msg["idiag_src"]),
        port=int(msg["idiag_sport"]),
        v6only=bool(msg.get_attr("INET_DIAG_SKV6ONLY")),
    )


class ConnectionCounter:
    """A sock_diag socket of the namespace it was made in; :meth:`count` dumps and counts."""

    def __init__(self) -> None:
        self._diag = DiagSocket()
        try:
            self._diag.bind()
        except BaseException:
            self._diag.close()
            raise

    def sockets(self) -> list[TcpSocket]:
        """Every TCP socket of the namespace but TIME_WAIT and CLOSE ones, both families."""
        out: list[TcpSocket] = []
        for family in (socket.AF_INET, socket.AF_INET6):
            # Dumps filter by family only (ports need a bytecode filter): take them all.
            try:
                msgs = self._diag.get_sock_stats(family=family, states=DUMP_STATES)
            except NetlinkError as e:  # keeps the errno, as the rest of the agent's errors
                raise OSError(e.code, f"sock_diag dump: {e}") from None
            out += (_from_diag(msg) for msg in msgs)
        return out

    def count(self) -> dict[ConnKey, int]:
        return count_server_connections(self.sockets())

    def close(self) -> None:
        self._diag.close()

    def __enter__(self) -> ConnectionCounter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
