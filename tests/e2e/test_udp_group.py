"""The plain SO_REUSEPORT UDP helper: a group of 4 sockets, one worker each, and
64 flows. The kernel hashes each datagram's 4-tuple, so every flow lands on one socket
every time, and the flows spread over all four (no dispatcher in between), with a
worker thread or a worker process per socket."""

from __future__ import annotations

import socket
from collections import defaultdict

import pytest

from xdplb.lab import netns as netns_mod
from xdplb.sockets.udp import UdpWorkers, udp_group

pytestmark = pytest.mark.e2e

SOCKETS = 4
FLOWS = 64
ROUNDS = 8


def answer(data: bytes, peer: object, index: int) -> bytes:
    return data + b" socket=%d" % index


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_each_flow_keeps_its_socket_and_flows_use_every_socket(netns: str, processes: bool) -> None:
    with netns_mod.enter(netns):
        group = udp_group("127.0.0.1", 0, SOCKETS)
        clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(FLOWS)]
    try:
        port = group[0].getsockname()[1]
        assert {s.getsockname()[1] for s in group} == {port}
        landed: dict[int, list[int]] = defaultdict(list)
        with UdpWorkers(group, answer, processes=processes) as workers:
            for c in clients:
                c.settimeout(5.0)
                c.connect(("127.0.0.1", port))
            for r in range(ROUNDS):
                for f, c in enumerate(clients):
                    c.send(b"flow=%d n=%d" % (f, r))
                for f, c in enumerate(clients):
                    head, _, index = c.recv(256).rpartition(b" socket=")
                    assert head == b"flow=%d n=%d" % (f, r)
                    landed[f].append(int(index))
        assert workers.errors == []
        moved = {f: seen for f, seen in landed.items() if len(set(seen)) != 1}
        assert moved == {}, f"flows answered by more than one socket: {moved}"
        per_socket: dict[int, int] = defaultdict(int)
        for seen in landed.values():
            per_socket[seen[0]] += 1
        assert sorted(per_socket) == list(range(SOCKETS)), f"flows per socket: {per_socket}"
    finally:
        for s in group + clients:
            s.close()
