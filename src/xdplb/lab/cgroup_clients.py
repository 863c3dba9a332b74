"""Clients in a cgroup and the cgroup itself, for the tests of socket-level balancing
(tests/e2e/test_sock_lb.py, test_sock_lb_daemon.py): sock_lb rewrites only the sockets of
processes in its cgroup, so a client is a process that moves itself into the cgroup before
it opens a socket (a socket belongs to its creator's cgroup), while the test stays out.

``python -m xdplb.lab.cgroup_clients CGROUP MODE JSON`` (CGROUP "" for none) runs one
mode and prints one JSON line per phase:

- ``tcp`` ({addr, port, n}): n connections, each reading the backend's name to the end:
  {names, peers (getpeername), errors};
- ``udp`` ({addr, port, n}): n unconnected sockets, one datagram each: {names, sources
  (the reply's source), errors};
- ``bind`` ({addr, port, proto}): bind() to the address: {error};
- ``hold`` ({addr, port, connected, unconnected}): UDP sockets kept open: {connected:
  [[name, peer]], unconnected: [name]}; then, after a line on stdin, each asked again:
  {connected: [[pending SO_ERROR, answer or "error E..."]], unconnected: [[answer,
  source]]}.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import sys
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from xdplb.core import paths
from xdplb.lab.wait import wait_for


@contextlib.contextmanager
def child_cgroup(tag: str) -> Iterator[Path]:
    """A new child of the v2 hierarchy (wherever it is mounted), removed after the block
    (its processes, if a failure left any, killed first)."""
    path = paths.cgroup2_root() / f"xdplb-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        wait_for(
            lambda: (path / "cgroup.procs").read_text().split(),
            "cgroup empty",
            until=lambda p: not p,
        )
        path.rmdir()


def argv(cgroup: Path | None, mode: str, **params: Any) -> list[str]:
    """The command line of a client running ``mode`` in ``cgroup`` (None: none)."""
    return [
        sys.executable,
        "-m",
        "xdplb.lab.cgroup_clients",
        str(cgroup or ""),
        mode,
        json.dumps(params),
    ]


def _out(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def _errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, str(e.errno))


def _where(address: tuple[Any, ...]) -> str:
    return f"{address[0]} {address[1]}"


def _tcp(fam: socket.AddressFamily, svc: tuple[str, int], n: int) -> None:
    names: Counter[str] = Counter()
    peers: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for _ in range(n):
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(svc)
            peers[_where(s.getpeername())] += 1
            data = b""
            while chunk := s.recv(64):
                data += chunk
            names[data.decode()] += 1
        except OSError as e:
            errors[_errname(e)] += 1
        finally:
            s.close()
    _out({"names": names, "peers": peers, "errors": errors})


def _udp(fam: socket.AddressFamily, svc: tuple[str, int], n: int) -> None:
    names: Counter[str] = Counter()
    sources: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for i in range(n):
        s = socket.socket(fam, socket.SOCK_DGRAM)
        s.settimeout(5)
        try:
            s.sendto(b"%d" % i, svc)
            data, src = s.recvfrom(64)
            names[data.decode()] += 1
            sources[_where(src)] += 1
        except OSError as e:
            errors[_errname(e)] += 1
        finally:
            s.close()
    _out({"names": names, "sources": sources, "errors": errors})


def _bind(fam: socket.AddressFamily, svc: tuple[str, int], proto: str) -> None:
    s = socket.socket(fam, socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM)
    try:
        s.bind(svc)
        _out({"error": None})
    except OSError as e:
        _out({"error": _errname(e)})
    finally:
        s.close()


def _ask(s: socket.socket, msg: bytes, to: tuple[str, int] | None = None) -> tuple[str, str]:
    """One datagram out, its answer back: (the answer, where it came from)."""
    if to is None:
        s.send(msg)
    else:
        s.sendto(msg, to)
    data, src = s.recvfrom(64)
    return data.decode(), _where(src)


def _hold(fam: socket.AddressFamily, svc: tuple[str, int], connected: int, free: int) -> None:
    conn: list[tuple[socket.socket, str, str]] = []
    loose: list[socket.socket] = []
    names: list[str] = []
    for _ in range(connected):
        s = socket.socket(fam, socket.SOCK_DGRAM)
        s.settimeout(5)
        s.connect(svc)
        conn.append((s, _ask(s, b"hi")[0], _where(s.getpeername())))
    for _ in range(free):
        s = socket.socket(fam, socket.SOCK_DGRAM)
        s.settimeout(5)
        loose.append(s)
        names.append(_ask(s, b"hi", svc)[0])
    _out({"connected": [[n, peer] for _, n, peer in conn], "unconnected": names})
    sys.stdin.readline()
    after_conn: list[list[str | None]] = []
    after_free: list[list[str]] = []
    for s, _, _ in conn:
        pending = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        try:
            got = _ask(s, b"again")[0]
        except OSError as e:
            got = "error " + _errname(e)
        after_conn.append([errno.errorcode.get(pending, "") if pending else None, got])
    for s in loose:
        try:
            after_free.append(list(_ask(s, b"again", svc)))
        except OSError as e:
            after_free.append(["error " + _errname(e), ""])
    _out({"connected": after_conn, "unconnected": after_free})


def main(args: Sequence[str] | None = None) -> None:
    cg, mode, raw = args if args is not None else sys.argv[1:4]
    p: dict[str, Any] = json.loads(raw)
    if cg:
        with open(cg + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    fam = socket.AF_INET6 if ":" in p["addr"] else socket.AF_INET
    svc = (p["addr"], p["port"])
    if mode == "tcp":
        _tcp(fam, svc, p["n"])
    elif mode == "udp":
        _udp(fam, svc, p["n"])
    elif mode == "bind":
        _bind(fam, svc, p["proto"])
    elif mode == "hold":
        _hold(fam, svc, p["connected"], p["unconnected"])
    else:
        raise SystemExit(f"cgroup_clients: unknown mode {mode!r}")


if __name__ == "__main__":
    main()
