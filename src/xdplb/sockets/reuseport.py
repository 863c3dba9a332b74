"""Server generations on one SO_REUSEPORT group, kept apart by an sk_reuseport program.

When a server is replaced, the new process binds the same address and port with
SO_REUSEPORT and the kernel spreads traffic over old and new sockets by a hash: the old
process gets new flows it is about to drop, and a UDP flow (QUIC) can jump from one
process to the other mid-way. ``bpf/host_reuseport.bpf.c`` chooses instead, from maps
shared by every process of the service (pinned under ``paths.pin_root("rp-<name>")``):

- every generation owns a slot of up to 64 sockets (a TCP listener, or one UDP socket
  per worker); within it a flow's socket is its hash modulo the socket count;
- new TCP connections and new UDP flows go to the *ready* generation; before any is
  ready, to the oldest live one;
- optionally, a socket is preferred on a CPU (its worker runs there): new flows that
  arrive on that CPU go to it (``gen.add(sock, cpu=n)``);
- a UDP flow already seen stays with the generation that had it until that generation
  retires or the flow idles out (an LRU map with idle expiry);
- requests queued in a listener that closes are migrated to the ready generation
  (``sk_reuseport/migrate``) instead of being reset.

A server process replaces its predecessor so::

    group = ReuseportGroup.open("dns", "udp")
    gen = group.begin()
    for _ in range(4):
        gen.add(bind_reuseport("udp", "::", 53))
    gen.ready()                  # new flows come here now; the old keeps its own
    ...
    # the old process, when told to go:
    old.retire()                 # nothing new is selected for its sockets ...
    drain_udp(socks, answer)     # ... so what is queued is all there is: answer it
    for s in socks: s.close()

That order loses no datagram: after :meth:`Generation.retire` the program chooses no
socket of the generation, and :func:`drain_udp` reads until the queues stay empty.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import fcntl
import os
import selectors
import shutil
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from xdplb.core import paths
from xdplb.core.abi import AbiStruct
from xdplb.core.closing import Closing
from xdplb.core.errors import XdplbError
from xdplb.datapath.links import attach_reuseport
from xdplb.datapath.maps import BPF_F_LOCK, Map, possible_cpus
from xdplb.datapath.objects import BpfObject
from xdplb.datapath.programs import Program

Proto = Literal["tcp", "udp"]

OBJECT = "host_reuseport"
PROGRAM = "host_reuseport"
PROG_PIN = "prog"
MAP_NAMES = ("rp_socks", "rp_state", "rp_flows", "rp_cpu_pref", "rp_events")

#: Mirrors of bpf/include/reuseport_abi.h (checked against the object's BTF by
#: tests/unit/test_reuseport_abi.py).
SLOTS = 4
SOCKS_PER_SLOT = 64
FLOWS = 65536
MAX_CPUS = 128
NO_SLOT = 0xFFFFFFFF

#: A UDP flow unseen this long is a new flow (it goes to the ready generation).
DEFAULT_FLOW_IDLE = 30.0
#: How long the queues of a retired generation must stay empty before they count as
#: drained: a datagram the program steered while retire() ran may land a moment later.
DEFAULT_QUIET = 0.1
#: The backlog bind_reuseport gives a TCP listener.
BACKLOG = 1024
#: The sysctl that lets a closing listener's requests move to another of its group.
TCP_MIGRATE_SYSCTL = Path("/proc/sys/net/ipv4/tcp_migrate_req")

_SOCK_TYPES = {"tcp": socket.SOCK_STREAM, "udp": socket.SOCK_DGRAM}


class SlotState(enum.IntEnum):
    """``enum rp_slot_state``: where a generation is in its life."""

    FREE = 0
    STARTING = 1
    READY = 2
    OLD = 3


class ReuseportEvent(enum.IntEnum):
    """Index of ``rp_events`` (``enum rp_event``), counted per CPU."""

    FLOW_HIT = 0
    NEW_FLOW = enum.auto()
    FLOW_MOVED = enum.auto()
    TCP_SELECT = enum.auto()
    MIGRATED = enum.auto()
    NO_GENERATION = enum.auto()
    SELECT_FAILED = enum.auto()
    MIGRATE_FAILED = enum.auto()
    NO_HEADER = enum.auto()


class SlotValue(AbiStruct):
    c_name = "rp_slot"
    _fields_ = [
        ("generation", ctypes.c_uint32),
        ("socks", ctypes.c_uint32),
        ("state", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class StateValue(AbiStruct):
    c_name = "rp_state"
    _fields_ = [
        ("lock", ctypes.c_uint32),  # struct bpf_spin_lock: the kernel's, never ours
        ("ready_slot", ctypes.c_uint32),
        ("next_generation", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("flow_idle_ns", ctypes.c_uint64),
        ("slots", SlotValue * SLOTS),
    ]


class FlowKey(AbiStruct):
    c_name = "rp_flow_key"
    _fields_ = [
        ("addr", ctypes.c_uint32 * 4),  # network order
        ("remote_port", ctypes.c_uint16),  # network order
        ("local_port", ctypes.c_uint16),  # network order
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


class FlowValue(AbiStruct):
    c_name = "rp_flow"
    _fields_ = [
        ("last_ns", ctypes.c_uint64),
        ("slot", ctypes.c_uint32),
        ("generation", ctypes.c_uint32),
        ("index", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


STRUCTS: tuple[type[AbiStruct], ...] = (SlotValue, StateValue, FlowKey, FlowValue)

_ZERO = struct.pack("<I", 0)


class ReuseportError(XdplbError):
    """A generation operation that cannot be done as asked."""


@dataclass(frozen=True, slots=True)
class GenerationStatus:
    """One live generation of a group, as the shared maps show it."""

    number: int
    """Its generation number (increases with every begin())."""
    state: SlotState
    """STARTING, READY (new flows come here) or OLD (keeps its known UDP flows)."""
    sockets: int
    """Its sockets still open (the kernel drops a closed socket from the map)."""
    flows: int
    """UDP flows remembered for it and not idle."""


def family_of(host: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal, AF_INET otherwise."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_reuseport(proto: Proto, host: str, port: int) -> socket.socket:
    """A socket with SO_REUSEPORT bound to ``host:port`` (TCP: listening, backlog
    :data:`BACKLOG`), not inheritable. Port 0 takes an ephemeral port: bind the next
    ones to the port it got."""
    sock = socket.socket(family_of(host), _SOCK_TYPES[proto])
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if proto == "tcp":
            sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_migrate_enabled() -> bool:
    """Whether ``net.ipv4.tcp_migrate_req`` is on in the caller's network namespace."""
    return TCP_MIGRATE_SYSCTL.read_text().strip() == "1"


