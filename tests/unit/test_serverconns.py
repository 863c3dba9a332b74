"""Which sockets of a sock_diag dump are a backend's server-side connections: synthetic
dumps (the real dump is exercised in tests/e2e/test_agent_conns.py)."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from xdplb.serverconns import (
    TCP_CLOSE,
    TCP_ESTABLISHED,
    TCP_LISTEN,
    TCP_SYN_RECV,
    TCP_TIME_WAIT,
    TcpSocket,
    count_server_connections,
    unmap,
)

pytestmark = pytest.mark.unit

FIN_WAIT1, CLOSE_WAIT, LAST_ACK = 4, 8, 9
VIP4 = "198.18.100.1"
VIP6 = "fd78:6470:6c62:100::1"
OWN4 = "198.18.0.11"


def sock(state: int, local: str, port: int, *, v6only: bool = False) -> TcpSocket:
    addr = ipaddress.ip_address(local)
    family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
    return TcpSocket(family, state, addr, port, v6only)


def listen(local: str, port: int, *, v6only: bool = False) -> TcpSocket:
    return sock(TCP_LISTEN, local, port, v6only=v6only)


def est(local: str, port: int) -> TcpSocket:
    return sock(TCP_ESTABLISHED, local, port)


def counts(*sockets: TcpSocket) -> dict[tuple[str, int], int]:
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
