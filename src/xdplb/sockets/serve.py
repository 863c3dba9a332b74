"""``xdplb serve``: a supervisor that owns a service's sockets and replaces generations of
an unmodified server without losing a datagram or a connection.

The server gets its sockets systemd-style (``LISTEN_FDS``, ``LISTEN_PID`` set to its
own pid between fork and exec, ``LISTEN_FDNAMES``: ``tcp`` and ``udp``; fds from 3) and
says it serves by sending ``READY=1`` to ``NOTIFY_SOCKET`` (one datagram socket per
generation, so a message cannot be taken for another generation's). A server that does
not notify is taken as ready after ``ready_timeout``.

A reload (SIGHUP, ``xdplb serve --name NAME --reload``) with BPF:

1. new sockets on the same addresses (SO_REUSEPORT), put in a new generation of the
   service's :class:`~xdplb.sockets.reuseport.ReuseportGroup`; the next child started
   with them. Until it is ready the old generation takes everything.
2. READY=1: the new generation is made ready: new TCP connections and new UDP flows go
   to it; the UDP flows the old one knows stay with it for at most ``drain`` seconds
   (less once it knows none).
3. The old generation is retired (its flows go to the new one); the supervisor waits
   until the receive queues of its own copies of the old UDP sockets (FIONREAD) have
   stayed empty for ``grace`` seconds, so that every datagram the old child was given is
   answered; then SIGTERM.
4. Once the old child has exited (SIGKILL after ``stop_timeout``), the supervisor closes
   the last copies of the old sockets. TCP requests still queued in the old listener
   are migrated by the kernel to the new one (``net.ipv4.tcp_migrate_req=1``, enabled
   here, and the group's migrate program), not reset.

Without BPF (``bpf=False``) every generation gets the same sockets: the old child is
stopped as soon as the new one is ready and the new one reads what is queued. TCP loses
nothing (the listener lives on), but UDP flows of the old child are not kept apart: its
flows' next datagrams go to the new child.

A child that exits unexpectedly is started again with the same sockets, at most
``max_restarts`` times in ``restart_window`` seconds; then the supervisor gives up.
SIGTERM or SIGINT stops every child, closes the sockets and unpins the groups.

The supervisor writes ``<run dir>/serve-<name>.pid`` and ``serve-<name>.json`` (its
generations, see :func:`read_status`), and logs each step.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import fcntl
import json
import logging
import os
import selectors
import signal
import socket
import struct
import termios
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from xdplb.core import paths
from xdplb.core.errors import XdplbError
from xdplb.sockets.reuseport import (
    Generation,
    ReuseportGroup,
    bind_reuseport,
    enable_tcp_migrate,
)
from xdplb.sockets.udp import family_of, udp_group

log = logging.getLogger("xdplb.serve")

Proto = Literal["tcp", "udp"]

#: The first passed fd (systemd's SD_LISTEN_FDS_START).
LISTEN_FDS_START = 3
#: The generation number, for servers that want to show it (the example server does).
GENERATION_ENV = "XDPLB_SERVE_GENERATION"
#: How often timers (queues, deadlines) are looked at while something waits on them.
TICK_S = 0.02
PR_SET_PDEATHSIG = 1


class ServeError(XdplbError):
    """The supervisor cannot start or go on (the message says why)."""


class NotServing(ServeError):
    """No supervisor of that name is running."""


@dataclass(frozen=True)
class Endpoint:
    """An address the service listens on."""

    proto: Proto
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.proto} {host}:{self.port}"


def parse_endpoint(proto: Proto, text: str) -> Endpoint:
    """``HOST:PORT`` (``[v6]:PORT``) as an Endpoint; ValueError naming the text."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return Endpoint(proto, host, int(port))


@dataclass(frozen=True)
class ServeConfig:
    """What ``xdplb serve`` runs."""

    name: str
    """The service: names its pins (``rp-<name>-tcp``, ``rp-<name>-udp``) and run files."""
    command: tuple[str, ...]
    """The server and its arguments."""
    tcp: Endpoint | None = None
    """The TCP listener, if any."""
    udp: Endpoint | None = None
    """The UDP address, if any."""
    udp_sockets: int = 4
    """UDP sockets per generation (one per worker of the server)."""
    ready_timeout: float = 10.0
    """Seconds to wait for READY=1 before taking a live child as ready anyway."""
    drain: float = 5.0
    """Seconds the old generation keeps its known UDP flows once the new one is ready."""
    grace: float = 0.2
    """Seconds the old UDP queues must stay empty before SIGTERM (answers in flight,
    datagrams steered while the generation was retired)."""
    stop_timeout: float = 30.0
    """Seconds a child has to exit after SIGTERM before SIGKILL."""
    bpf: bool = True
    """Keep generations apart with the sk_reuseport program; False passes the same
    sockets to every generation."""
    max_restarts: int = 5
    """Restarts of a dying child allowed within ``restart_window``."""
    restart_window: float = 60.0