def enable_tcp_migrate() -> None:
    """Turn ``net.ipv4.tcp_migrate_req`` on in the caller's network namespace. The
    migrate program already moves requests of a closing listener; the sysctl also covers
    a group whose program is not attached yet (the kernel then picks by hash)."""
    if not tcp_migrate_enabled():
        TCP_MIGRATE_SYSCTL.write_text("1\n")


def drain_udp(
    socks: Sequence[socket.socket],
    answer: Callable[[socket.socket, bytes, Any], None],
    *,
    quiet: float = DEFAULT_QUIET,
    limit: float = 30.0,
) -> int:
    """Read ``socks`` of a retired generation until all of them stayed empty for
    ``quiet`` seconds (at most ``limit`` seconds in all), calling ``answer(sock, data,
    peer)`` for every datagram; return how many were read. Call it after
    :meth:`Generation.retire` and before closing the sockets."""
    deadline = time.monotonic() + limit
    n = 0
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ, s)
        while time.monotonic() < deadline:
            ready = sel.select(quiet)
            if not ready:
                break
            for key, _ in ready:
                sock: socket.socket = key.data
                with contextlib.suppress(BlockingIOError):
                    data, peer = sock.recvfrom(65535, socket.MSG_DONTWAIT)
                    n += 1
                    answer(sock, data, peer)
    return n


