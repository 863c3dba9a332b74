"""Socket takeover: the running process hands its listening and UDP sockets to the process
that replaces it, over a unix socket (SCM_RIGHTS), as proxygen and Katran's hosts do
where no supervisor owns the sockets and BPF is not allowed.

The sockets themselves never close, so nothing is refused: TCP connections waiting in
the accept queue and datagrams in the receive queue stay there and are read by the new
process. The limit: the old and the new process read the *same* sockets, so a UDP flow
of the old process cannot be kept apart -- after the handover every datagram, of old
flows too, goes to the new process (a QUIC connection of the old one breaks). Keeping
old UDP flows with the old process needs :mod:`xdplb.sockets.reuseport`.

The exchange on a SOCK_SEQPACKET unix socket (one message each, boundaries kept):

1. the new process connects to ``path``;
2. the old one sends a JSON header (its pid, the names) with the fds (SCM_RIGHTS);
3. the new one answers ``TOOK``;
4. the old one stops using the sockets (``on_taken``), removes ``path`` and answers
   ``DONE``. Only then does :func:`take` return, so the two never read a socket at the
   same time, and the new process may offer at ``path`` in its turn.

A new process that fails before ``TOOK`` leaves the old one serving, as if nothing
happened.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from xdplb.core.errors import XdplbError

log = logging.getLogger(__name__)

#: The largest header (names and pid) accepted.
MAX_HEADER = 65536
#: The most sockets handed over at once (SCM_RIGHTS allows 253 per message).
MAX_FDS = 253
TOOK = b"TOOK"
DONE = b"DONE"


class TakeoverError(XdplbError):
    """The handover did not happen (the message names why)."""


class NothingOffered(TakeoverError):
    """No process offers sockets at this path: the caller binds its own."""


def _connect(path: Path, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise NothingOffered(f"no offer at {path}: {exc.strerror}") from None
    except BaseException:
        sock.close()
        raise
    return sock


class Offer:
    """The old process's side: serves one takeover at ``path`` from a thread.

    ``on_taken()`` runs once the new process holds the sockets and must return only when
    this process no longer reads them (its loops stopped); the sockets are not closed
    here, the caller closes its copies when it likes (they stay open in the new process).
    """

    def __init__(
        self,
        path: Path,
        socks: Mapping[str, socket.socket],
        on_taken: Callable[[], None],
    ) -> None:
        if len(socks) > MAX_FDS:
            raise TakeoverError(f"{len(socks)} sockets: at most {MAX_FDS} go in one message")
        self.path = path
        self._socks = dict(socks)
        self._on_taken = on_taken
        self._taken = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._claim_path()
            self._listener.bind(str(path))
            self._listener.listen(4)
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="takeover", daemon=True)
        self._thread.start()

    def _claim_path(self) -> None:
        """Remove a stale socket file (its process gone); refuse a live offer's."""
        if not self.path.exists():
            return
        try:
            _connect(self.path, 1.0).close()
        except NothingOffered:
            self.path.unlink(missing_ok=True)
            return
        raise TakeoverError(f"another process already offers its sockets at {self.path}")

    @property
    def taken(self) -> bool:
        """True once a new process took the sockets and this one stopped using them."""
        return self._taken.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the sockets are taken; False on timeout."""
        return self._taken.wait(timeout)

    def _serve(self) -> None:
        names = list(self._socks)
        header = json.dumps({"pid": os.getpid(), "names": names}).encode()
        fds = [s.fileno() for s in self._socks.values()]
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # close() shut the listener
            with conn:
                conn.settimeout(10.0)
                try:
                    socket.send_fds(conn, [header], fds)
                    if conn.recv(16) != TOOK:
                        log.warning("takeover at %s: the new process gave up", self.path)
                        continue
                except OSError as exc:
                    log.warning("takeover at %s failed, still serving: %s", self.path, exc)
                    continue
                self._on_taken()
                self.path.unlink(missing_ok=True)
                self._listener.close()
                self._taken.set()
                with contextlib.suppress(OSError):
                    conn.send(DONE)
                log.info("takeover at %s: %d sockets handed over", self.path, len(fds))
                return

    def close(self) -> None:
        """Stop offering (no handover happened, or it is over)."""
        if not self._taken.is_set():
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._thread.join()
            self.path.unlink(missing_ok=True)


def offer(
    path: str | Path, socks: Mapping[str, socket.socket], on_taken: Callable[[], None]
) -> Offer:
    """Offer ``socks`` (by name) at the unix socket ``path`` to the next process."""
    return Offer(Path(path), socks, on_taken)


def take(path: str | Path, *, timeout: float = 30.0) -> dict[str, socket.socket]:
    """Take the sockets offered at ``path``, by name; return once the old process has
    stopped using them. NothingOffered when no process offers there."""
    path = Path(path)
    with _connect(path, timeout) as conn:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_HEADER, MAX_FDS)
        except TimeoutError:
            raise TakeoverError(f"takeover at {path}: no sockets after {timeout:g} s") from None
        try:
            header = json.loads(msg)
            names = [str(n) for n in header["names"]]
            if len(names) != len(fds):
                raise TakeoverError(f"takeover at {path}: {len(names)} names, {len(fds)} fds")
            socks = {n: socket.socket(fileno=fd) for n, fd in zip(names, fds, strict=True)}
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        try:
            conn.send(TOOK)
            # An old process that dies now has stopped reading too: EOF is as good as DONE.
            answer = conn.recv(16)
        except BaseException:
            for s in socks.values():
                s.close()
            raise
    if answer != DONE:
        log.warning("takeover at %s: old process %s ended without DONE", path, header["pid"])
    log.info("took %d sockets from pid %s at %s", len(socks), header["pid"], path)
    return socks