class State(enum.StrEnum):
    """Where a generation is in its life."""

    STARTING = "starting"  # child started, not ready: the previous one takes everything
    READY = "ready"  # takes new connections and flows
    DRAINING = "draining"  # keeps its UDP flows until the drain deadline
    RETIRED = "retired"  # takes nothing; its queued datagrams are being answered
    STOPPING = "stopping"  # SIGTERM sent
    GONE = "gone"


@dataclass
class _Gen:
    number: int
    socks: list[tuple[str, socket.socket]]
    notify: socket.socket
    notify_path: Path
    bpf: dict[str, Generation] = field(default_factory=dict)  # by protocol
    pid: int | None = None
    state: State = State.STARTING
    deadline: float = 0.0
    restarts: list[float] = field(default_factory=list)
    exit_status: str = ""

    def udp(self) -> list[socket.socket]:
        return [s for n, s in self.socks if n == "udp"]


def pid_path(name: str) -> Path:
    return paths.under(paths.run_dir(), f"serve-{paths.instance_name(name)}.pid")


def status_path(name: str) -> Path:
    return paths.under(paths.run_dir(), f"serve-{paths.instance_name(name)}.json")


def read_status(name: str) -> dict[str, Any]:
    """The supervisor's last written status: ``{"name", "pid", "bpf", "generations":
    [{"number", "state", "pid", "sockets"}], "restarts"}``; NotServing without one."""
    try:
        data: dict[str, Any] = json.loads(status_path(name).read_text())
    except FileNotFoundError:
        raise NotServing(f"no supervisor named {name!r} ({status_path(name)})") from None
    return data


def supervisor_pid(name: str) -> int:
    """The pid of the running supervisor ``name``; NotServing when it is not running."""
    try:
        pid = int(pid_path(name).read_text())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        raise NotServing(f"no supervisor named {name!r} is running") from None
    return pid


def reload(name: str, *, timeout: float | None = 60.0) -> int:
    """Ask supervisor ``name`` for a new generation (SIGHUP); with a ``timeout``, wait
    until it is ready and the older ones are gone, and return its number (ServeError if
    it failed or took longer)."""
    pid = supervisor_pid(name)
    before = max((g["number"] for g in read_status(name)["generations"]), default=0)
    os.kill(pid, signal.SIGHUP)
    if timeout is None:
        return before + 1
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = read_status(name)
        gens = st["generations"]
        if st.get("failed", 0) > before:
            raise ServeError(f"generation {st['failed']} of {name!r} failed to start")
        newer = [g for g in gens if g["number"] > before and g["state"] == State.READY]
        if newer and all(g["number"] >= newer[0]["number"] for g in gens):
            return int(newer[0]["number"])
        time.sleep(TICK_S)
    raise ServeError(f"{name!r}: no new ready generation after {timeout:g} s")


def queued_bytes(sock: socket.socket) -> int:
    """FIONREAD: bytes of the next datagram waiting in a UDP socket (0: empty)."""
    buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
    return int(struct.unpack("i", buf)[0])


