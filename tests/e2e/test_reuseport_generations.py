"""Zero-downtime restarts with the sk_reuseport program: server generations as real
processes (tests/e2e/reuseport_server.py) replaced under load in a fresh namespace.

UDP: 200 flows each send a numbered datagram per round and wait for its answer, which
names the generation that answered. A second generation starts mid-stream, becomes
ready, and the first retires: every datagram is answered exactly once; the flows known
before the new generation was ready stay with the old one until it retires, those that
start after go to the new one, and the map of flows says the same.

TCP: 200 long-lived connections and a steady stream of new ones. The old generation
stops accepting, so connections wait in its accept queue; the new one becomes ready and
the old retires and closes its listener: the waiting connections are migrated (the
program counts them) and answered by the new generation; nothing is refused or reset,
and the long-lived connections keep being answered by the old one.
"""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from xdplb.datapath.maps import Map
from xdplb.lab import netns as netns_mod
from xdplb.lab.wait import wait_for
from xdplb.sockets import reuseport as rp
from xdplb.sockets.reuseport import (
    ReuseportError,
    ReuseportGroup,
    SlotState,
    bind_reuseport,
    tcp_migrate_enabled,
)

pytestmark = pytest.mark.e2e

SERVER = Path(__file__).with_name("reuseport_server.py")
HOST = "127.0.0.1"
UDP_SOCKETS = 4
OLD_FLOWS = 200
#: Flows that start while the new generation is not ready yet: the old one gets them.
EARLY_FLOWS = 20
#: Flows that start once the new generation is ready.
NEW_FLOWS = 50
#: How long one round waits for its answers: a datagram not answered by then is lost.
ROUND_DEADLINE = 5.0
LONG_LIVED = 200
STREAM_WORKERS = 16
#: Connections opened while the old listener does not accept: they wait in its queue.
QUEUED = 30
#: Connections opened once the new generation is ready, the old one still listening.
AFTER_READY = 10
STREAM_BEFORE = 100
STREAM_AFTER = 100


class Server:
    """A server generation process and its stdout lines."""

    def __init__(self, ns: str, group: str, proto: str, port: int, sockets: int) -> None:
        argv = [sys.executable, str(SERVER), group, proto, HOST, str(port), str(sockets)]
        self.proc = netns_mod.popen(
            ns, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        words = self.expect("added").split()
        self.generation, self.port = int(words[1]), int(words[2])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, word: str, timeout: float = 10.0) -> str:
        """The next line, which must start with ``word``."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"server: no {word!r} line after {timeout} s") from None
        assert line.startswith(word), line
        return line

    def command(self, cmd: str, reply: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.expect(reply)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """Every server a test starts; killed after it, whatever happened."""
    started: list[Server] = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def group_name(netns: str) -> Iterator[str]:
    """A group named after the test's namespace, unpinned after the test."""
    yield netns
    try:
        group = ReuseportGroup.open(netns, "udp", create=False)
    except ReuseportError:  # never created: nothing to unpin
        return
    group.destroy()


# -- UDP ------------------------------------------------------------------------------


@dataclass
class Round:
    """One round of the UDP clients: every active flow sent one numbered datagram."""

    phase_start: str
    phase_end: str = ""
    #: flow -> generation that answered its datagram of this round
    answers: dict[int, int] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)


