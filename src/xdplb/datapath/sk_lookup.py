"""host_sk_lookup: steer an address prefix and some ports (or every port) to one socket.

The program is attached to a network namespace through a bpf_link (BPF_SK_LOOKUP) and
runs before the kernel's own socket lookup for every new TCP connection and every UDP
datagram to an unconnected socket. Program, link and maps are pinned under
``<pin root of the instance>/sk_lookup``, so steering outlives the command that set it
up and any later command finds it again; :func:`detach` removes all of it.

A rule is a key of the LPM trie ``skl_rules`` (protocol, family, port, address prefix;
port 0 stands for every port) whose value names a slot of the sockmap ``skl_socks``. A
slot holds one target socket; rules to the same socket share its slot. The kernel
drops a socket from the sockmap when its last descriptor closes: steering then stops
(counted ``no_socket``) until a rule is added again.

Who finds the socket is not this module's business: it takes a socket (a descriptor
this process holds, e.g. one taken from its owner with pidfd_getfd).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import ipaddress
import os
import shutil
import socket
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from xdplb.core import paths
from xdplb.core.closing import Closing
from xdplb.core.errors import BpfError, XdplbError
from xdplb.datapath._ffi import lib
from xdplb.datapath.links import Link, attach_link
from xdplb.datapath.maps import Map
from xdplb.datapath.objects import BpfObject

OBJECT = "host_sk_lookup"
PROGRAM = "host_sk_lookup"
#: Under the instance's pin root: kept apart from host_tc's pins, which share the root.
PIN_DIR = "sk_lookup"
LINK_PIN = "link"
PROG_PIN = "prog"
MAP_NAMES = ("skl_rules", "skl_socks", "skl_events")
#: Bits of the key before the address (protocol, family, port): always matched.
HEAD_BITS = 32
PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP}

#: struct skl_key {u32 prefixlen; u8 protocol, family; be16 port; u8 addr[16]}
KEY_LAYOUT = struct.Struct("<IBB2s16s")
#: struct skl_target {u32 slot; u8 protocol, family; be16 port; u8 addr[16]}
TARGET_LAYOUT = struct.Struct("<IBB2s16s")


class SkLookupEvent(enum.IntEnum):
    """``enum skl_event`` of host_sk_lookup.bpf.c: what one lookup came to."""

    STEERED = 0
    NO_RULE = 1
    NO_SOCKET = 2
    ASSIGN_FAILED = 3


class SteerError(XdplbError):
    """A rule that cannot be added or removed as asked."""


Prefix = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a socket is bound: address, port and protocol ("tcp" or "udp")."""

    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    proto: str

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port}/{self.proto}"


@dataclass(frozen=True, slots=True)
class Rule:
    """One steering rule: traffic of ``proto`` to ``prefix`` on ``port`` goes to ``target``."""

    proto: str
    """"tcp" or "udp"."""
    prefix: Prefix
    """Destination addresses steered."""
    port: int
    """Destination port steered; 0: every port."""
    target: Endpoint
    """Where the target socket listens (as it was when the rule was added)."""
    slot: int
    """The sockmap slot holding the target socket."""


def _family(version: int) -> int:
    return socket.AF_INET if version == 4 else socket.AF_INET6


