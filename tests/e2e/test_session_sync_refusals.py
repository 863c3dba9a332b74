"""What the real daemon does with a sync peer that sends what it must not (docs/sync.md,
"The wire"): the lab's LB node has one peer, ``evil``, a fake publisher this test runs in
the client's namespace. Each time the daemon subscribes, ``evil`` answers with one bad
stream: a forged MAC (a wrong key), a frame cut short, a frame from an older subscription
(replayed), a frame sent twice, a frame out of order, an oversized header, another
node's name. Each is refused and counted by its reason, the daemon subscribes again, and
none of the sessions those streams carry is in its table afterwards (read from its
pinned session table), while HTTP through the VIP keeps working. Then an authentic copy
whose END does not match its BEGIN and one that never ends: each counted a failed copy
and asked for again, the node still not ready. Last, a good stream with the same kind of
sessions: they are imported, so the refusals are what kept the others out.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from xdplb.core import abi
from xdplb.core.errors import LabError
from xdplb.lab import Lab
from xdplb.lab.cluster import SYNC_KEY
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import http_post
from xdplb.lab.wait import wait_for
from xdplb.sync import wire

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
KEY = bytes.fromhex(SYNC_KEY)
EVIL_PORT = 7947
#: Client ports of the sessions each bad stream carries (none may be imported).
BAD_PORTS = range(41000, 41040)
GOOD_PORTS = range(42000, 42010)
#: Client ports of the sessions of a copy that does not match (authentic: imported).
SHORT_PORTS = range(43000, 43005)
#: sync.copy_timeout of the node: a copy that takes longer is asked for again.
COPY_TIMEOUT = 2.0

Send = Callable[[bytes], None]


def entries(lab: Lab, ports: range) -> wire.Entries:
    """Established sessions client:port -> VIP:80, each on backend b1."""
    e = np.zeros(len(ports), dtype=wire.ENTRY_DTYPE)
    e["op"] = wire.Op.COPY
    e["state"] = abi.SessState.TCP_EST
    e["proto"] = abi.IPPROTO_TCP
    e["src"] = np.frombuffer(lab.addr("client").packed.ljust(16, b"\0"), np.uint8)
    e["dst"] = np.frombuffer(ipaddress.ip_address(VIP).packed.ljust(16, b"\0"), np.uint8)
    e["sport"] = np.array(list(ports))
    e["dport"] = 80
    e["hops"] = [0, wire.NO_HOP, wire.NO_HOP, wire.NO_HOP]
    e["hash"] = 7
    return wire.Entries((lab.addr("b1"),), e)


class Evil:
    """A fake sync peer: for each subscription, the next of ``streams`` (each a function
    of the subscription's epoch and a send), then the connection closes."""

    def __init__(self, lab: Lab, streams: list[Callable[[int, Send], None]]) -> None:
        self.streams = streams
        self.served = 0
        self.epochs: list[int] = []
        with lab.enter("client"):
            self.sock = socket.create_server((str(lab.addr("client")), EVIL_PORT))
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                raw = conn.recv(wire.HEADER_SIZE + 4 + wire.MAC_SIZE, socket.MSG_WAITALL)
                h, msg = wire.decode(KEY, raw)
                assert isinstance(msg, wire.Subscribe) and msg.full
                self.epochs.append(h.epoch)
                if self.served < len(self.streams):
                    self.streams[self.served](h.epoch, conn.sendall)
                    self.served += 1
                else:  # the list played out: hold the subscription open (a quiet peer)
                    self._stop.wait()

    def hold(self, seconds: float) -> None:
        """Keep the connection open and silent (unless closing)."""
        self._stop.wait(seconds)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def frame(
    epoch: int, seq: int, msg: wire.Message, *, key: bytes = KEY, node: str = "evil"
) -> bytes:
    return wire.encode(key, node, epoch, seq, msg)


@pytest.fixture
def lb(lab: Lab, tmp_path: Path, lab_servers: Any) -> Iterator[LbNode]:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    node = LbNode(
        lab,
        tmp_path,
        [{"address": VIP, "port": 80, "protocol": "tcp", "backends": backends}],
        sync={
            "listen": f"{lab.addr('lb')}:7946",
            "node": "lb",
            "key": SYNC_KEY,
            "peers": [{"node": "evil", "address": f"{lab.addr('client')}:{EVIL_PORT}"}],
            "unreachable_after": 60,  # evil answers: the node waits for its copy
            "copy_timeout": COPY_TIMEOUT,
        },
    )
    node.start()
    yield node
    node.destroy()


def sync_status(node: LbNode) -> dict[str, Any]:
    with node.api() as api:
        return api.get("/api/v1/status").json()["cluster"]["sync"]  # type: ignore[no-any-return]


def keys_in_table(node: LbNode, lab: Lab, ports: range) -> list[int]:
    """The client ports of ``ports`` whose session to VIP:80 is in the node's table."""
    want = {
        bytes(abi.FlowKey.make(lab.addr("client"), ipaddress.ip_address(VIP), p, 80, 6)): p
        for p in ports
    }
    with node.maps() as maps:
        return sorted(want[e.key] for e in maps.conns.iter_entries() if e.key in want)


def test_bad_streams_are_refused_by_reason_and_nothing_of_them_imported(
    lab: Lab, lb: LbNode
) -> None:
    bad = entries(lab, BAD_PORTS)
    old_epoch: list[int] = []

    def forged(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(bad.entries)), key=b"k" * 32))

    def truncated(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(bad.entries))))
        send(frame(epoch, 2, bad)[:-40])
        old_epoch.append(epoch)

    def replayed_from_older(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(bad.entries))))
        send(frame(old_epoch[0], 2, bad))  # another subscription's

    def sent_twice(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(bad.entries))))
        send(frame(epoch, 1, wire.Begin(len(bad.entries))))
        send(frame(epoch, 2, bad))

    def reordered(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(bad.entries))))
        send(frame(epoch, 3, bad))
        send(frame(epoch, 2, wire.Keepalive()))

    def oversized(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(bad.entries))))
        h = struct.pack(
            "!4sBBH16sQQI", wire.MAGIC, 1, wire.MsgType.ENTRIES, 0, b"evil", epoch, 2,
            wire.MAX_BODY + 1,
        )  # fmt: skip
        send(h + bytes(1000))

    def another_node(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(bad.entries)), node="mallory"))

    def mismatched(epoch: int, send: Send) -> None:  # authentic, but not whole
        part = entries(lab, SHORT_PORTS)
        send(frame(epoch, 1, wire.Begin(len(part.entries) + 2)))
        send(frame(epoch, 2, part))
        digest = wire.CopyDigest()
        digest.update(part.entries)
        send(frame(epoch, 3, digest.end()))

    def stalled(epoch: int, send: Send) -> None:  # no END within copy_timeout
        send(frame(epoch, 1, wire.Begin(1)))
        evil.hold(COPY_TIMEOUT + 1)

    good = entries(lab, GOOD_PORTS)

    def valid(epoch: int, send: Send) -> None:
        send(frame(epoch, 1, wire.Begin(len(good.entries))))
        send(frame(epoch, 2, good))
        digest = wire.CopyDigest()
        digest.update(good.entries)
        send(frame(epoch, 3, digest.end()))

    streams = [
        (forged, "mac"),
        (truncated, "truncated"),
        (replayed_from_older, "epoch"),
        (sent_twice, "replay"),
        (reordered, "gap"),
        (oversized, "oversized"),
        (another_node, "node"),
    ]
    assert http_post(lab.ns("client"), VIP, 80, b"x") in lab.backends
    evil = Evil(lab, [s for s, _ in streams] + [mismatched, stalled, valid])
    try:
        for i, (_, reason) in enumerate(streams):
            st = wait_for(
                lambda: sync_status(lb),
                f"the daemon refusing stream {i} ({reason})",
                until=lambda s, i=i: sum(s["refused"].values()) >= i + 1,  # type: ignore[misc]
                timeout=15,
            )
            assert st["refused"].get(reason, 0) >= 1, (reason, st["refused"])
            assert not st["ready"], st  # not ready until a copy matched...
        # ... which the valid stream gives.
        st = wait_for(
            lambda: sync_status(lb), "a matching copy from evil", until=lambda s: s["ready"]
        )
        (peer,) = st["peers"]
        assert peer["copies"] == 1 and peer["last_copy_entries"] == len(GOOD_PORTS), peer
        # The copy that did not match and the one that did not end: failed, asked again.
        assert peer["copy_failures"] == 2, peer
        assert st["refused"] == {r: 1 for _, r in streams}, st["refused"]
        # Authentic sessions are kept, even from a copy that did not match; refused ones never.
        assert st["imported"] == {"written": len(GOOD_PORTS) + len(SHORT_PORTS)}, st
        assert len(set(evil.epochs)) == len(evil.epochs)  # a fresh epoch every time
        assert keys_in_table(lb, lab, BAD_PORTS) == []
        assert keys_in_table(lb, lab, GOOD_PORTS) == list(GOOD_PORTS)
        assert keys_in_table(lb, lab, SHORT_PORTS) == list(SHORT_PORTS)
        # Traffic went on meanwhile, and goes on.
        assert all(http_post(lab.ns("client"), VIP, 80, b"x") in lab.backends for _ in range(5))
        with lb.api() as api:
            metrics = api.get("/metrics").text
        assert 'xdplb_sync_refused_messages_total{reason="mac"} 1.0' in metrics
        assert "xdplb_sync_ready 1.0" in metrics
    finally:
        evil.close()


def test_a_sync_address_the_node_cannot_listen_on_stops_the_start(lab: Lab, tmp_path: Path) -> None:
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    node = LbNode(
        lab,
        tmp_path,
        [{"address": VIP, "port": 80, "protocol": "tcp", "backends": backends}],
        sync={"listen": "198.18.0.250:7946", "node": "lb", "key": SYNC_KEY},  # not lb's
    )
    try:
        with pytest.raises(LabError) as e:
            node.start(timeout=15)
        assert "sync.listen: cannot listen on 198.18.0.250:7946" in str(e.value), e.value
        assert node.proc is not None and node.proc.wait(5) != 0
    finally:
        node.destroy()
