"""The lab's client exchanges: a server that dies mid-reply is a failed exchange,
never an exception of another kind that would end a traffic thread."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from xdplb.lab import traffic


def _serve_once(reply: bytes) -> tuple[socket.socket, threading.Thread]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(reply)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nb1",  # cut short
        b"garbage\r\n\r\n",  # not a status line
        b"",  # closed before a word
    ],
    ids=["incomplete", "bad-status", "empty"],
)
def test_server_dying_mid_reply_is_an_exchange_error(
    monkeypatch: pytest.MonkeyPatch, reply: bytes
) -> None:
    monkeypatch.setattr(traffic.netns, "enter", lambda ns: contextlib.nullcontext())
    srv, t = _serve_once(reply)
    with srv:
        port = srv.getsockname()[1]
        with pytest.raises(traffic.ExchangeError, match=f"127.0.0.1:{port}"):
            traffic.http_post("here", "127.0.0.1", port, b"x", timeout=2.0)
        t.join(2.0)


def test_whole_reply_names_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traffic.netns, "enter", lambda ns: contextlib.nullcontext())
    srv, t = _serve_once(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nb1\nx")
    with srv:
        port = srv.getsockname()[1]
        assert traffic.http_post("here", "127.0.0.1", port, b"x", timeout=2.0) == "b1"
        t.join(2.0)
