"""Which sockets of a sock_diag dump are a backend's server-side connections: synthetic
dumps (the real dump is exercised in tests/e2e/test_agent_conns.py)."""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

import pytest

from xdplb.agent.serverconns import (
    DUMP_STATES,
    ConnectionCounter,
    count_server_connections,
    count_tcp,
    count_udp_flows,
)
from xdplb.core.addresses import unmap
from xdplb.core.sockdiag import (
    NLMSG_DONE,
    NLMSG_ERROR,
    TCP_CLOSE,
    TCP_ESTABLISHED,
    TCP_LISTEN,
    TCP_SYN_RECV,
    TCP_TIME_WAIT,
    DiagSocket,
    parse_dump,
)

pytestmark = pytest.mark.unit

FIN_WAIT1, CLOSE_WAIT, LAST_ACK = 4, 8, 9
VIP4 = "198.18.100.1"
VIP6 = "fd78:6470:6c62:100::1"
OWN4 = "198.18.0.11"


def sock(state: int, local: str, port: int, *, v6only: bool = False) -> DiagSocket:
    addr = ipaddress.ip_address(local)
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    return DiagSocket(family, state, addr, port, v6only=v6only)


def listen(local: str, port: int, *, v6only: bool = False) -> DiagSocket:
    return sock(TCP_LISTEN, local, port, v6only=v6only)


def est(local: str, port: int) -> DiagSocket:
    return sock(TCP_ESTABLISHED, local, port)


def counts(*sockets: DiagSocket) -> dict[tuple[str, int], int]:
    return {(str(a), p): n for (a, p), n in count_server_connections(sockets).items()}


def test_a_dual_stack_wildcard_listener_covers_both_families() -> None:
    # The lab's servers: one [::] socket with IPV6_V6ONLY off; IPv4 connections appear
    # on AF_INET6 sockets with IPv4-mapped local addresses.
    assert counts(
        listen("::", 7),
        est(f"::ffff:{VIP4}", 7),
        est(f"::ffff:{VIP4}", 7),
        est(VIP6, 7),
        est(f"::ffff:{OWN4}", 7),
    ) == {(VIP4, 7): 2, (VIP6, 7): 1, (OWN4, 7): 1}


def test_a_v6only_wildcard_listener_does_not_cover_ipv4() -> None:
    assert counts(listen("::", 80, v6only=True), est(VIP4, 80), est(VIP6, 80)) == {(VIP6, 80): 1}
    assert counts(listen("0.0.0.0", 80), est(VIP4, 80), est(VIP6, 80)) == {(VIP4, 80): 1}


def test_a_listener_on_one_address_covers_that_address_only() -> None:
    assert counts(
        listen(VIP4, 80),
        est(VIP4, 80),
        est(OWN4, 80),
        listen(f"::ffff:{OWN4}", 443),
        est(OWN4, 443),
    ) == {(VIP4, 80): 1, (OWN4, 443): 1}


def test_client_side_connections_do_not_count() -> None:
    # The backend's own connections out (local port ephemeral, no listener on it), also
    # those to its own VIP, whose local address is the VIP.
    assert counts(listen("::", 7), est(VIP4, 7), est(VIP4, 40000), est(OWN4, 51000)) == {
        (VIP4, 7): 1
    }


@pytest.mark.parametrize(
    ("state", "counted"),
    [
        (TCP_ESTABLISHED, True),
        (TCP_SYN_RECV, True),  # a handshake under way: admitted before a drain began
        (FIN_WAIT1, True),
        (CLOSE_WAIT, True),
        (LAST_ACK, True),
        (TCP_TIME_WAIT, False),
        (TCP_CLOSE, False),
    ],
)
def test_which_states_are_connections(state: int, counted: bool) -> None:
    got = counts(listen("::", 7), sock(state, VIP6, 7))
    assert got == ({(VIP6, 7): 1} if counted else {})


def test_loopback_and_listeners_themselves_do_not_count() -> None:
    assert counts(listen("::", 7), listen(VIP4, 7), est("127.0.0.1", 7), est("::1", 7)) == {}
    assert counts() == {}


def test_unmap() -> None:
    assert unmap(ipaddress.ip_address("::ffff:198.18.0.1")) == ipaddress.ip_address("198.18.0.1")
    assert unmap(ipaddress.ip_address(VIP6)) == ipaddress.ip_address(VIP6)
    assert unmap(ipaddress.ip_address(VIP4)) == ipaddress.ip_address(VIP4)


# -- the dump itself ------------------------------------------------------------------------


def pyroute2_sockets() -> list[DiagSocket]:
    """The same dump through pyroute2's DiagSocket: the reference the raw one must match."""
    from pyroute2 import DiagSocket as Pyroute2Diag

    out = []
    with Pyroute2Diag() as ds:
        ds.bind()
        for family in (socket.AF_INET, socket.AF_INET6):
            for m in ds.get_sock_stats(family=family, states=DUMP_STATES):
                out.append(
                    DiagSocket(
                        m["idiag_family"],
                        m["idiag_state"],
                        ipaddress.ip_address(m["idiag_src"]),
                        m["idiag_sport"],
                        m["idiag_cookie"],
                        m["idiag_uid"],
                        m["idiag_inode"],
                        m["idiag_state"] == TCP_LISTEN and bool(m.get_attr("INET_DIAG_SKV6ONLY")),
                    )
                )
    return out


