"""sock_lb (bpf/sock_lb.bpf.c): socket-level service balancing for the processes of a cgroup.

A client in the cgroup that connects (TCP, UDP) or sends (unconnected UDP) to a service
address is sent to a backend when it makes the call, so no packet is ever translated.
:class:`SockLb` loads the object with its maps pinned per instance, attaches its ten
cgroup hooks as pinned bpf_links (they outlive this process), and takes the whole desired
state in one :meth:`SockLb.apply`: services, backends with weights and health, affinity,
as a :class:`Plan` computed beforehand (:mod:`xdplb.sockets.socklb_plan` builds the Maglev
tables: this layer imports only core).

A table is replaced whole. A backend that goes down is left out of its tables, and the UDP
sockets connected to it through a service are destroyed (``bpf_sock_destroy`` from an
iter/udp program) so their owners get ECONNABORTED and reconnect.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import ipaddress
import os
import shutil
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from xdplb.core import limits, paths
from xdplb.core.abi import AbiStruct
from xdplb.core.addresses import IPAddress
from xdplb.core.closing import Closing
from xdplb.core.errors import BpfError, XdplbError
from xdplb.datapath._ffi import lib
from xdplb.datapath.links import Link, attach_link, run_iter
from xdplb.datapath.maps import BPF_F_INNER_MAP, Map, MapType
from xdplb.datapath.objects import BpfObject

#: Mirrors of bpf/include/sock_lb_abi.h (checked against the object's BTF by
#: tests/bpf/test_sock_lb_abi.py).
MAX_SERVICES = limits.SOCKLB_MAX_SERVICES
MAX_BACKENDS = limits.SOCKLB_MAX_BACKENDS
FAMILY_V4 = 4
FAMILY_V6 = 6

#: Where an instance's sock_lb pins live: ``<pin root>/sock_lb`` (maps) and its ``links``.
PIN_SUBDIR = "sock_lb"
LINKS_SUBDIR = "links"
OBJECT = "sock_lb"

#: A service's Maglev table: one backend id per bucket.
U32Array = npt.NDArray[np.uint32]


class SockLbEvent(enum.IntEnum):
    """Index of ``socklb_events`` (``enum socklb_event``), counted per CPU."""

    CONNECT = 0
    SENDMSG = enum.auto()
    RECVMSG = enum.auto()
    PEERNAME = enum.auto()
    AFFINITY_HIT = enum.auto()
    NO_BACKEND = enum.auto()
    BIND_REFUSED = enum.auto()
    REV_FAILED = enum.auto()
    DESTROYED = enum.auto()
    DESTROY_FAILED = enum.auto()


class SvcKey(AbiStruct):
    c_name = "socklb_svc_key"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),
        ("port", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("family", ctypes.c_uint8),
    ]


class SvcValue(AbiStruct):
    c_name = "socklb_svc"
    _fields_ = [
        ("id", ctypes.c_uint32),
        ("table_size", ctypes.c_uint32),
        ("affinity_ns", ctypes.c_uint64),
    ]


class BackendValue(AbiStruct):
    c_name = "socklb_backend"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),
        ("port", ctypes.c_uint16),  # network order
        ("family", ctypes.c_uint8),
        ("up", ctypes.c_uint8),
    ]

    @classmethod
    def of(cls, endpoint: Endpoint, up: bool) -> BackendValue:
        return cls(
            _words(endpoint.address), socket.htons(endpoint.port), _family(endpoint.address), up
        )


class AffKey(AbiStruct):
    c_name = "socklb_aff_key"
    _fields_ = [
        ("netns_cookie", ctypes.c_uint64),
        ("svc_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class AffValue(AbiStruct):
    c_name = "socklb_aff"
    _fields_ = [
        ("last_ns", ctypes.c_uint64),
        ("backend_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class RevKey(AbiStruct):
    c_name = "socklb_rev_key"
    _fields_ = [
        ("cookie", ctypes.c_uint64),
        ("addr", ctypes.c_uint32 * 4),
        ("port", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 5),
    ]


class RevValue(AbiStruct):
    c_name = "socklb_rev"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),
        ("port", ctypes.c_uint16),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
        ("backend_id", ctypes.c_uint32),
    ]


#: Every mirrored struct, for the BTF check.
STRUCTS: tuple[type[AbiStruct], ...] = (
    SvcKey,
    SvcValue,
    BackendValue,
    AffKey,
    AffValue,
    RevKey,
    RevValue,
)

#: (program, attach type) of every cgroup hook.
HOOKS: tuple[tuple[str, int], ...] = (
    ("sock_lb_connect4", lib.BPF_CGROUP_INET4_CONNECT),
    ("sock_lb_connect6", lib.BPF_CGROUP_INET6_CONNECT),
    ("sock_lb_sendmsg4", lib.BPF_CGROUP_UDP4_SENDMSG),
    ("sock_lb_sendmsg6", lib.BPF_CGROUP_UDP6_SENDMSG),
    ("sock_lb_recvmsg4", lib.BPF_CGROUP_UDP4_RECVMSG),
    ("sock_lb_recvmsg6", lib.BPF_CGROUP_UDP6_RECVMSG),
    ("sock_lb_getpeername4", lib.BPF_CGROUP_INET4_GETPEERNAME),
    ("sock_lb_getpeername6", lib.BPF_CGROUP_INET6_GETPEERNAME),
    ("sock_lb_post_bind4", lib.BPF_CGROUP_INET4_POST_BIND),
    ("sock_lb_post_bind6", lib.BPF_CGROUP_INET6_POST_BIND),
)
DESTROY_PROGRAM = "sock_lb_destroy"


class SockLbError(XdplbError):
    """A desired state sock_lb cannot hold (too many services, mixed families, ...)."""


def _words(addr: IPAddress) -> tuple[int, int, int, int]:
    raw = addr.packed.ljust(16, b"\0")
    w = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, 16, 4)]
    return (w[0], w[1], w[2], w[3])


def _addr(words: Sequence[int], family: int) -> IPAddress:
    raw = b"".join(int(w).to_bytes(4, "little") for w in words)
    return ipaddress.IPv4Address(raw[:4]) if family == FAMILY_V4 else ipaddress.IPv6Address(raw)


def _family(addr: IPAddress) -> int:
    return FAMILY_V4 if addr.version == 4 else FAMILY_V6


def _svc_key(addr: IPAddress, port: int, proto: int) -> SvcKey:
    return SvcKey(_words(addr), socket.htons(port), proto, _family(addr))


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


# -- the desired state ---------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """An address and port: a backend's identity (one id per endpoint, whatever the
    services that name it)."""

    address: IPAddress
    port: int

    def order(self) -> tuple[int, int, int]:
        """A sort key across families (ipaddress refuses to compare v4 with v6)."""
        return (self.address.version, int(self.address), self.port)

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port}"


#: (address, port, proto): how a service is named.
ServiceKey = tuple[IPAddress, int, int]


@dataclass(frozen=True)
class Plan:
    """What :meth:`SockLb.apply` writes; computed without a kernel by
    :func:`xdplb.sockets.socklb_plan.plan` against :meth:`SockLb.current`."""

    #: Service key -> (service id, value, its table as backend ids; None: no backend up).
    services: dict[ServiceKey, tuple[int, SvcValue, U32Array | None]]
    #: Backend id -> value, for every backend of the desired state (down ones too).
    backends: dict[int, BackendValue]
    #: Backend id -> endpoint, as in ``backends``.
    endpoints: dict[int, Endpoint]
    #: Services of the current state that are not desired any more: their ids.
    removed_services: dict[ServiceKey, int]
    #: Ids of backends no service names any more (their slot is zeroed).
    removed_backends: frozenset[int]
    #: Ids of backends that were up and no longer are (down or removed): the UDP sockets
    #: connected to them through a service are destroyed.
    went_down: frozenset[int] = field(default_factory=frozenset)


# -- the loaded object ---------------------------------------------------------------


@dataclass(frozen=True)
class ApplyResult:
    """What :meth:`SockLb.apply` did."""

    plan: Plan
    #: Socket cookies of the connected UDP sockets destroyed (backends that went down).
    destroyed: tuple[int, ...]


@dataclass(frozen=True)
class ServiceState:
    """A service as the maps hold it (for ``status``)."""

    address: IPAddress
    port: int
    proto: int
    id: int
    table_size: int
    affinity_ns: int
    #: Backend endpoint -> buckets of the table it owns now (absent: none).
    buckets: dict[Endpoint, int]


def pin_dir(instance: str) -> Path:
    """Where ``instance``'s sock_lb maps are pinned (its links under ``links/``)."""
    return paths.pin_root(instance) / PIN_SUBDIR