class ReuseportGroup(Closing):
    """The shared program and maps of one service's reuseport group.

    Every process of the service opens the same group by name; the first one loads the
    object and pins it. Changes to the generations are made under an flock of the pin
    directory (processes) and written to the state map whole under its spin lock (the
    program), so neither sees half of a transition.
    """

    def __init__(
        self, name: str, proto: Proto, pin_dir: Path, prog: Program, maps: dict[str, Map]
    ) -> None:
        """Use :meth:`open`: it takes the handles from the pins or from a fresh load."""
        self.name = name
        self.proto: Proto = proto
        self.pin_dir = pin_dir
        self.program = prog
        self._maps = maps

    # -- opening -------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        name: str,
        proto: Proto,
        *,
        create: bool = True,
        flow_idle: float | None = None,
    ) -> ReuseportGroup:
        """Open the group ``name``, loading and pinning the object if nobody has yet
        (``create``; otherwise ReuseportError). ``flow_idle`` (seconds) sets the UDP
        flow idle timeout for the whole group (default :data:`DEFAULT_FLOW_IDLE` when the
        group is created)."""
        if proto not in _SOCK_TYPES:
            raise ReuseportError(f"protocol {proto!r}: tcp or udp")
        pin_dir = paths.pin_root(f"rp-{name}")
        if not create and not (pin_dir / PROG_PIN).exists():
            raise ReuseportError(f"no reuseport group {name!r} ({pin_dir} has no program)")
        pin_dir.mkdir(parents=True, exist_ok=True)
        with _locked(pin_dir):
            if (pin_dir / PROG_PIN).exists():
                prog = Program.from_pinned(pin_dir / PROG_PIN)
                maps = {m: Map.from_pinned(pin_dir / m) for m in MAP_NAMES}
                group = cls(name, proto, pin_dir, prog, maps)
            else:
                group = cls._create(name, proto, pin_dir)
            if flow_idle is not None:
                st = group._read()
                st.flow_idle_ns = int(flow_idle * 1e9)
                group._write(st)
        return group

    @classmethod
    def _create(cls, name: str, proto: Proto, pin_dir: Path) -> ReuseportGroup:
        with BpfObject.load(paths.bpf_object(OBJECT), pin_root=pin_dir) as obj:
            prog = Program.from_fd(obj.program(PROGRAM).fd, PROGRAM)
            maps = {m: Map.from_fd(obj.map(m).fd, m) for m in MAP_NAMES}
        group = cls(name, proto, pin_dir, prog, maps)
        st = StateValue(ready_slot=NO_SLOT, next_generation=1)
        st.flow_idle_ns = int(DEFAULT_FLOW_IDLE * 1e9)
        group._write(st)
        # Pinned last: a program pin means a group that is ready to use.
        prog.pin(pin_dir / PROG_PIN)
        return group

    # -- state ---------------------------------------------------------------------

    def _read(self) -> StateValue:
        raw = self._maps["rp_state"].lookup(_ZERO, BPF_F_LOCK)
        assert raw is not None  # an array always has its entry
        return StateValue.from_buffer_copy(raw)

    def _write(self, st: StateValue) -> None:
        self._maps["rp_state"].update(_ZERO, bytes(st), BPF_F_LOCK)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[StateValue]:
        """The group's flock, with the state as it is under it."""
        with _locked(self.pin_dir):
            yield self._read()

    # -- generations -----------------------------------------------------------------

    def begin(self) -> Generation:
        """A new generation (its number higher than any before), not ready: it takes
        traffic only while no generation is ready."""
        with self._lock() as st:
            free = [i for i in range(SLOTS) if st.slots[i].state == SlotState.FREE]
            if not free:
                live = sorted(st.slots[i].generation for i in range(SLOTS))
                raise ReuseportError(
                    f"{self.name}: {SLOTS} generations live ({live}): retire one first"
                )
            slot, number = free[0], st.next_generation
            st.next_generation += 1
            st.slots[slot] = SlotValue(generation=number, socks=0, state=SlotState.STARTING)
            self._clear_cpu_prefs(slot)
            self._write(st)
        return Generation(self, number, slot)

    def generation(self, number: int) -> Generation:
        """A handle on live generation ``number`` (begun by this or another process)."""
        st = self._read()
        for i in range(SLOTS):
            slot = st.slots[i]
            if slot.state != SlotState.FREE and slot.generation == number:
                return Generation(self, number, i)
        raise ReuseportError(f"{self.name}: no live generation {number}")

    def status(self) -> list[GenerationStatus]:
        """Every live generation, oldest first."""
        st = self._read()
        flows = self._flows_by_slot(st)
        out = [
            GenerationStatus(
                number=s.generation,
                state=SlotState(s.state),
                sockets=self._open_sockets(i, s.socks),
                flows=flows.get((i, s.generation), 0),
            )
            for i, s in enumerate(st.slots)
            if s.state != SlotState.FREE
        ]
        return sorted(out, key=lambda g: g.number)

    def counters(self) -> dict[str, int]:
        """The program's events (``rp_events``), summed over CPUs, by name."""
        events = self._maps["rp_events"]
        out: dict[str, int] = {}
        for ev in ReuseportEvent:
            per_cpu = events.lookup_percpu(struct.pack("<I", ev))
            out[ev.name.lower()] = sum(int.from_bytes(v, "little") for v in per_cpu)
        return out

    def flow_entries(self) -> list[tuple[FlowKey, FlowValue]]:
        """The UDP flows remembered, idle or not."""
        return [
            (FlowKey.from_buffer_copy(k), FlowValue.from_buffer_copy(v))
            for k, v in self._maps["rp_flows"].items()
        ]

    def _flows_by_slot(self, st: StateValue) -> dict[tuple[int, int], int]:
        """Flows not idle, by (slot, generation number)."""
        now = time.monotonic_ns()  # bpf_ktime_get_ns is CLOCK_MONOTONIC too
        out: dict[tuple[int, int], int] = {}
        for _, v in self.flow_entries():
            if now - v.last_ns < st.flow_idle_ns:
                out[(v.slot, v.generation)] = out.get((v.slot, v.generation), 0) + 1
        return out

    def _cpu_key(self, cpu: int, slot: int) -> bytes:
        return struct.pack("<I", cpu * SLOTS + slot)

    def _clear_cpu_prefs(self, slot: int) -> None:
        prefs = self._maps["rp_cpu_pref"]
        for cpu in range(min(MAX_CPUS, possible_cpus())):
            prefs.update(self._cpu_key(cpu, slot), _ZERO)

    def _open_sockets(self, slot: int, socks: int) -> int:
        m = self._maps["rp_socks"]
        base = slot * SOCKS_PER_SLOT
        return sum(1 for i in range(socks) if m.lookup(struct.pack("<I", base + i)) is not None)

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        """Close this process's handles; the pins (and the program's work) stay."""
        self.program.close()
        for m in self._maps.values():
            m.close()

    def destroy(self) -> None:
        """Close and unpin: the group's sockets keep the program attached until they
        close, but no process can open the group any more. For its last user."""
        self.close()
        shutil.rmtree(self.pin_dir, ignore_errors=True)


