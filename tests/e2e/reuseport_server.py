"""A server generation for tests/e2e/test_reuseport_generations.py: a real process that
answers every datagram or request line with its generation number, driven by the test
through stdin so the test chooses each step of a restart.

Usage: ``reuseport_server.py GROUP udp|tcp HOST PORT SOCKETS``. It begins a generation,
binds and adds its sockets, prints ``added <generation> <port>``, then serves and obeys
one command per stdin line:

- ``ready``: the generation becomes ready (prints ``ready <generation>``);
- ``pause``: (TCP) stop accepting: new connections wait in the listener's accept queue;
- ``retire``: retire, then as a server must: UDP answers what is queued, then closes
  (prints ``retired <datagrams drained>`` and exits); TCP closes its listener without
  accepting (queued connections migrate), prints ``retired 0``, and goes on serving its
  connections until their clients close them.

A UDP reply is ``<datagram> gen=<n>``; a TCP reply to a line is ``<line> gen=<n>``.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
from typing import Any

from xdplb.sockets.reuseport import ReuseportGroup, bind_reuseport, drain_udp, enable_tcp_migrate


def main(group_name: str, proto: str, host: str, port: int, count: int) -> None:
    assert proto in ("tcp", "udp")
    group = ReuseportGroup.open(group_name, "tcp" if proto == "tcp" else "udp")
    if proto == "tcp":
        enable_tcp_migrate()
    gen = group.begin()
    socks: list[socket.socket] = []
    for _ in range(count):
        socks.append(bind_reuseport(group.proto, host, port))
        port = socks[-1].getsockname()[1]
        gen.add(socks[-1])
    tag = b" gen=%d" % gen.number

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    def answer(sock: socket.socket, data: bytes, peer: Any) -> None:
        sock.sendto(data + tag, peer)

    say(f"added {gen.number} {port}")
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, "stdin")
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, "listen" if proto == "tcp" else "udp")
    conns: dict[socket.socket, bytes] = {}
    stdin = b""
    retired = paused = False
    while not (retired and not conns):
        for key, _ in sel.select():
            what, sock = key.data, key.fileobj
            if what == "stdin":
                chunk = os.read(0, 4096)
                if not chunk:
                    return
                stdin += chunk
                while b"\n" in stdin:
                    cmd, stdin = stdin.split(b"\n", 1)
                    if cmd == b"ready":
                        gen.ready()
                        say(f"ready {gen.number}")
                    elif cmd == b"pause":
                        for s in socks:
                            sel.unregister(s)
                        paused = True
                        say("paused")
                    elif cmd == b"retire":
                        gen.retire()
                        drained = 0
                        if proto == "udp":
                            drained = drain_udp(socks, answer)
                        for s in socks:
                            if not paused:
                                sel.unregister(s)
                            s.close()
                        retired = True
                        say(f"retired {drained}")
                        break
                if retired:
                    break  # events of this batch may be of the sockets just closed
            elif what == "udp":
                assert isinstance(sock, socket.socket)
                try:
                    data, peer = sock.recvfrom(65535)
                except BlockingIOError:
                    continue
                answer(sock, data, peer)
            elif what == "listen":
                assert isinstance(sock, socket.socket)
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    continue
                conn.setblocking(False)
                conns[conn] = b""
                sel.register(conn, selectors.EVENT_READ, "conn")
            else:
                assert isinstance(sock, socket.socket)
                data = sock.recv(65536)
                if not data:
                    sel.unregister(sock)
                    sock.close()
                    del conns[sock]
                    continue
                buf = conns[sock] + data
                *lines, conns[sock] = buf.split(b"\n")
                sock.sendall(b"".join(line + tag + b"\n" for line in lines))
    say("done")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
