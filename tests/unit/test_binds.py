"""check-binds without a kernel: the rule on synthetic sockets, the sock_diag parser on
built messages, the /proc walk on a fake /proc, and the address syntax."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from xdplb.core import sockdiag
from xdplb.core.sockdiag import TCP_CLOSE, TCP_ESTABLISHED, TCP_LISTEN
from xdplb.sockets import binds
from xdplb.sockets.binds import BoundSocket

pytestmark = pytest.mark.unit

_inode = iter(range(1000, 1_000_000))


def sock(
    where: str,
    reuseport: bool | None,
    proto: str = "udp",
    state: int | None = None,
) -> BoundSocket:
    """A socket bound at ``where`` (``[::1]:443``), bound-only unless ``state`` says."""
    host, _, port = where.rpartition(":")
    addr = ipaddress.ip_address(host.strip("[]"))
    return BoundSocket(
        proto=proto,
        family=socket.AF_INET if addr.version == 4 else socket.AF_INET6,
        state=state if state is not None else (TCP_LISTEN if proto == "tcp" else TCP_CLOSE),
        address=addr,
        port=int(port),
        inode=next(_inode),
        cookie=0,
        uid=0,
        reuseport=reuseport,
    )


@dataclass(frozen=True)
class Case:
    description: str
    sockets: list[BoundSocket]
    kinds: list[str]


CASES = [
    Case(
        "Facebook's pattern: [::1]:443 without SO_REUSEPORT, [::2]:443 and [::]:443 with it",
        [sock("[::1]:443", False), sock("[::2]:443", True), sock("[::]:443", True)],
        ["mixed-reuseport"],
    ),
    Case(
        "the same mix on TCP listeners, across IPv4 and IPv6 (one bind table)",
        [sock("127.0.0.1:80", False, "tcp"), sock("[::]:80", True, "tcp")],
        ["mixed-reuseport"],
    ),
    Case(
        "plain binds on separate ports",
        [sock("127.0.0.1:80", False, "tcp"), sock("127.0.0.1:53", False), sock("[::]:22", False)],
        [],
    ),
    Case(
        "one reuseport group of four sockets",
        [sock("[::]:443", True) for _ in range(4)],
        [],
    ),
    Case(
        "a plain TCP listener and a reuseport UDP group on the same number: two buckets",
        [sock("[::]:443", False, "tcp"), sock("[::]:443", True), sock("[::]:443", True)],
        [],
    ),
    Case(
        "connected UDP sockets on the port are not binds: no mix",
        [sock("[::]:443", True), sock("[::1]:443", False, state=TCP_ESTABLISHED)],
        [],
    ),
    Case(
        "an option that could not be read beside a known one: a note",
        [sock("[::]:443", True), sock("[::1]:443", None)],
        ["undetermined"],
    ),
    Case(
        "one socket whose option is unknown is nothing to say",
        [sock("[::]:443", None)],
        [],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.description for c in CASES])
def test_check(case: Case) -> None:
    assert [f.kind for f in binds.check(case.sockets)] == case.kinds


def test_the_mix_names_its_addresses() -> None:
    socks = [
        sock("[::1]:443", False),
        sock("[::2]:443", True),
        sock("[::]:443", True),
        sock("[::]:443", True),
        sock("[::3]:443", None),
    ]
    (f,) = binds.check(socks)
    assert f.warning
    assert (f.proto, f.port) == ("udp", 443)
    assert f.with_reuseport == ("[::2]:443", "[::]:443")
    assert f.without_reuseport == ("[::1]:443",)
    assert f.undetermined == ("[::3]:443",)
    assert f.message == (
        "udp port 443 is bound with SO_REUSEPORT on [::2]:443, [::]:443 and without it on "
        "[::1]:443: every bind() to the port walks its whole bucket under a spin lock"
    )


def test_a_long_bucket_counts_connections() -> None:
    conns = [sock("10.0.0.1:443", None, "tcp", TCP_ESTABLISHED) for _ in range(9)]
    socks = [sock("[::]:443", True, "tcp"), *conns]
    (f,) = binds.check(socks, long_bucket=10)
    assert (f.kind, f.sockets, f.warning) == ("long-bucket", 10, True)
    assert binds.check(socks, long_bucket=11) == []
    # Client connections from an ephemeral port are no server's bucket.
    assert binds.check(conns, long_bucket=2) == []


def _nlmsg(kind: int, seq: int, body: bytes) -> bytes:
    msg = struct.pack("=IHHII", 16 + len(body), kind, 0, seq, 0) + body
    return msg + b"\0" * (-len(msg) % 4)


def _diag(family: int, state: int, addr: str, port: int, inode: int) -> bytes:
    raw = ipaddress.ip_address(addr).packed.ljust(16, b"\0")
    msg = struct.pack(
        "=BBxx2s2x16s16x4xQ12xII", family, state, port.to_bytes(2, "big"), raw, 77, 0, inode
    )
    # An attribute after the message: INET_DIAG_SKV6ONLY (11), read for a bound IPv6 socket.
    return msg + struct.pack("=HHB3x", 5, 11, 1)


def test_parse_dump() -> None:
    data = (
        _nlmsg(20, 9, _diag(socket.AF_INET6, TCP_CLOSE, "::1", 443, 11))
        + _nlmsg(20, 9, _diag(socket.AF_INET, TCP_ESTABLISHED, "127.0.0.1", 53, 12))
        + _nlmsg(20, 8, _diag(socket.AF_INET, TCP_CLOSE, "127.0.0.9", 9, 13))
        + _nlmsg(sockdiag.NLMSG_DONE, 9, b"\0" * 4)
    )
    got, done = sockdiag.parse_dump(data, 9)
    assert done
    assert [(str(s.address), s.port, s.state, s.inode, s.cookie, s.v6only) for s in got] == [
        ("::1", 443, TCP_CLOSE, 11, 77, True),
        ("127.0.0.1", 53, TCP_ESTABLISHED, 12, 77, False),
    ]


def test_parse_dump_error() -> None:
    with pytest.raises(OSError) as info:
        sockdiag.parse_dump(_nlmsg(sockdiag.NLMSG_ERROR, 3, struct.pack("=i", -13)), 3)
    assert info.value.errno == 13


def test_socket_owners_reads_a_proc_tree(tmp_path: Path) -> None:
    for pid, fd, target in [
        ("41", "3", "socket:[900]"),
        ("41", "4", "/dev/null"),
        ("42", "7", "socket:[901]"),
    ]:
        (tmp_path / pid / "fd").mkdir(parents=True, exist_ok=True)
        os.symlink(target, tmp_path / pid / "fd" / fd)
    (tmp_path / "self").mkdir()
    assert sockdiag.socket_owners({900, 901, 902}, proc=tmp_path) == {900: (41, 3), 901: (42, 7)}


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:8080/tcp", ("127.0.0.1", 8080, "tcp")),
        ("127.0.0.1:8080", ("127.0.0.1", 8080, "tcp")),
        ("[::1]:53/udp", ("::1", 53, "udp")),
    ],
)
def test_parse_endpoint(text: str, want: tuple[str, int, str]) -> None:
    addr, port, proto = binds.parse_endpoint(text)
    assert (str(addr), port, proto) == want


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:80/sctp", "x:80"])
def test_parse_endpoint_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        binds.parse_endpoint(text)
