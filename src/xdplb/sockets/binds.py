"""The bound sockets of this network namespace, and the bind() mixes that make the kernel
walk one long list under a spin lock.

The scan reads every TCP and UDP socket from sock_diag (NETLINK_SOCK_DIAG, what ``ss``
uses). sock_diag does not report SO_REUSEPORT, so the option is read for real: a
socket's inode is mapped to a descriptor of a process through /proc/<pid>/fd, the
descriptor is copied into this process with pidfd_getfd(2) (CAP_SYS_PTRACE over the
owner: root) and getsockopt(SO_REUSEPORT) is asked. A socket that no visible process
holds (another pid namespace, a process gone meanwhile) has it undetermined, and the
check says so. The same machinery hands the steering commands the socket that listens
at an address (:func:`take_socket`).

The rule checked (docs/sockets.md, "check-binds") is per protocol and port, the key of the
kernel's bind tables (TCP ``bhash``, UDP's port slots; one table for IPv4 and IPv6), each
bucket under one spin lock: a port bound with SO_REUSEPORT on some addresses and without
it on others turns TCP's bind fast path (``tb->fastreuseport``) off, after which a bind
that misses it walks the port's sockets (accepted connections included); UDP has no fast
path, every bind walks the port's sockets. So the mix is flagged, and so is a port whose
bucket holds many sockets.

The dump is :mod:`xdplb.core.sockdiag`'s (raw netlink: pyroute2 decodes every field, about
70 us a socket, and a host with a long bucket has by definition many sockets).
"""

from __future__ import annotations

import ipaddress
import socket
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from xdplb.core import sockdiag
from xdplb.core.addresses import IPAddress
from xdplb.core.sockdiag import TCP_CLOSE, TCP_LISTEN, socket_owners, take_socket

PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}
#: A port bucket at least this long is reported (``--long-bucket``).
LONG_BUCKET = 1000


@dataclass(frozen=True, slots=True)
class BoundSocket:
    """One TCP or UDP socket of the namespace, as sock_diag gives it."""

    proto: str
    """"tcp" or "udp"."""
    family: int
    """AF_INET or AF_INET6 (a dual-stack socket is AF_INET6)."""
    state: int
    """TCP state (``TCP_*``); for UDP ESTABLISHED (connected) or CLOSE (bound only)."""
    address: IPAddress
    """Local address (possibly IPv4-mapped)."""
    port: int
    """Local port."""
    inode: int
    """The socket's inode: how /proc/<pid>/fd names it (``socket:[inode]``)."""
    cookie: int
    """SO_COOKIE: the kernel's id of the socket."""
    uid: int
    """Owner uid (reuseport groups are per uid)."""
    reuseport: bool | None = None
    """SO_REUSEPORT, None when no visible process holds the socket."""
    owner: tuple[int, int] | None = None
    """(pid, fd) of a process that holds it, when one was found."""

    @property
    def is_bind(self) -> bool:
        """A socket that took a port by bind(): a TCP listener, an unconnected UDP socket."""
        return self.state == (TCP_LISTEN if self.proto == "tcp" else TCP_CLOSE)

    @property
    def endpoint(self) -> str:
        """``[::1]:443/udp``, ``127.0.0.1:80/tcp``."""
        return f"{host_port(self.address, self.port)}/{self.proto}"


def host_port(address: IPAddress, port: int) -> str:
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


# -- sock_diag --------------------------------------------------------------------------


def dump(proto: str, family: int) -> list[BoundSocket]:
    """Every socket of ``proto`` and ``family`` in the calling thread's namespace."""
    return [
        BoundSocket(
            proto=proto,
            family=d.family,
            state=d.state,
            address=d.address,
            port=d.port,
            inode=d.inode,
            cookie=d.cookie,
            uid=d.uid,
        )
        for d in sockdiag.dump(family, PROTOCOLS[proto])
    ]


# -- owners and the option ----------------------------------------------------------------


def read_reuseport(pid: int, fd: int) -> bool | None:
    """SO_REUSEPORT of descriptor ``fd`` of ``pid``; None if it cannot be read."""
    try:
        with take_socket(pid, fd) as sock:
            return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT))
    except OSError:
        return None


