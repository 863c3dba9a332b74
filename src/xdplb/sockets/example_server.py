"""A minimal server for ``xdplb serve`` and socket takeover: it knows nothing of BPF.

``python -m xdplb.sockets.example_server [--tcp HOST:PORT] [--udp HOST:PORT] ...``

Its sockets come, in this order, from systemd-style socket passing (``LISTEN_FDS``
with ``LISTEN_PID`` equal to its pid, fds from 3, named by ``LISTEN_FDNAMES``), from
the process it replaces (``--takeover PATH``), or from its own bind of ``--tcp`` and
``--udp``. It answers each TCP line with the line and its generation and pid
(``<line> gen=<g> pid=<p>``), and each UDP datagram with the datagram and the same
(one thread per UDP socket, :class:`~xdplb.sockets.udp.UdpWorkers`). It says
``READY=1`` on ``NOTIFY_SOCKET`` once it serves. On SIGTERM (or once its sockets were
taken over) it stops accepting and reading, finishes the TCP connections it has (at
most ``--drain`` seconds) and exits 0.

The generation is ``--generation``, else ``XDPLB_SERVE_GENERATION`` (set by ``xdplb
serve``), else ``-``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from xdplb.sockets import takeover
from xdplb.sockets.udp import UdpWorkers, family_of, udp_group

log = logging.getLogger("example_server")

#: The first passed fd (systemd's SD_LISTEN_FDS_START).
LISTEN_FDS_START = 3
GENERATION_ENV = "XDPLB_SERVE_GENERATION"


def listen_fds() -> list[tuple[str, socket.socket]]:
    """The sockets passed systemd-style, with their names (``unknown`` when unnamed);
    empty when none were passed to this process. The variables are removed so that a
    child of this process does not take them for its own."""
    pid = os.environ.pop("LISTEN_PID", "")
    count = os.environ.pop("LISTEN_FDS", "")
    names = os.environ.pop("LISTEN_FDNAMES", "")
    if not count or pid != str(os.getpid()):
        return []
    n = int(count)
    labels = names.split(":") if names else []
    labels += ["unknown"] * (n - len(labels))
    out = []
    for i in range(n):
        fd = LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        out.append((labels[i], socket.socket(fileno=fd)))
    return out


def sd_notify(state: str) -> bool:
    """Send ``state`` ("READY=1") to the supervisor's NOTIFY_SOCKET; False without one."""
    where = os.environ.get("NOTIFY_SOCKET")
    if not where:
        return False
    addr = "\0" + where[1:] if where.startswith("@") else where
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(state.encode(), addr)
    return True


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket of this process's own (SO_REUSEADDR, backlog 1024)."""
    s = socket.socket(family_of(host), socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1024)
    except BaseException:
        s.close()
        raise
    return s