def _plain_tcp(ep: Endpoint) -> socket.socket:
    s = socket.socket(family_of(ep.host), socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((ep.host, ep.port))
        s.listen(1024)
    except BaseException:
        s.close()
        raise
    return s


class Supervisor:
    """Runs one service (:meth:`run`): its sockets, its generations, its signals."""

    def __init__(self, cfg: ServeConfig) -> None:
        if cfg.tcp is None and cfg.udp is None:
            raise ServeError("nothing to serve: give a TCP or a UDP address")
        if not cfg.command:
            raise ServeError("no server command")
        paths.instance_name(cfg.name)
        self.cfg = cfg
        self._tcp, self._udp = cfg.tcp, cfg.udp
        self._groups: dict[str, ReuseportGroup] = {}
        self._shared: list[tuple[str, socket.socket]] = []  # bpf=False: every generation's
        self._gens: list[_Gen] = []
        self._next = 1
        self._failed = 0
        self._sel = selectors.DefaultSelector()
        self._sig_r, self._sig_w = os.pipe()
        self._stopping = False
        self._reload_wanted = False
        self._exit_code = 0

    # -- sockets ---------------------------------------------------------------------

    def _open_groups(self) -> None:
        for ep in (self._tcp, self._udp):
            if ep is not None:
                self._groups[ep.proto] = ReuseportGroup.open(
                    f"{self.cfg.name}-{ep.proto}", ep.proto
                )
        if self._tcp is not None:
            # Requests queued in a closing listener go to another one of its group.
            enable_tcp_migrate()

    def _fix_port(self, ep: Endpoint, sock: socket.socket) -> Endpoint:
        """Port 0 is resolved by the first bind; later generations bind the same port."""
        return Endpoint(ep.proto, ep.host, sock.getsockname()[1])

    def _new_sockets(self, gen: _Gen) -> None:
        if not self.cfg.bpf:
            if not self._shared:
                if self._tcp is not None:
                    self._shared.append(("tcp", _plain_tcp(self._tcp)))
                    self._tcp = self._fix_port(self._tcp, self._shared[-1][1])
                if self._udp is not None:
                    group = udp_group(self._udp.host, self._udp.port, self.cfg.udp_sockets)
                    self._shared += [("udp", s) for s in group]
                    self._udp = self._fix_port(self._udp, group[0])
            gen.socks = list(self._shared)
            return
        for ep, count in ((self._tcp, 1), (self._udp, self.cfg.udp_sockets)):
            if ep is None:
                continue
            rgen = self._groups[ep.proto].begin()
            gen.bpf[ep.proto] = rgen
            for _ in range(count):
                sock = bind_reuseport(ep.proto, ep.host, ep.port)
                gen.socks.append((ep.proto, sock))
                rgen.add(sock)
                ep = self._fix_port(ep, sock)
            if ep.proto == "tcp":
                self._tcp = ep
            else:
                self._udp = ep

    def _close_sockets(self, gen: _Gen) -> None:
        if self.cfg.bpf:
            for _, s in gen.socks:
                s.close()

    # -- children --------------------------------------------------------------------

    def _spawn(self, gen: _Gen) -> None:
        fds = [s.fileno() for _, s in gen.socks]
        env = dict(os.environ)
        env.pop("LISTEN_PID", None)
        env.update(
            LISTEN_FDS=str(len(fds)),
            LISTEN_FDNAMES=":".join(n for n, _ in gen.socks),
            NOTIFY_SOCKET=str(gen.notify_path),
        )
        env[GENERATION_ENV] = str(gen.number)
        argv = list(self.cfg.command)
        pid = os.fork()
        if pid == 0:  # the child: nothing here may return into the supervisor's code
            try:
                signal.set_wakeup_fd(-1)  # the supervisor's pipe is not the child's
                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # dies with the supervisor
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                # Python ignores SIGPIPE, and an ignored signal stays ignored across exec.
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                # Move every fd above the target range first: a source fd may be a target.
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(fds)) for fd in fds]
                for i, fd in enumerate(high):
                    os.dup2(fd, LISTEN_FDS_START + i, inheritable=True)
                env["LISTEN_PID"] = str(os.getpid())
                os.execvpe(argv[0], argv, env)
            except BaseException as exc:
                with contextlib.suppress(BaseException):
                    os.write(2, f"xdplb serve: cannot start {argv[0]}: {exc}\n".encode())
            finally:
                os._exit(127)
        gen.pid = pid
        log.info("generation %d: started pid %d: %s", gen.number, pid, " ".join(argv))

    def _start_generation(self) -> _Gen | None:
        number = self._next
        self._next += 1
        notify_path = paths.under(paths.run_dir(), f"serve-{self.cfg.name}.{number}.notify")
        notify_path.unlink(missing_ok=True)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        gen = _Gen(number, [], notify, notify_path)
        try:
            self._new_sockets(gen)
            self._spawn(gen)
        except Exception as exc:
            log.error("generation %d: cannot start: %s", number, exc)
            self._failed = number
            self._abandon(gen)
            return None
        gen.deadline = time.monotonic() + self.cfg.ready_timeout
        self._sel.register(notify, selectors.EVENT_READ, gen)
        self._gens.append(gen)
        self._write_status()
        return gen

    def _abandon(self, gen: _Gen) -> None:
        """A generation that never became ready: its sockets out of the group, closed."""
        for rgen in gen.bpf.values():
            with contextlib.suppress(XdplbError, OSError):
                rgen.retire()
        self._close_sockets(gen)
        self._drop_notify(gen)
        gen.state = State.GONE

    def _drop_notify(self, gen: _Gen) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(gen.notify)
        gen.notify.close()
        gen.notify_path.unlink(missing_ok=True)

    def _make_ready(self, gen: _Gen, why: str) -> None:
        for rgen in gen.bpf.values():
            rgen.ready()
        gen.state = State.READY
        log.info("generation %d: ready (%s)", gen.number, why)
        now = time.monotonic()
        for old in self._gens:
            if old is not gen and old.state == State.READY:
                old.state = State.DRAINING
                old.deadline = now + (self.cfg.drain if self.cfg.bpf else 0.0)
                log.info("generation %d: draining (at most %g s)", old.number, self.cfg.drain)
        self._write_status()

    def _retire(self, gen: _Gen) -> None:
        for rgen in gen.bpf.values():
            rgen.retire()
        gen.state = State.RETIRED
        gen.deadline = 0.0
        log.info("generation %d: retired; answering what is queued", gen.number)
        self._write_status()

    def _terminate(self, gen: _Gen) -> None:
        if gen.pid is None:  # no child to wait for
            self._finish(gen)
            return
        gen.state = State.STOPPING
        gen.deadline = time.monotonic() + self.cfg.stop_timeout
        with contextlib.suppress(ProcessLookupError):
            os.kill(gen.pid, signal.SIGTERM)
        log.info("generation %d: SIGTERM to pid %d", gen.number, gen.pid)
        self._write_status()

    def _flows_left(self, gen: _Gen) -> int:
        rgen = gen.bpf.get("udp")
        return int(rgen.flows()) if rgen is not None else 0

    # -- events ----------------------------------------------------------------------

    def _on_notify(self, gen: _Gen) -> None:
        try:
            data = gen.notify.recv(4096)
        except OSError:
            return
        fields = dict(
            line.split("=", 1) for line in data.decode(errors="replace").splitlines() if "=" in line
        )
        if fields.get("READY") == "1" and gen.state == State.STARTING:
            self._make_ready(gen, "READY=1")

    def _on_exit(self, pid: int, status: int) -> None:
        gen = next((g for g in self._gens if g.pid == pid), None)
        if gen is None:
            return
        gen.pid = None
        how = (
            f"exit {os.waitstatus_to_exitcode(status)}"
            if os.WIFEXITED(status)
            else f"signal {os.WTERMSIG(status)}"
        )
        gen.exit_status = how
        if gen.state == State.STOPPING or self._stopping:
            log.info("generation %d: child %d ended (%s)", gen.number, pid, how)
            self._finish(gen)
        elif gen.state == State.READY and not self._stopping:
            now = time.monotonic()
            gen.restarts = [t for t in gen.restarts if now - t < self.cfg.restart_window]
            if len(gen.restarts) >= self.cfg.max_restarts:
                log.error(
                    "generation %d: child %d ended (%s), %d restarts in %g s: giving up",
                    gen.number, pid, how, len(gen.restarts), self.cfg.restart_window,
                )  # fmt: skip
                self._exit_code = 1
                self._begin_stop()
                return
            gen.restarts.append(now)
            log.warning("generation %d: child %d ended (%s): restarting", gen.number, pid, how)
            self._spawn(gen)
        elif gen.state == State.STARTING:
            log.error("generation %d: child %d ended (%s) before ready", gen.number, pid, how)
            self._failed = gen.number
            self._abandon(gen)
            self._gens.remove(gen)
            if not self._gens:
                self._exit_code = 1
                self._begin_stop()
        else:  # draining or retired: it is going anyway
            log.info("generation %d: child %d ended early (%s)", gen.number, pid, how)
            if gen.state == State.DRAINING:
                self._retire(gen)
            self._finish(gen)
        self._write_status()

    def _finish(self, gen: _Gen) -> None:
        """The child is gone: the last copies of its own sockets close (TCP requests
        still queued in its listener migrate to the ready generation)."""
        self._close_sockets(gen)
        self._drop_notify(gen)
        gen.state = State.GONE
        self._gens.remove(gen)
        log.info("generation %d: gone", gen.number)

    def _tick(self) -> None:
        now = time.monotonic()
        for gen in list(self._gens):
            if gen.state == State.STARTING and now >= gen.deadline:
                self._make_ready(gen, f"no READY=1 after {self.cfg.ready_timeout:g} s")
            elif gen.state == State.DRAINING and (
                now >= gen.deadline or self._flows_left(gen) == 0
            ):
                self._retire(gen)
            elif gen.state == State.RETIRED:
                if self.cfg.bpf and any(queued_bytes(s) for s in gen.udp()):
                    # A datagram steered while retire() ran may land late: the grace
                    # counts from the last time a queue was seen empty after one.
                    gen.deadline = 0.0
                    continue
                if gen.deadline == 0.0:
                    gen.deadline = now + self.cfg.grace
                elif now >= gen.deadline:
                    self._terminate(gen)
            elif gen.state == State.STOPPING and now >= gen.deadline and gen.pid is not None:
                log.warning("generation %d: SIGKILL to pid %d", gen.number, gen.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(gen.pid, signal.SIGKILL)
                gen.deadline = now + self.cfg.stop_timeout

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._on_exit(pid, status)

    def _on_signals(self) -> None:
        try:
            data = os.read(self._sig_r, 256)
        except BlockingIOError:
            return
        for signum in data:
            if signum == signal.SIGCHLD:
                self._reap()
            elif signum == signal.SIGHUP:
                self._reload_wanted = True
            elif signum in (signal.SIGTERM, signal.SIGINT) and not self._stopping:
                log.info("%s: stopping", signal.Signals(signum).name)
                self._begin_stop()

    def _reload(self) -> None:
        self._reload_wanted = False
        if any(g.state == State.STARTING for g in self._gens):
            log.warning("reload: a generation is still starting; reload again once it is ready")
            return
        log.info("reload: starting generation %d", self._next)
        self._start_generation()

    def _begin_stop(self) -> None:
        self._stopping = True
        for gen in list(self._gens):
            if gen.state != State.STOPPING:
                self._terminate(gen)

    # -- run -------------------------------------------------------------------------

    def _write_status(self) -> None:
        data = {
            "name": self.cfg.name,
            "pid": os.getpid(),
            "bpf": self.cfg.bpf,
            "failed": self._failed,
            "generations": [
                {
                    "number": g.number,
                    "state": str(g.state),
                    "pid": g.pid,
                    "sockets": [f"{n} {s.getsockname()}" for n, s in g.socks if s.fileno() >= 0],
                    "flows": self._flows_left(g) if g.state != State.GONE else 0,
                    "restarts": len(g.restarts),
                }
                for g in self._gens
            ],
        }
        path = status_path(self.cfg.name)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        os.set_blocking(self._sig_w, False)
        os.set_blocking(self._sig_r, False)
        wanted = (signal.SIGCHLD, signal.SIGHUP, signal.SIGTERM, signal.SIGINT)
        old = {s: signal.signal(s, lambda signum, frame: None) for s in wanted}
        old_fd = signal.set_wakeup_fd(self._sig_w)
        try:
            yield
        finally:
            signal.set_wakeup_fd(old_fd)
            for s, h in old.items():
                signal.signal(s, h)

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT (or a child that keeps dying); the exit code."""
        run_dir = paths.run_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        pid_file = pid_path(self.cfg.name)
        try:
            supervisor_pid(self.cfg.name)
        except NotServing:
            pass
        else:
            raise ServeError(f"a supervisor named {self.cfg.name!r} is already running")
        pid_file.write_text(f"{os.getpid()}\n")
        self._sel.register(self._sig_r, selectors.EVENT_READ, None)
        try:
            with self._signals():
                if self.cfg.bpf:
                    self._open_groups()
                if self._start_generation() is None:
                    return 1
                self._loop()
        finally:
            for gen in list(self._gens):
                if gen.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(gen.pid, signal.SIGKILL)
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(gen.pid, 0)
                self._close_sockets(gen)
                self._drop_notify(gen)
            for _, s in self._shared:
                s.close()
            for group in self._groups.values():
                with contextlib.suppress(XdplbError, OSError):
                    group.destroy()
            self._sel.close()
            os.close(self._sig_r)
            os.close(self._sig_w)
            status_path(self.cfg.name).unlink(missing_ok=True)
            pid_file.unlink(missing_ok=True)
        log.info("stopped")
        return self._exit_code

    def _busy(self) -> bool:
        """Something waits on a timer (readiness, drain, queues, a kill)."""
        return any(g.state != State.READY for g in self._gens)

    def _loop(self) -> None:
        while self._gens or not self._stopping:
            timeout = TICK_S if self._busy() else None
            for key, _ in self._sel.select(timeout):
                if key.data is None:
                    self._on_signals()
                else:
                    self._on_notify(key.data)
            if self._reload_wanted and not self._stopping:
                self._reload()
            self._tick()
            self._reap()  # a SIGCHLD that came while its byte was being read


def serve(cfg: ServeConfig) -> int:
    """Run the supervisor for ``cfg`` in this process; its exit code."""
    return Supervisor(cfg).run()