def scan() -> list[BoundSocket]:
    """Every TCP and UDP socket of the calling thread's namespace; the bound ones (TCP
    listeners, unconnected UDP sockets) with their owner and SO_REUSEPORT read."""
    sockets = [s for p in PROTOCOLS for f in (socket.AF_INET, socket.AF_INET6) for s in dump(p, f)]
    binds = {s.inode for s in sockets if s.is_bind and s.inode}
    owners = socket_owners(binds)
    out = []
    for s in sockets:
        if s.is_bind and (owner := owners.get(s.inode)) is not None:
            s = replace(s, owner=owner, reuseport=read_reuseport(*owner))
        out.append(s)
    return out


# -- finding a socket by where it listens --------------------------------------------------


def parse_endpoint(text: str, default_proto: str = "tcp") -> tuple[IPAddress, int, str]:
    """``127.0.0.1:8080/tcp``, ``[::1]:53/udp``, ``127.0.0.1:8080`` (``default_proto``)."""
    where, _, proto = text.partition("/")
    proto = proto or default_proto
    if proto not in PROTOCOLS:
        raise ValueError(f"{text!r}: protocol {proto!r}, want tcp or udp")
    host, sep, port = where.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r}: want ADDRESS:PORT[/tcp|udp]")
    return ipaddress.ip_address(host.strip("[]")), int(port), proto


def find_socket(address: IPAddress, port: int, proto: str) -> socket.socket:
    """A copy of the socket bound at ``address``:``port`` for ``proto`` ("tcp", "udp"):
    :func:`xdplb.core.sockdiag.bound_socket`."""
    return sockdiag.bound_socket(address, port, PROTOCOLS[proto])


# -- the check ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing check-binds has to say about a port of a protocol."""

    kind: str
    """``mixed-reuseport`` and ``long-bucket`` are warnings; ``undetermined`` is a note."""
    proto: str
    port: int
    message: str
    with_reuseport: tuple[str, ...] = ()
    """Addresses (``[::2]:443``) bound with SO_REUSEPORT."""
    without_reuseport: tuple[str, ...] = ()
    """Addresses bound without it."""
    undetermined: tuple[str, ...] = ()
    """Addresses whose option could not be read."""
    sockets: int = 0
    """Sockets in the port's bucket (every state, connections included)."""
    warning: bool = field(default=True)


def _addrs(sockets: Iterable[BoundSocket]) -> tuple[str, ...]:
    return tuple(sorted({host_port(s.address, s.port) for s in sockets}))


def check(sockets: Iterable[BoundSocket], long_bucket: int = LONG_BUCKET) -> list[Finding]:
    """What is wrong with the binds of ``sockets``, port by port (pure: no syscalls)."""
    by_port: dict[tuple[str, int], list[BoundSocket]] = defaultdict(list)
    for s in sockets:
        if s.port:
            by_port[(s.proto, s.port)].append(s)
    out: list[Finding] = []
    for (proto, port), group in sorted(by_port.items()):
        binds = [s for s in group if s.is_bind]
        yes = [s for s in binds if s.reuseport is True]
        no = [s for s in binds if s.reuseport is False]
        unknown = [s for s in binds if s.reuseport is None]
        if yes and no:
            out.append(
                Finding(
                    "mixed-reuseport",
                    proto,
                    port,
                    f"{proto} port {port} is bound with SO_REUSEPORT on "
                    f"{', '.join(_addrs(yes))} and without it on {', '.join(_addrs(no))}: "
                    "every bind() to the port walks its whole bucket under a spin lock",
                    _addrs(yes),
                    _addrs(no),
                    _addrs(unknown),
                    len(group),
                )
            )
        elif unknown and (yes or no or len(unknown) > 1):
            out.append(
                Finding(
                    "undetermined",
                    proto,
                    port,
                    f"{proto} port {port}: SO_REUSEPORT unknown on {', '.join(_addrs(unknown))} "
                    "(held by no process visible here)",
                    _addrs(yes),
                    _addrs(no),
                    _addrs(unknown),
                    len(group),
                    warning=False,
                )
            )
        if binds and len(group) >= long_bucket:
            out.append(
                Finding(
                    "long-bucket",
                    proto,
                    port,
                    f"{proto} port {port} has {len(group)} sockets in one bind bucket "
                    f"(at least {long_bucket}): binds and listens on it walk them all",
                    sockets=len(group),
                )
            )
    return out
