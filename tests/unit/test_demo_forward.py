"""`make demo KEEP=1` forwards the host's loopback to the daemon's unix socket: bytes go
both ways unchanged, and a connection ends when the daemon's side closes."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from xdplb.lab.demo import _Forward

pytestmark = pytest.mark.unit


def test_forward_to_a_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"got " + conn.recv(100))

    t = threading.Thread(target=answer)
    t.start()
    fwd = _Forward(0, path)
    threading.Thread(target=fwd.serve_forever, daemon=True).start()
    try:
        with socket.create_connection(fwd.server_address[:2], timeout=5) as c:
            c.sendall(b"GET / HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := c.recv(100):
                data += chunk
        assert data == b"got GET / HTTP/1.0\r\n\r\n"
        assert fwd.server_address[0] == "127.0.0.1"
    finally:
        fwd.shutdown()
        fwd.server_close()
        t.join(5)
        server.close()
