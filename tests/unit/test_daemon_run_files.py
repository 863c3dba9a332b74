"""The daemon removes its API socket at exit, unless another daemon has bound the path
since (a restart that overlapped): the inode tells them apart."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from xdplb.daemon.main import _remove_socket_file, _socket_file

pytestmark = pytest.mark.unit


def bound(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


def test_removes_its_own_socket(tmp_path: Path) -> None:
    path = tmp_path / "x.api.sock"
    with bound(path) as sock:
        _remove_socket_file(_socket_file(sock))
    assert not path.exists()


def test_keeps_a_newer_daemons_socket(tmp_path: Path) -> None:
    path = tmp_path / "x.api.sock"
    with bound(path) as old:
        mine = _socket_file(old)
        path.unlink()  # what bind_api does before a new daemon binds the same path
        with bound(path) as new:
            _remove_socket_file(mine)
            assert path.exists()
            _remove_socket_file(_socket_file(new))
    assert not path.exists()


def test_tcp_listener_has_no_file() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        assert _socket_file(sock) is None
        _remove_socket_file(None)