class SockLb(Closing):
    """sock_lb loaded for an instance: maps pinned under ``pin_dir(instance)``, so a
    later process (the CLI, a restarted daemon) finds and refills the same maps."""

    def __init__(self, instance: str, obj_path: Path | None = None) -> None:
        self.instance = instance
        self.pin_dir = pin_dir(instance)
        self.pin_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.pin_dir, 0o700)  # pins are root's business only
        self.obj = BpfObject.load(obj_path or paths.bpf_object(OBJECT), pin_root=self.pin_dir)
        #: Inner map id -> backend id -> buckets, of the tables the last apply wrote: a
        #: daemon that dropped CAP_SYS_ADMIN cannot read them back by id.
        self._owners: dict[int, dict[int, int]] = {}

    @property
    def links_dir(self) -> Path:
        return self.pin_dir / LINKS_SUBDIR

    def map(self, name: str) -> Map:
        return self.obj.map(name)

    # -- attachment --------------------------------------------------------------

    def attach(self, cgroup: Path) -> None:
        """Attach every hook to the cgroup v2 directory ``cgroup`` as a pinned bpf_link
        (processes in it and its descendants are balanced). A hook attached there
        already gets its program swapped in place (bpf_link_update); one attached to
        another cgroup moves: the new link is made first, then the old one goes."""
        self.links_dir.mkdir(exist_ok=True)
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        target = os.fstat(fd).st_ino  # a v2 cgroup's id
        made: list[tuple[Path, Path]] = []  # (new link's pin, the pin it replaces)
        try:
            for name, attach_type in HOOKS:
                prog = self.obj.program(name)
                pin = self.links_dir / name
                if pin.exists():
                    with Link.from_pinned(pin) as link:
                        if link.cgroup_id == target:
                            link.update_program(prog)
                            continue
                new = pin.with_name(f"moving_{name}")  # bpffs refuses dots in names
                with attach_link(prog, fd, attach_type, f"cgroup {cgroup}") as link:
                    link.pin(new)
                    made.append((new, pin))
        except BaseException:
            for new, _ in made:  # all hooks or none: half a balancer rewrites without replies
                _unlink_link(new)
            raise
        finally:
            os.close(fd)
        for new, pin in made:
            if pin.exists():  # attached elsewhere before: it leaves that cgroup now
                _unlink_link(pin)
            new.rename(pin)

    def attached(self, cgroup: Path | None = None) -> bool:
        """Every hook attached (to ``cgroup``, if given)."""
        pins = [self.links_dir / name for name, _ in HOOKS]
        if not all(p.exists() for p in pins):
            return False
        if cgroup is None:
            return True
        try:
            want = os.stat(cgroup).st_ino
        except OSError:
            return False
        for p in pins:
            with Link.from_pinned(p) as link:
                if link.cgroup_id != want:
                    return False
        return True

    # -- the state ---------------------------------------------------------------

    def current(self) -> tuple[dict[ServiceKey, int], dict[Endpoint, tuple[int, bool]]]:
        """(service key -> id, endpoint -> (backend id, up)) as the maps hold them."""
        svcs = {key: v.id for key, v in self._service_values().items()}
        bes: dict[Endpoint, tuple[int, bool]] = {}
        raw = self.map("socklb_backends").lookup_array()
        size = ctypes.sizeof(BackendValue)
        for i in range(1, len(raw) // size):
            b = BackendValue.from_buffer_copy(raw, i * size)
            if b.family:
                bes[Endpoint(_addr(b.addr, b.family), socket.ntohs(b.port))] = (i, bool(b.up))
        return svcs, bes

    def _service_values(self) -> dict[ServiceKey, SvcValue]:
        out: dict[ServiceKey, SvcValue] = {}
        for key, value in self.map("socklb_services").items():
            k = SvcKey.from_buffer_copy(key)
            out[(_addr(k.addr, k.family), socket.ntohs(k.port), k.proto)] = (
                SvcValue.from_buffer_copy(value)
            )
        return out

    def apply(self, p: Plan) -> ApplyResult:
        """Write ``p`` (planned against :meth:`current`, which nothing else changed since),
        in an order where a connect never
        finds a table slot naming a backend that is not up, nor a bucket past its table's
        end: backends up first, then each table swapped whole, then the service entries
        (before the table for a service whose table shrinks), then backends down;
        services gone, then their tables, then backends gone. Last, the connected UDP
        sockets of backends that went down are destroyed -- those of the calling thread's
        network namespace, the one the iterator walks."""
        old_sizes = {key: v.table_size for key, v in self._service_values().items()}
        # A table and its service's size are two writes: whichever is smaller must be in
        # place while the other is not, or a bucket would fall past the table's end.
        svc_map = self.map("socklb_services")
        shrinking = {
            key: value
            for key, (_, value, _) in p.services.items()
            if old_sizes.get(key, 0) > value.table_size
        }
        backends = self.map("socklb_backends")
        for bid, be in p.backends.items():
            if be.up:
                backends.update(_u32(bid), be.pack())
        for key, value in shrinking.items():
            svc_map.update(_svc_key(*key).pack(), value.pack())
        tables = self.map("socklb_tables")
        written = []
        for sid, _, table in p.services.values():
            if table is None:
                tables.delete(_u32(sid))
                continue
            with Map.create(
                MapType.ARRAY, 4, 4, len(table), name=f"socklb_tbl_{sid}", flags=BPF_F_INNER_MAP
            ) as inner:
                inner.update_array(table)
                tables.update(_u32(sid), _u32(inner.fd))
                self._owners[inner.id] = _owners(table)
                written.append(inner.id)
        for key, (_, value, _) in p.services.items():
            if key not in shrinking:
                svc_map.update(_svc_key(*key).pack(), value.pack())
        for bid, be in p.backends.items():
            if not be.up:
                backends.update(_u32(bid), be.pack())
        for key, sid in p.removed_services.items():
            svc_map.delete(_svc_key(*key).pack())
            tables.delete(_u32(sid))
        for bid in p.removed_backends:
            backends.update(_u32(bid), BackendValue().pack())
        self._owners = {i: self._owners[i] for i in written}  # the maps hold these alone
        destroyed = self.destroy_connected() if p.went_down else ()
        return ApplyResult(plan=p, destroyed=destroyed)

    def destroy_connected(self) -> tuple[int, ...]:
        """Destroy every UDP socket of the calling thread's network namespace that is
        connected through a service to a backend not up now; their cookies."""
        out = run_iter(self.obj.program(DESTROY_PROGRAM))
        return tuple(struct.unpack(f"<{len(out) // 8}Q", out[: len(out) // 8 * 8]))

    def services(self) -> list[ServiceState]:
        """Every service and the buckets each backend owns in its table."""
        _, bes = self.current()
        by_id = {i: ep for ep, (i, _) in bes.items()}
        out = []
        for key, value in self.map("socklb_services").items():
            k = SvcKey.from_buffer_copy(key)
            v = SvcValue.from_buffer_copy(value)
            buckets: dict[Endpoint, int] = {}
            for bid, n in self._table_owners(v.id).items():
                if bid in by_id:
                    buckets[by_id[bid]] = n
            out.append(
                ServiceState(
                    _addr(k.addr, k.family),
                    socket.ntohs(k.port),
                    k.proto,
                    v.id,
                    v.table_size,
                    v.affinity_ns,
                    buckets,
                )
            )
        return sorted(out, key=lambda s: s.id)

    def _table_owners(self, sid: int) -> dict[int, int]:
        """Backend id -> buckets, of service ``sid``'s table ({} when it has none)."""
        raw = self.map("socklb_tables").lookup(_u32(sid))
        if raw is None:
            return {}
        map_id = struct.unpack("<I", raw[:4])[0]
        if map_id in self._owners:
            return self._owners[map_id]
        # A table this process did not write: read it by id (CAP_SYS_ADMIN: the CLI, or
        # the daemon before it drops its capabilities, xdplb.daemon.privileges).
        try:
            with Map.from_id(map_id) as inner:
                words = inner.lookup_array()
        except BpfError as e:
            # ENOENT: replaced by a concurrent apply; EPERM: written by another process
            # after the daemon dropped CAP_SYS_ADMIN (its next apply replaces it).
            if e.errno in (errno.ENOENT, errno.EPERM):
                return {}
            raise
        return _owners(np.frombuffer(words, dtype=np.uint32))

    def events(self) -> dict[SockLbEvent, int]:
        return events(self.map("socklb_events"))

    def close(self) -> None:
        self.obj.close()


def _owners(table: U32Array) -> dict[int, int]:
    """Backend id -> buckets of a table (backend ids, one a bucket)."""
    ids, n = np.unique(table, return_counts=True)
    return dict(zip(ids.tolist(), n.tolist(), strict=True))


def events(m: Map) -> dict[SockLbEvent, int]:
    """``socklb_events`` summed over CPUs."""
    return {
        ev: sum(struct.unpack("<Q", v[:8])[0] for v in m.lookup_percpu(_u32(ev)))
        for ev in SockLbEvent
    }


def _unlink_link(pin: Path) -> None:
    with Link.from_pinned(pin) as link:
        link.detach()
    pin.unlink()


def detach(instance: str) -> bool:
    """Detach every hook of ``instance`` and remove its pins (maps included); False if it
    had none."""
    root = pin_dir(instance)
    if not root.exists():
        return False
    links = root / LINKS_SUBDIR
    if links.exists():
        for pin in sorted(links.iterdir()):
            _unlink_link(pin)
    shutil.rmtree(root, ignore_errors=True)
    with contextlib.suppress(OSError):  # the instance's pin root, unless others use it
        root.parent.rmdir()
    return True