class UdpClients:
    """Flows (one client socket each, made in the namespace) that send rounds of numbered
    datagrams from a thread, each round waiting for all its answers (no retry)."""

    def __init__(self, ns: str, port: int) -> None:
        self.ns, self.port = ns, port
        self.socks: list[socket.socket] = []
        self._pending: list[socket.socket] = []
        self.groups: dict[str, range] = {}
        self.phase = ""
        self.rounds: list[Round] = []
        self.duplicates = 0
        self.sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def enter_phase(self, phase: str, flows: int = 0) -> None:
        """Name the phase of the rounds from the next one on, and start ``flows`` new
        flows (named after the phase) in those rounds."""
        with netns_mod.enter(self.ns):
            new = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(flows)]
        for s in new:
            s.bind((HOST, 0))
            s.setblocking(False)
        with self._lock:
            first = len(self.socks) + len(self._pending)
            self._pending += new
            if flows:
                self.groups[phase] = range(first, first + flows)
            self.phase = phase

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=ROUND_DEADLINE * 2)
        for s in self.socks:
            s.close()

    def completed(self) -> int:
        return len(self.rounds)

    def _run(self) -> None:
        seq = 0
        while not self._stop.is_set():
            seq += 1
            with self._lock:
                for s in self._pending:  # the selector is this thread's alone
                    self.sel.register(s, selectors.EVENT_READ, len(self.socks))
                    self.socks.append(s)
                self._pending = []
                socks = list(self.socks)
                rnd = Round(self.phase)
            for i, s in enumerate(socks):
                s.sendto(b"%d %d" % (i, seq), (HOST, self.port))
            waiting = set(range(len(socks)))
            deadline = time.monotonic() + ROUND_DEADLINE
            while waiting and time.monotonic() < deadline:
                for key, _ in self.sel.select(0.2):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    while True:
                        try:
                            data = sock.recv(256)
                        except BlockingIOError:
                            break
                        flow, got, gen = data.split()
                        if int(got) != seq or int(flow) not in waiting:
                            self.duplicates += 1
                            continue
                        waiting.discard(int(flow))
                        rnd.answers[int(flow)] = int(gen.removeprefix(b"gen="))
            rnd.lost = sorted(waiting)
            rnd.phase_end = self.phase
            self.rounds.append(rnd)

    def wait_rounds(self, n: int, what: str) -> None:
        """Wait until ``n`` more rounds completed entirely in the current phase."""
        phase = self.phase
        start = self.completed()

        def clean() -> int:
            return sum(1 for r in self.rounds[start:] if r.phase_start == r.phase_end == phase)

        wait_for(clean, what, until=lambda c: c >= n, timeout=30)


def test_udp_generations_lose_nothing_and_keep_old_flows(
    netns: str, group_name: str, servers: list[Server]
) -> None:
    with netns_mod.enter(netns):
        group = ReuseportGroup.open(group_name, "udp")
    try:
        old = Server(netns, group_name, "udp", 0, UDP_SOCKETS)
        servers.append(old)
        old.command("ready", "ready")
        clients = UdpClients(netns, old.port)
        clients.enter_phase("old", OLD_FLOWS)
        clients.start()
        try:
            clients.wait_rounds(3, "rounds answered by the only generation")

            new = Server(netns, group_name, "udp", old.port, UDP_SOCKETS)
            servers.append(new)
            clients.enter_phase("new-started", EARLY_FLOWS)
            clients.wait_rounds(3, "rounds while the new generation is not ready")

            new.command("ready", "ready")
            clients.enter_phase("new-ready", NEW_FLOWS)
            clients.wait_rounds(3, "rounds with both generations")
            status = {g.number: g for g in group.status()}
            assert status[old.generation].state == SlotState.OLD
            assert status[old.generation].flows == OLD_FLOWS + EARLY_FLOWS
            assert status[new.generation].state == SlotState.READY
            assert status[new.generation].flows == NEW_FLOWS

            clients.enter_phase("old-retiring")
            drained = int(old.command("retire", "retired").split()[1])
            old.expect("done")
            assert old.proc.wait(timeout=10) == 0
            clients.enter_phase("old-gone")
            clients.wait_rounds(3, "rounds after the old generation retired")
        finally:
            clients.stop()

        total = OLD_FLOWS + EARLY_FLOWS + NEW_FLOWS
        assert [r for r in clients.rounds if r.lost] == [], "datagrams not answered"
        assert clients.duplicates == 0
        by_phase: dict[str, list[Round]] = {}
        for r in clients.rounds:
            if r.phase_start == r.phase_end:
                by_phase.setdefault(r.phase_start, []).append(r)
        old_flows = [*clients.groups["old"], *clients.groups["new-started"]]
        for phase in ("old", "new-started"):
            for r in by_phase[phase]:
                assert set(r.answers.values()) == {old.generation}, phase
        for r in by_phase["new-ready"]:
            assert {r.answers[f] for f in old_flows} == {old.generation}
            assert {r.answers[f] for f in clients.groups["new-ready"]} == {new.generation}
        for r in by_phase["old-gone"]:
            assert len(r.answers) == total
            assert set(r.answers.values()) == {new.generation}
        # The old generation's flows moved: the map knows them all for the new one now.
        assert [(g.number, g.state, g.sockets) for g in group.status()] == [
            (new.generation, SlotState.READY, UDP_SOCKETS)
        ]
        assert group.generation(new.generation).flows() == total
        counters = group.counters()
        assert counters["no_generation"] == counters["select_failed"] == 0
        print(f"drained by the old generation after retire: {drained}; counters {counters}")
    finally:
        group.close()