class Generation:
    """One generation of a group's servers: a slot of sockets and a number."""

    def __init__(self, group: ReuseportGroup, number: int, slot: int) -> None:
        self.group = group
        self.number = number
        self.slot = slot

    def _mine(self, st: StateValue) -> SlotValue:
        s: SlotValue = st.slots[self.slot]
        if s.state == SlotState.FREE or s.generation != self.number:
            raise ReuseportError(f"{self.group.name}: generation {self.number} is retired")
        return s

    def add(self, sock: socket.socket, *, cpu: int | None = None) -> None:
        """Put ``sock`` (bound, SO_REUSEPORT, of the group's protocol; a TCP one
        listening) into this generation, and attach the group's program to its
        reuseport group. With ``cpu``, new flows and connections that arrive on that CPU
        go to this socket rather than to the flow hash's (its worker should run there:
        the flow's data then stays in one CPU's cache)."""
        if cpu is not None and not 0 <= cpu < min(MAX_CPUS, possible_cpus()):
            raise ReuseportError(f"CPU {cpu}: this machine has {possible_cpus()}")
        if sock.type != _SOCK_TYPES[self.group.proto]:
            raise ReuseportError(f"{self.group.name} is a {self.group.proto} group: {sock!r}")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):
            raise ReuseportError(f"{sock!r} has no SO_REUSEPORT")
        with self.group._lock() as st:
            mine = self._mine(st)
            if mine.socks >= SOCKS_PER_SLOT:
                raise ReuseportError(f"generation {self.number}: {SOCKS_PER_SLOT} sockets")
            key = struct.pack("<I", self.slot * SOCKS_PER_SLOT + mine.socks)
            # In the map before it is counted: the program never reads past the count.
            self.group._maps["rp_socks"].update(key, struct.pack("<Q", sock.fileno()))
            attach_reuseport(self.group.program, sock)
            mine.socks += 1
            if cpu is not None:
                pref = struct.pack("<I", mine.socks)  # 1 + its index
                self.group._maps["rp_cpu_pref"].update(self.group._cpu_key(cpu, self.slot), pref)
            self.group._write(st)

    def ready(self) -> None:
        """New TCP connections and new UDP flows come here from now on; the ready
        generation before it becomes OLD and keeps the UDP flows it knows."""
        with self.group._lock() as st:
            mine = self._mine(st)
            if mine.socks == 0:
                raise ReuseportError(f"generation {self.number} has no socket")
            prev = st.ready_slot
            if prev != NO_SLOT and prev != self.slot:
                st.slots[prev].state = SlotState.OLD
            mine.state = SlotState.READY
            st.ready_slot = self.slot
            self.group._write(st)

    def retire(self) -> None:
        """Nothing is selected for this generation's sockets any more: its UDP flows go
        to the ready generation (see the module's order for a server), its slot is
        freed. A retired generation stays retired."""
        with self.group._lock() as st:
            mine = self._mine(st)
            socks = mine.socks
            st.slots[self.slot] = SlotValue(generation=self.number, state=SlotState.FREE)
            if st.ready_slot == self.slot:
                st.ready_slot = NO_SLOT
            self.group._write(st)
            self.group._clear_cpu_prefs(self.slot)
            # The program already ignores them; clear them so a later slot starts clean.
            base = self.slot * SOCKS_PER_SLOT
            for i in range(socks):
                self.group._maps["rp_socks"].delete(struct.pack("<I", base + i))
        flows = self.group._maps["rp_flows"]
        for k, v in self.group.flow_entries():
            if v.slot == self.slot and v.generation == self.number:
                flows.delete(bytes(k))

    def flows(self) -> int:
        """UDP flows remembered for this generation and not idle."""
        st = self.group._read()
        return self.group._flows_by_slot(st).get((self.slot, self.number), 0)

    def __repr__(self) -> str:
        return f"Generation({self.group.name!r}, number={self.number}, slot={self.slot})"


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive flock of ``directory``: one process at a time changes the group."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
