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

Why raw netlink and not pyroute2's ``DiagSocket``: it gives the same sockets (a test
compares the two), but pyroute2 0.9 turns its asyncio loop once per message and decodes
every field: 70 us per socket measured (6,000 sockets: 0.4 s), so 10,000 connections
would cost 0.7 s of cpu per report, miss a 0.1 s interval and show up in the cpu the same
agent reports. Reading the fixed ``struct inet_diag_msg`` with :mod:`struct` takes 4 us
(6,000 sockets: 23 ms). The request asks for no extensions; the only attribute read is
``INET_DIAG_SKV6ONLY``, of IPv6 listeners.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from xdplb.core.addresses import IPAddress, unmap
from xdplb.core.closing import Closing
from xdplb.core.reports import ConnKey

#: TCP states as sock_diag numbers them (include/net/tcp_states.h).
TCP_ESTABLISHED = 1
TCP_SYN_RECV = 3
TCP_TIME_WAIT = 6
TCP_CLOSE = 7
TCP_LISTEN = 10
_ALL_STATES = (1 << 12) - 1
#: What one dump asks for: listeners and connections, not the dead (TIME_WAIT, CLOSE).
DUMP_STATES = _ALL_STATES & ~((1 << TCP_TIME_WAIT) | (1 << TCP_CLOSE))
#: A UDP dump: connected sockets (ESTABLISHED) and bound unconnected ones (CLOSE).
UDP_DUMP_STATES = (1 << TCP_ESTABLISHED) | (1 << TCP_CLOSE)

# <linux/netlink.h>, <linux/sock_diag.h>, <linux/inet_diag.h>
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_SKV6ONLY = 11
#: struct nlmsghdr {u32 len; u16 type; u16 flags; u32 seq; u32 pid}
_NLMSGHDR = struct.Struct("=IHHII")
#: struct inet_diag_req_v2 {u8 family, protocol, ext, pad; u32 states;
#: struct inet_diag_sockid {be16 sport, dport; be32 src[4], dst[4]; u32 if; u32 cookie[2]}}
_REQ = struct.Struct("=BBBxI48x")
#: The head of struct inet_diag_msg: u8 family, state, timer, retrans; be16 sport, dport;
#: be32 src[4] (an IPv4 address in the first 4 bytes). The whole struct is 72 bytes.
_MSG_HEAD = struct.Struct("!BBxxHH16s")
_MSG_LEN = 72
#: struct nlattr {u16 len; u16 type}
_NLA = struct.Struct("=HH")
_RECV_BUF = 1 << 18


@dataclass(frozen=True, slots=True)
class InetSocket:
    """One socket of a sock_diag dump (TCP or UDP), as far as counting needs it."""

    family: int
    """AF_INET or AF_INET6: the socket's own family (a dual-stack socket is AF_INET6)."""
    state: int
    """TCP state, ``TCP_*`` (a UDP socket: ESTABLISHED when connected, else CLOSE)."""
    local: IPAddress
    """Local address as the kernel has it (possibly IPv4-mapped)."""
    port: int
    """Local port."""
    v6only: bool = False
    """IPV6_V6ONLY of an AF_INET6 socket; only listeners' matters."""


@dataclass(frozen=True, slots=True)
class ServerConns:
    """One count of the namespace's server-side connections; non-zero entries only."""

    tcp: dict[ConnKey, int]
    """TCP connections in any state but LISTEN, TIME_WAIT and CLOSE (what a drain waits on)."""
    tcp_inactive: dict[ConnKey, int] = field(default_factory=dict)
    """Of ``tcp``, those not ESTABLISHED."""
    udp: dict[ConnKey, int] = field(default_factory=dict)
    """Connected UDP sockets on a served (address, port)."""


def _server_side(sockets: Iterable[InetSocket], listening: int) -> list[tuple[ConnKey, int]]:
    """(key, state) of every connection whose (address, port) has a socket in state
    ``listening`` on that address or on its family's wildcard."""
    exact: set[ConnKey] = set()
    wildcard: set[tuple[int, int]] = set()  # (IP version, port)
    conns: list[tuple[ConnKey, int]] = []
    for s in sockets:
        local = unmap(s.local)
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