# -- TCP ------------------------------------------------------------------------------


def _answer(sock: socket.socket) -> int:
    """Read one answer line; the generation that sent it."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(256)
        if not chunk:
            raise ConnectionError("closed by the server")
        buf += chunk
    return int(buf.split(b"gen=")[1])


def _exchange(sock: socket.socket, line: bytes) -> int:
    """Send one request line on a connected socket; the generation that answered it."""
    sock.sendall(line + b"\n")
    return _answer(sock)


class Stream:
    """Workers that each open a connection, send a line, read the answer and close,
    again and again: (generation that answered, when) per connection, and any error."""

    def __init__(self, ns: str, port: int) -> None:
        self.ns, self.port = ns, port
        self.done: list[tuple[int, float]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, daemon=True) for _ in range(STREAM_WORKERS)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=20)

    def since(self, t0: float) -> int:
        return sum(1 for _, t in self.done if t >= t0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with netns_mod.enter(self.ns):
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                with s:
                    s.settimeout(15)
                    s.connect((HOST, self.port))
                    gen = _exchange(s, b"stream")
                self.done.append((gen, time.monotonic()))
            except OSError as e:
                self.errors.append(e)


def _connect(ns: str, port: int, n: int) -> list[socket.socket]:
    with netns_mod.enter(ns):
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    for s in socks:
        s.settimeout(15)
        s.connect((HOST, port))
    return socks


def test_tcp_generations_refuse_nothing_and_migrate_the_accept_queue(
    netns: str, group_name: str, servers: list[Server]
) -> None:
    with netns_mod.enter(netns):
        group = ReuseportGroup.open(group_name, "tcp")
    conns: list[socket.socket] = []  # every client connection, closed at the end
    stream: Stream | None = None
    talk_stop = threading.Event()
    talk_gens: set[int] = set()
    talk_errors: list[BaseException] = []
    talk_passes = 0

    def talk() -> None:
        """Keep the long-lived connections busy through the whole restart."""
        nonlocal talk_passes
        while not talk_stop.is_set():
            try:
                talk_gens.update(_exchange(s, b"long") for s in long_lived)
            except OSError as e:
                talk_errors.append(e)
                return
            talk_passes += 1

    talker = threading.Thread(target=talk, daemon=True)
    try:
        old = Server(netns, group_name, "tcp", 0, 1)
        servers.append(old)
        old.command("ready", "ready")
        with netns_mod.enter(netns):
            assert tcp_migrate_enabled()
        long_lived = _connect(netns, old.port, LONG_LIVED)
        conns += long_lived
        talker.start()
        stream = Stream(netns, old.port)
        stream.start()

        restart = time.monotonic()
        new = Server(netns, group_name, "tcp", old.port, 1)
        servers.append(new)
        wait_for(
            lambda: stream.since(restart),
            "connections before the new one is ready",
            until=lambda n: n >= STREAM_BEFORE,
            timeout=30,
        )
        assert {g for g, t in stream.done if t >= restart} == {old.generation}

        old.command("pause", "paused")
        queued = _connect(netns, old.port, QUEUED)  # the handshake completes: in its queue
        conns += queued
        for s in queued:
            s.sendall(b"queued\n")

        new.command("ready", "ready")
        after_ready = _connect(netns, old.port, AFTER_READY)
        conns += after_ready
        assert {_exchange(s, b"after-ready") for s in after_ready} == {new.generation}
        migrated_before = group.counters()["migrated"]

        old.command("retire", "retired")  # listener closed, nothing accepted
        retired = time.monotonic()
        assert {_answer(s) for s in queued} == {new.generation}
        wait_for(
            lambda: sum(1 for g, t in stream.done if t >= retired and g == new.generation),
            "connections answered by the new generation after the old one retired",
            until=lambda n: n >= STREAM_AFTER,
            timeout=30,
        )
        stream.stop()
        assert stream.errors == []
        during = [g for g, t in stream.done if t >= restart]
        assert len(during) + QUEUED + AFTER_READY >= 200

        counters = group.counters()
        # Every connection that waited in the old queue was moved by the program.
        assert counters["migrated"] - migrated_before >= QUEUED
        assert counters["migrate_failed"] == counters["select_failed"] == 0

        # The long-lived connections stayed with the old generation, which still runs,
        # and were answered all along.
        passes = talk_passes
        wait_for(lambda: talk_passes, "another pass", until=lambda n: n > passes + 1)
        talk_stop.set()
        talker.join(timeout=10)
        assert talk_errors == []
        assert talk_gens == {old.generation}
        assert old.proc.poll() is None
        for s in long_lived:
            s.close()
        old.expect("done")
        assert old.proc.wait(timeout=10) == 0
        print(
            f"stream: {len(stream.done)} connections, {len(during)} during the restart; "
            f"long-lived: {talk_passes} passes; {counters}"
        )
    finally:
        talk_stop.set()
        if stream is not None:
            stream.stop()
        for s in conns:
            s.close()
        group.close()


# -- selection rules, in one process ----------------------------------------------------


def _receiver(socks: list[socket.socket], gens: dict[int, int]) -> Callable[[], int]:
    """Read the one datagram just sent: the generation whose socket got it."""

    def which() -> int:
        sel = selectors.DefaultSelector()
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        try:
            ready = sel.select(ROUND_DEADLINE)
            assert len(ready) == 1, f"{len(ready)} sockets got the datagram"
            sock = ready[0][0].fileobj
            assert isinstance(sock, socket.socket)
            sock.recv(64)
            return gens[sock.fileno()]
        finally:
            sel.close()

    return which


def test_udp_flow_idle_and_not_ready_rules(netns: str, group_name: str) -> None:
    with netns_mod.enter(netns):
        group = ReuseportGroup.open(group_name, "udp")
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        first = ReuseportGroup.open(group_name, "udp").begin()  # another handle, same maps
        socks1 = [bind_reuseport("udp", HOST, 0)]
        port = socks1[0].getsockname()[1]
        socks2 = [bind_reuseport("udp", HOST, port) for _ in range(2)]
    all_socks = socks1 + socks2
    try:
        gens = {s.fileno(): first.number for s in socks1}
        for s in socks1:
            first.add(s)
        which = _receiver(all_socks, gens)

        # Not ready, but the only live generation: it gets the traffic, and the flow.
        client.sendto(b"a", (HOST, port))
        assert which() == first.number
        assert first.flows() == 1

        second = group.begin()
        gens.update({s.fileno(): second.number for s in socks2})
        for s in socks2:
            second.add(s)
        # Neither is ready: the oldest live one keeps new flows too.
        with netns_mod.enter(netns):
            other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with other:
            other.sendto(b"b", (HOST, port))
            assert which() == first.number

            second.ready()
            client.sendto(b"c", (HOST, port))
            assert which() == first.number  # known: stays
            other.sendto(b"d", (HOST, port))
            assert which() == first.number  # known: stays

        # Idle for flow_idle (made short now): the next datagram is a new flow, for the
        # ready generation.
        ReuseportGroup.open(group_name, "udp", flow_idle=0.05).close()
        wait_for(first.flows, "the first generation's flows idle", until=lambda n: n == 0)
        moved = group.counters()["flow_moved"]
        client.sendto(b"e", (HOST, port))
        assert which() == second.number
        assert group.counters()["flow_moved"] == moved + 1
        assert second.flows() == 1

        # A retired generation cannot be used again, by any handle.
        first.retire()
        with pytest.raises(ReuseportError, match="no live generation"):
            group.generation(first.number)
        with pytest.raises(ReuseportError, match="retired"):
            first.ready()
        assert [(g.number, g.state) for g in group.status()] == [(second.number, SlotState.READY)]
    finally:
        client.close()
        for s in all_socks:
            s.close()
        first.group.close()
        group.close()


def _send_from_cpu(cpu: int, socks: list[socket.socket], port: int) -> None:
    """Send one datagram from each of ``socks`` on ``cpu``: loopback receives on the
    sending CPU (no RPS on lo), so the program runs there."""

    def send() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        for s in socks:
            s.sendto(b"x", (HOST, port))

    t = threading.Thread(target=send)
    t.start()
    t.join(timeout=10)


def test_a_socket_preferred_on_a_cpu_gets_the_new_flows_arriving_there(
    netns: str, group_name: str
) -> None:
    with netns_mod.enter(netns):
        group = ReuseportGroup.open(group_name, "udp")
        socks = [bind_reuseport("udp", HOST, 0)]
        port = socks[0].getsockname()[1]
        socks += [bind_reuseport("udp", HOST, port) for _ in range(3)]
        clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2 * 20)]
    try:
        gen = group.begin()
        gen.add(socks[0])
        gen.add(socks[1])
        gen.add(socks[2], cpu=0)
        gen.add(socks[3], cpu=1)
        gen.ready()
        for s in socks:
            s.setblocking(False)

        def received() -> list[int]:
            counts = []
            for s in socks:
                n = 0
                with contextlib.suppress(BlockingIOError):
                    while s.recv(64):
                        n += 1
                counts.append(n)
            return counts

        _send_from_cpu(0, clients[:20], port)
        assert received() == [0, 0, 20, 0]
        _send_from_cpu(1, clients[20:], port)
        assert received() == [0, 0, 0, 20]
        # Known flows keep their socket whatever CPU they arrive on.
        _send_from_cpu(1, clients[:20], port)
        assert received() == [0, 0, 20, 0]
        # The preference is the generation's: a new one starts without it.
        gen.retire()
        assert group.begin().number == gen.number + 1
        with Map.from_pinned(group.pin_dir / "rp_cpu_pref") as prefs:
            assert {prefs.lookup(struct.pack("<I", k)) for k in range(8)} == {bytes(4)}
    finally:
        for s in [*socks, *clients]:
            s.close()
        group.close()


def test_the_pinned_maps_have_the_sizes_python_assumes(group_name: str) -> None:
    with ReuseportGroup.open(group_name, "udp") as group:
        sizes = {m: Map.from_pinned(group.pin_dir / m).max_entries for m in rp.MAP_NAMES}
    assert sizes == {
        "rp_socks": rp.SLOTS * rp.SOCKS_PER_SLOT,
        "rp_state": 1,
        "rp_flows": rp.FLOWS,
        "rp_cpu_pref": rp.MAX_CPUS * rp.SLOTS,
        "rp_events": len(rp.ReuseportEvent),
    }