def _addr16(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    return address.packed.ljust(16, b"\0")


def _addr_of(family: int, raw: bytes) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(raw[:4] if family == socket.AF_INET else raw)


def pack_key(proto: str, prefix: Prefix, port: int) -> bytes:
    """The skl_rules key of a rule (a network object has its host bits zeroed, as the
    trie wants)."""
    return KEY_LAYOUT.pack(
        HEAD_BITS + prefix.prefixlen,
        PROTOCOLS[proto],
        _family(prefix.version),
        port.to_bytes(2, "big"),
        _addr16(prefix.network_address),
    )


def unpack_key(key: bytes) -> tuple[str, Prefix, int]:
    """(protocol, prefix, port) of an skl_rules key."""
    bits, proto, family, port, raw = KEY_LAYOUT.unpack(key)
    name = next(n for n, p in PROTOCOLS.items() if p == proto)
    addr = _addr_of(family, raw)
    prefix = ipaddress.ip_network(f"{addr}/{bits - HEAD_BITS}")
    return name, prefix, int.from_bytes(port, "big")


def pack_target(slot: int, target: Endpoint) -> bytes:
    return TARGET_LAYOUT.pack(
        slot,
        PROTOCOLS[target.proto],
        _family(target.address.version),
        target.port.to_bytes(2, "big"),
        _addr16(target.address),
    )


def unpack_target(value: bytes) -> tuple[int, Endpoint]:
    slot, proto, family, port, raw = TARGET_LAYOUT.unpack(value)
    name = next(n for n, p in PROTOCOLS.items() if p == proto)
    return slot, Endpoint(_addr_of(family, raw), int.from_bytes(port, "big"), name)


def pin_dir(instance: str) -> Path:
    """Where an instance's sk_lookup program, link and maps are pinned."""
    return paths.pin_root(instance) / PIN_DIR


def attached(instance: str) -> bool:
    """Whether ``instance`` has a pinned sk_lookup link."""
    return (pin_dir(instance) / LINK_PIN).exists()


def _netns_fd() -> int:
    """The calling thread's network namespace (setns changes a thread, not the process)."""
    return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)


class SkLookup(Closing):
    """host_sk_lookup of an instance, attached to the calling thread's network namespace
    on first use; later opens reuse the pinned maps and link."""

    def __init__(self, instance: str, obj_path: Path | None = None) -> None:
        self.instance = instance
        self.dir = pin_dir(instance)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)  # pins are root's business only
        self.obj = BpfObject.load(obj_path or paths.bpf_object(OBJECT), pin_root=self.dir)
        try:
            self.maps = {n: self.obj.map(n) for n in MAP_NAMES}
            self._attach()
        except BaseException:
            self.obj.close()
            raise

    def _attach(self) -> None:
        """Attach and pin, unless a pinned link is already there (then keep it: its
        program uses the same pinned maps)."""
        if attached(self.instance):
            return
        prog = self.obj.program(PROGRAM)
        ns = _netns_fd()
        try:
            link = attach_link(prog, ns, lib.BPF_SK_LOOKUP, "sk_lookup, this netns")
        finally:
            os.close(ns)
        with link:
            prog_pin = self.dir / PROG_PIN
            if not prog_pin.exists():
                prog.pin(prog_pin)
            link.pin(self.dir / LINK_PIN)

    # -- rules ---------------------------------------------------------------------------

    def rules(self) -> list[Rule]:
        """Every rule, sorted by protocol, prefix and port."""
        out = []
        for key, value in self.maps["skl_rules"].items():
            proto, prefix, port = unpack_key(key)
            slot, target = unpack_target(value)
            out.append(Rule(proto, prefix, port, target, slot))
        return sorted(out, key=lambda r: (r.proto, r.prefix.version, r.prefix, r.port))

    def _slot_for(self, sock: socket.socket) -> int:
        """The sockmap slot holding ``sock`` (by its cookie), else a free one with ``sock``
        put in it."""
        socks = self.maps["skl_socks"]
        cookie = socket_cookie(sock)
        free = None
        for slot in range(socks.max_entries):
            value = socks.lookup(struct.pack("<I", slot))
            if value is None:
                free = slot if free is None else free
            elif struct.unpack("<Q", value)[0] == cookie:
                return slot
        if free is None:
            raise SteerError(f"every one of the {socks.max_entries} socket slots is taken")
        socks.update(struct.pack("<I", free), struct.pack("<Q", sock.fileno()))
        return free

    def add(
        self,
        proto: str,
        prefix: Prefix,
        ports: Iterable[int],
        sock: socket.socket,
        target: Endpoint,
    ) -> list[Rule]:
        """Steer ``proto`` traffic to ``prefix`` on ``ports`` (empty: every port) to
        ``sock``, which is bound at ``target``; an existing rule for the same key is
        replaced. Returns the rules written."""
        if proto not in PROTOCOLS:
            raise SteerError(f"protocol {proto!r}: tcp or udp")
        want = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
        if sock.type != want:
            raise SteerError(f"{target} is not a {proto} socket")
        try:
            slot = self._slot_for(sock)
        except BpfError as e:
            raise SteerError(f"{target}: the sockmap refused the socket: {e}") from None
        port_list = sorted(set(ports)) or [0]
        value = pack_target(slot, target)
        for port in port_list:
            self.maps["skl_rules"].update(pack_key(proto, prefix, port), value)
        self._free_unused_slots()
        return [Rule(proto, prefix, p, target, slot) for p in port_list]

    def delete(self, proto: str, prefix: Prefix, ports: Iterable[int]) -> int:
        """Remove the rules for ``prefix`` on ``ports`` (empty: the every-port rule);
        returns how many there were. A socket no rule names any more leaves the sockmap."""
        port_list = sorted(set(ports)) or [0]
        gone = sum(self.maps["skl_rules"].delete(pack_key(proto, prefix, p)) for p in port_list)
        self._free_unused_slots()
        return gone

    def _free_unused_slots(self) -> None:
        used = {r.slot for r in self.rules()}
        socks = self.maps["skl_socks"]
        for slot in range(socks.max_entries):
            key = struct.pack("<I", slot)
            # Deleting an empty sockmap slot is EINVAL, not ENOENT: look first.
            if slot not in used and socks.lookup(key) is not None:
                socks.delete(key)

    def follow(self, find: Callable[[Endpoint], socket.socket]) -> list[Endpoint]:
        """:func:`follow` on this instance's maps."""
        return _follow(self.maps["skl_rules"], self.maps["skl_socks"], find)

    def events(self) -> dict[SkLookupEvent, int]:
        """The counters, summed over CPUs."""
        return events_of(self.maps["skl_events"])

    def close(self) -> None:
        self.obj.close()