def count_server_connections(sockets: Iterable[InetSocket]) -> dict[ConnKey, int]:
    """Server-side TCP connections per (local address, local port); only non-zero entries."""
    return _counted(k for k, _ in _server_side(sockets, TCP_LISTEN))


def count_tcp(sockets: Iterable[InetSocket]) -> tuple[dict[ConnKey, int], dict[ConnKey, int]]:
    """Server-side TCP connections per (address, port): all of them, and those not
    ESTABLISHED."""
    conns = _server_side(sockets, TCP_LISTEN)
    return _counted(k for k, _ in conns), _counted(k for k, st in conns if st != TCP_ESTABLISHED)


def count_udp_flows(sockets: Iterable[InetSocket]) -> dict[ConnKey, int]:
    """Connected UDP sockets per served (local address, port): an unconnected socket
    (state CLOSE) bound there or on the wildcard stands for the listener."""
    return _counted(k for k, _ in _server_side(sockets, TCP_CLOSE))


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _v6only(data: bytes, start: int, end: int) -> bool:
    """INET_DIAG_SKV6ONLY among the attributes in ``data[start:end]`` (absent: False)."""
    while start + _NLA.size <= end:
        length, kind = _NLA.unpack_from(data, start)
        if length < _NLA.size:
            break
        if kind == INET_DIAG_SKV6ONLY and length > _NLA.size:
            return data[start + _NLA.size] != 0
        start += _align4(length)
    return False


def parse_dump(data: bytes, seq: int) -> tuple[list[InetSocket], bool]:
    """The sockets in one netlink read of a SOCK_DIAG_BY_FAMILY dump, and whether the
    dump is over (NLMSG_DONE). An NLMSG_ERROR raises OSError with its errno."""
    out: list[InetSocket] = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, kind, _flags, msg_seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            raise OSError(0, f"sock_diag: truncated netlink message at {off}")
        body = off + _NLMSGHDR.size
        if msg_seq != seq:
            pass  # not ours (a late answer to an earlier, abandoned dump)
        elif kind == NLMSG_DONE:
            return out, True
        elif kind == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, body)
            raise OSError(-err, f"sock_diag dump: {os.strerror(-err)}")
        elif kind == SOCK_DIAG_BY_FAMILY and length >= _NLMSGHDR.size + _MSG_LEN:
            family, state, port, _dport, src = _MSG_HEAD.unpack_from(data, body)
            raw = src[:4] if family == socket.AF_INET else src
            v6only = False
            if state in (TCP_LISTEN, TCP_CLOSE) and family == socket.AF_INET6:
                v6only = _v6only(data, body + _MSG_LEN, off + length)
            out.append(InetSocket(family, state, ipaddress.ip_address(raw), port, v6only))
        off += _align4(length)
    return out, False


class ConnectionCounter(Closing):
    """A sock_diag socket of the namespace it was made in; :meth:`count` dumps and counts."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        self._seq = 0
        try:
            self._sock.bind((0, 0))
        except BaseException:
            self._sock.close()
            raise

    def _dump(self, family: int, protocol: int = socket.IPPROTO_TCP) -> list[InetSocket]:
        self._seq += 1
        states = DUMP_STATES if protocol == socket.IPPROTO_TCP else UDP_DUMP_STATES
        req = _REQ.pack(family, protocol, 0, states)
        hdr = _NLMSGHDR.pack(
            _NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, self._seq, 0
        )
        self._sock.send(hdr + req)
        out: list[InetSocket] = []
        while True:
            got, done = parse_dump(self._sock.recv(_RECV_BUF), self._seq)
            out += got
            if done:
                return out

    def sockets(self) -> list[InetSocket]:
        """Every TCP socket of the namespace but TIME_WAIT and CLOSE ones, both families
        (a dump filters by family and state only: ports would need a bytecode filter)."""
        return self._dump(socket.AF_INET) + self._dump(socket.AF_INET6)

    def udp_sockets(self) -> list[InetSocket]:
        """Every UDP socket of the namespace, connected or bound, both families."""
        udp = socket.IPPROTO_UDP
        return self._dump(socket.AF_INET, udp) + self._dump(socket.AF_INET6, udp)

    def count(self) -> ServerConns:
        tcp, inactive = count_tcp(self.sockets())
        return ServerConns(tcp, inactive, count_udp_flows(self.udp_sockets()))

    def close(self) -> None:
        self._sock.close()