def test_the_raw_dump_reads_what_pyroute2_reads() -> None:
    # Real sockets on loopback, in this namespace: a dual-stack [::] listener, an IPv4
    # one, a v6-only one, connections to each in both families, and a closed one.
    opened: list[socket.socket] = []

    def listener(family: socket.AddressFamily, host: str, v6only: int | None) -> int:
        s = socket.socket(family, socket.SOCK_STREAM)
        opened.append(s)
        if v6only is not None:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
        s.bind((host, 0))
        s.listen()
        return int(s.getsockname()[1])

    def connect(host: str, port: int) -> int:
        c = socket.create_connection((host, port), timeout=2.0)
        opened.append(c)
        return int(c.getsockname()[1])

    try:
        dual = listener(socket.AF_INET6, "::", 0)
        v4 = listener(socket.AF_INET, "127.0.0.1", None)
        v6 = listener(socket.AF_INET6, "::1", 1)
        ports = {dual, v4, v6}
        ports |= {connect("127.0.0.1", dual), connect("::1", dual), connect("127.0.0.1", v4)}
        ports |= {connect("::1", v6), connect("::1", v6)}
        with ConnectionCounter() as counter:
            raw = [s for s in counter.sockets() if s.port in ports]
        reference = [s for s in pyroute2_sockets() if s.port in ports]
    finally:
        for s in opened:
            s.close()
    key = lambda s: (s.family, s.state, int(s.address), s.port)  # noqa: E731
    assert sorted(raw, key=key) == sorted(reference, key=key)
    listeners = {(s.family, str(s.address), s.port, s.v6only) for s in raw if s.state == TCP_LISTEN}
    assert listeners == {
        (socket.AF_INET6, "::", dual, False),
        (socket.AF_INET, "127.0.0.1", v4, False),
        (socket.AF_INET6, "::1", v6, True),
    }
    # 5 client sockets + 5 server sides (accepted or not, the handshake is done).
    assert sum(1 for s in raw if s.state == TCP_ESTABLISHED) == 10
    mapped = [s for s in raw if s.port == dual and s.state == TCP_ESTABLISHED]
    assert {s.address for s in mapped} == {
        ipaddress.ip_address("::1"),
        ipaddress.ip_address("::ffff:127.0.0.1"),
    }


def nlmsg(kind: int, seq: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 0, seq, 0) + body


def test_parse_dump_raises_the_kernels_errno() -> None:
    with pytest.raises(OSError) as e:
        parse_dump(nlmsg(NLMSG_ERROR, 7, struct.pack("=i", -errno.EPERM) + bytes(16)), 7)
    assert e.value.errno == errno.EPERM


def test_parse_dump_skips_other_dumps_and_ends_at_done() -> None:
    stale = nlmsg(NLMSG_DONE, 6, bytes(4))
    assert parse_dump(stale + nlmsg(NLMSG_DONE, 7, bytes(4)), 7) == ([], True)
    assert parse_dump(stale, 7) == ([], False)
    with pytest.raises(OSError, match="truncated netlink message"):
        parse_dump(struct.pack("=IHHII", 64, NLMSG_DONE, 0, 7, 0) + bytes(4), 7)


def test_inactive_counts_the_server_side_connections_not_established() -> None:
    socks = [
        listen("::", 80),
        est(VIP4, 80),
        est(VIP4, 80),
        sock(TCP_SYN_RECV, VIP4, 80),
        sock(FIN_WAIT1, VIP4, 80),
        sock(CLOSE_WAIT, VIP6, 80),
        sock(FIN_WAIT1, OWN4, 40000),  # a client socket of the backend: not counted
    ]
    total, inactive = count_tcp(socks)
    v4, v6 = ipaddress.ip_address(VIP4), ipaddress.ip_address(VIP6)
    assert total == {(v4, 80): 4, (v6, 80): 1}
    assert inactive == {(v4, 80): 2, (v6, 80): 1}


def test_udp_flows_are_connected_sockets_on_a_port_a_bound_socket_serves() -> None:
    v4, v6 = ipaddress.ip_address(VIP4), ipaddress.ip_address(VIP6)
    udp = [
        sock(TCP_CLOSE, "0.0.0.0", 53),  # the server's unconnected socket
        sock(TCP_CLOSE, VIP6, 443),
        sock(TCP_ESTABLISHED, VIP4, 53),  # per-client connected sockets (a QUIC server)
        sock(TCP_ESTABLISHED, VIP4, 53),
        sock(TCP_ESTABLISHED, VIP6, 443),
        sock(TCP_ESTABLISHED, VIP6, 53),  # an IPv4 wildcard serves no IPv6 address
        sock(TCP_ESTABLISHED, OWN4, 41000),  # the backend's own resolver query
    ]
    assert count_udp_flows(udp) == {(v4, 53): 2, (v6, 443): 1}


def test_the_udp_dump_sees_bound_and_connected_sockets() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    flow = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    peer = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for s in (server, flow):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        port = server.getsockname()[1]
        peer.bind(("127.0.0.1", 0))
        flow.bind(("127.0.0.1", port))
        flow.connect(peer.getsockname())
        with ConnectionCounter() as counter:
            got = {(s.state, s.port) for s in counter.udp_sockets() if s.port == port}
    finally:
        for s in (server, flow, peer):
            s.close()
    assert got == {(TCP_CLOSE, port), (TCP_ESTABLISHED, port)}