def _follow(rules: Map, socks: Map, find: Callable[[Endpoint], socket.socket]) -> list[Endpoint]:
    targets = {}
    for _, value in rules.items():
        slot, target = unpack_target(value)
        targets[slot] = target
    seated = []
    for slot, target in sorted(targets.items()):
        key = struct.pack("<I", slot)
        if socks.lookup(key) is not None:
            continue
        try:
            with find(target) as sock:
                socks.update(key, struct.pack("<Q", sock.fileno()))
        except (XdplbError, OSError):
            continue  # not bound (yet): the program counts NO_SOCKET meanwhile
        seated.append(target)
    return seated


def follow(instance: str, find: Callable[[Endpoint], socket.socket]) -> list[Endpoint]:
    """Put back the socket of every rule whose socket closed (the kernel empties its
    sockmap slot when the socket goes): a restarted server binds a new one where the old
    was, and ``find`` takes it (e.g. :func:`xdplb.core.sockdiag.bound_socket`). Works on
    the pinned maps, loading nothing; returns the targets put back. A target not bound
    now stays empty."""
    d = pin_dir(instance)
    with Map.from_pinned(d / "skl_rules") as rules, Map.from_pinned(d / "skl_socks") as socks:
        return _follow(rules, socks, find)


def events_of(events: Map) -> dict[SkLookupEvent, int]:
    return {
        ev: sum(struct.unpack("<Q", v[:8])[0] for v in events.lookup_percpu(struct.pack("<I", ev)))
        for ev in SkLookupEvent
    }


def socket_cookie(sock: socket.socket) -> int:
    """SO_COOKIE (57): the number the kernel knows a socket by (what a sockmap returns)."""
    return int(struct.unpack("<Q", sock.getsockopt(socket.SOL_SOCKET, 57, 8))[0])


def link_prog_id(instance: str) -> int | None:
    """Id of the program the pinned link runs, or None when nothing is attached."""
    if not attached(instance):
        return None
    with Link.from_pinned(pin_dir(instance) / LINK_PIN) as link:
        return link.prog_id


def detach(instance: str) -> bool:
    """Detach the instance's sk_lookup link and remove its pins (program, link, maps).
    False when nothing was attached."""
    d = pin_dir(instance)
    if not d.exists():
        return False
    link_path = d / LINK_PIN
    if link_path.exists():
        with Link.from_pinned(link_path) as link:
            try:
                link.detach()
            except BpfError as e:
                if e.errno != errno.ENOLINK:  # already detached (its netns is gone)
                    raise
    shutil.rmtree(d, ignore_errors=True)
    with contextlib.suppress(OSError):  # the pin root, unless host_tc's pins are there
        d.parent.rmdir()
    return True