class _Conn:
    """A TCP connection's unanswered bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = b""
        self.outbuf = b""


class TcpServer:
    """One thread with a selector for every listener and connection: line in, line out.

    :meth:`stop_accepting` leaves the listeners alone (another generation, or the
    supervisor, holds them too) and only stops this process taking connections from them.
    """

    def __init__(self, listeners: Sequence[socket.socket], tag: bytes) -> None:
        self._listeners = list(listeners)
        self._tag = tag
        self._sel = selectors.DefaultSelector()
        self._conns: dict[int, _Conn] = {}
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._accepting = True
        self._done = False
        self._thread = threading.Thread(target=self._run, name="tcp", daemon=True)
        for s in self._listeners:
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)

    def start(self) -> None:
        self._thread.start()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def stop_accepting(self) -> None:
        """Take no new connection; the thread answers the open ones until :meth:`close`."""
        with self._lock:
            self._accepting = False
        os.write(self._wake_w, b"a")

    def close(self) -> None:
        """End the thread and close every connection still open."""
        with self._lock:
            self._done = True
        os.write(self._wake_w, b"c")
        if self._thread.ident is not None:
            self._thread.join()
        for c in self._conns.values():
            c.sock.close()
        self._sel.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        while True:
            for key, events in self._sel.select():
                obj = key.fileobj
                if obj == self._wake_r:
                    os.read(self._wake_r, 64)
                    with self._lock:
                        if self._done:
                            return
                        if not self._accepting:
                            for s in self._listeners:
                                with contextlib.suppress(KeyError):
                                    self._sel.unregister(s)
                elif key.data is None:
                    self._accept(obj)  # type: ignore[arg-type]
                else:
                    self._serve(key.data, events)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ECONNABORTED and the like: the next one may be fine
                log.warning("accept: %s", exc)
                return
            sock.setblocking(False)
            conn = _Conn(sock)
            with self._lock:
                self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _serve(self, conn: _Conn, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = conn.sock.recv(65536)
                if not data:
                    self._drop(conn)
                    return
                conn.inbuf += data
                *lines, conn.inbuf = conn.inbuf.split(b"\n")
                for line in lines:
                    conn.outbuf += line + self._tag + b"\n"
            if conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[sent:]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self._sel.modify(conn.sock, want, conn)

    def _drop(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        with self._lock:
            del self._conns[conn.sock.fileno()]
        conn.sock.close()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xdplb.sockets.example_server")
    p.add_argument("--tcp", help="HOST:PORT to bind when no socket is passed or taken")
    p.add_argument("--udp", help="HOST:PORT to bind when no socket is passed or taken")
    p.add_argument("--udp-sockets", type=int, default=1, help="UDP sockets of its own bind")
    p.add_argument("--takeover", type=Path, help="take the sockets offered here, then offer")
    p.add_argument("--generation", default=os.environ.get(GENERATION_ENV, "-"))
    p.add_argument("--drain", type=float, default=30.0, help="seconds to finish connections")
    return p.parse_args(argv)


def _own_sockets(args: argparse.Namespace) -> list[tuple[str, socket.socket]]:
    out: list[tuple[str, socket.socket]] = []
    if args.tcp:
        out.append(("tcp", bind_tcp(*_host_port(args.tcp))))
    if args.udp:
        out += [("udp", s) for s in udp_group(*_host_port(args.udp), args.udp_sockets)]
    return out


def _sockets(args: argparse.Namespace) -> list[tuple[str, socket.socket]]:
    """Passed, else taken over, else bound here."""
    if passed := listen_fds():
        log.info("%d sockets passed (LISTEN_FDS)", len(passed))
        return passed
    if args.takeover is not None:
        try:
            taken = takeover.take(args.takeover)
        except takeover.NothingOffered:
            log.info("nothing offered at %s: binding my own", args.takeover)
        else:
            # Names are unique in a takeover message: "udp.0", "udp.1" ... keep the kind.
            return [(name.split(".")[0], s) for name, s in taken.items()]
    return _own_sockets(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    pid = os.getpid()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s example_server gen={args.generation} pid={pid} %(message)s",
        stream=sys.stderr,
    )
    tag = f" gen={args.generation} pid={pid}".encode()
    socks = _sockets(args)
    tcp = [s for _, s in socks if s.type == socket.SOCK_STREAM]
    udp = [s for _, s in socks if s.type == socket.SOCK_DGRAM]
    if not socks:
        log.error("no sockets: pass some (LISTEN_FDS), --takeover, --tcp or --udp")
        return 2

    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    server = TcpServer(tcp, tag)
    workers = UdpWorkers(udp, lambda data, peer, i: data + tag)
    server.start()
    workers.start()

    def _stop_serving() -> None:
        server.stop_accepting()
        workers.stop()

    offer = None
    if args.takeover is not None:
        names = {}
        for i, (kind, s) in enumerate(socks):
            names[f"{kind}.{i}"] = s
        offer = takeover.offer(args.takeover, names, on_taken=_stop_serving)
    sd_notify("READY=1")
    log.info("serving: %d TCP listeners, %d UDP sockets", len(tcp), len(udp))

    while not stop.is_set() and not (offer is not None and offer.taken):
        stop.wait(0.1)
    why = "taken over" if offer is not None and offer.taken else "SIGTERM"
    log.info("%s: draining %d connections", why, server.connections)
    with contextlib.suppress(OSError):
        sd_notify("STOPPING=1")
    _stop_serving()
    if offer is not None:
        offer.close()
    deadline = time.monotonic() + args.drain
    while server.connections and time.monotonic() < deadline:
        time.sleep(0.05)
    left = server.connections
    server.close()
    for _, s in socks:
        s.close()
    log.info("exiting (%d connections cut at the drain deadline)", left)
    return 0


if __name__ == "__main__":
    sys.exit(main())
