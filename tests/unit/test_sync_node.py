"""The node's side of session sync (xdplb.sync.node) over loopback, with tables that are
plain arrays: a full copy, then the pump's stream; readiness and what latches it; peers
from the fleet's store; an unreachable peer; a subscriber that falls behind. The real
table, program and daemon are in tests/e2e/test_session_sync*.py."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from xdplb.config.schema import SyncConfig
from xdplb.core import abi
from xdplb.datapath.conns import EXPORT_DTYPE, SESSION_DTYPE, ImportMode, ImportResult, records
from xdplb.sync import convert, node
from xdplb.sync.node import SyncNode, SyncSource

pytestmark = pytest.mark.unit

VIP = ipaddress.ip_address("198.18.100.1")
KEY = "ab" * 32
HZ = 250
NOW = 1_000_000


class Table:
    """A session table as sync uses it: chunks to read, records imported."""

    def __init__(self, recs: npt.NDArray[np.void] | None = None) -> None:
        self.recs = recs if recs is not None else np.zeros(0, dtype=SESSION_DTYPE)
        self.imported: dict[ImportMode, list[npt.NDArray[np.void]]] = {}

    def chunks(self, chunk: int = 1024) -> Iterator[tuple[npt.NDArray[np.void], Any]]:
        for i in range(0, len(self.recs), chunk):
            yield self.recs[i : i + chunk], None

    def import_records(self, recs: npt.NDArray[np.void], **kw: Any) -> npt.NDArray[np.uint8]:
        self.imported.setdefault(ImportMode(kw["replace"]), []).append(recs.copy())
        return np.full(len(recs), ImportResult.WRITTEN, dtype=np.uint8)

    def count(self, mode: ImportMode) -> int:
        return sum(len(r) for r in self.imported.get(mode, []))


class Export:
    def __init__(self) -> None:
        self.queue: list[npt.NDArray[np.void]] = []

    def skip(self) -> None:
        self.queue.clear()

    def drain_records(self) -> npt.NDArray[np.void]:
        out = np.concatenate(self.queue) if self.queue else np.zeros(0, dtype=EXPORT_DTYPE)
        self.queue.clear()
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


VIEW = convert.view_of(
    seed=1,
    gen=0,
    timeouts=[30 * HZ, 10 * HZ, 300 * HZ, 10 * HZ],
    hz=HZ,
    backends={1: (ipaddress.ip_address("198.18.0.11"), 0)},
    synced=[convert.VipMatch.of(VIP, 80, abi.IPPROTO_TCP)],
)


def sessions(n: int, first_port: int = 1024) -> npt.NDArray[np.void]:
    i = np.arange(n, dtype=np.uint32)
    keys = np.zeros((n, 10), dtype=np.uint32)
    keys[:, 0] = (0xCB000000 + i).byteswap()
    keys[:, 4] = np.frombuffer(VIP.packed, dtype="<u4")[0]
    ports = (first_port + i).astype(np.uint16).byteswap().astype(np.uint32)
    keys[:, 8] = ports | (np.uint32(80 << 8) << 16)
    keys[:, 9] = abi.IPPROTO_TCP
    out = records(keys, np.ones(n, dtype=np.uint16), i, abi.SessState.TCP_EST, NOW)
    out["flags"] = abi.SESS_F_USED
    return out


def make(
    name: str, port: int, peers: dict[str, int], table: Table, export: Export, **cfg: Any
) -> SyncNode:
    sync = SyncConfig.model_validate(
        {
            "listen": f"127.0.0.1:{port}",
            "key": KEY,
            "peers": [{"node": n, "address": f"127.0.0.1:{p}"} for n, p in peers.items()],
            "batch_delay_ms": 5,
            **cfg,
        }
    )
    src = SyncSource(table, export, lambda: VIEW)  # type: ignore[arg-type]
    return SyncNode(sync, name, bytes.fromhex(KEY), src)


async def until(fact: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not fact():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not after {timeout} s: {what}")
        await asyncio.sleep(0.01)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 30))


@pytest.fixture(autouse=True)
def _clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "now_ticks", lambda: NOW)
    monkeypatch.setattr(node, "RETRY", 0.05)


def test_a_full_copy_then_the_stream_of_new_sessions() -> None:
    async def body() -> None:
        pa, pb = free_port(), free_port()
        a_table, a_export = Table(sessions(3000)), Export()
        b_table = Table()
        a = make("a", pa, {}, a_table, a_export)
        b = make("b", pb, {"a": pa}, b_table, Export())
        await a.start()
        assert b.waiting_for() is not None
        await b.start()
        try:
            await until(lambda: b.waiting_for() is None, "b synced with a")
            (peer,) = b.status().peers
            assert (peer.copies, peer.last_copy_entries, peer.state) == (1, 3000, "synced")
            assert b_table.count(ImportMode.NEWER) == 3000  # a copy only moves last_seen on
            assert a.status().subscribers == ["b"]
            # lb_xdp on a records 10 new sessions and changes the state of one.
            new = np.zeros(11, dtype=EXPORT_DTYPE)
            new["type"] = [abi.ExportType.NEW] * 10 + [abi.ExportType.UPDATE]
            new["sess"] = sessions(11, first_port=50000)
            a_export.queue.append(new)
            await until(lambda: b_table.count(ImportMode.KEEP) == 10, "the new sessions")
            await until(lambda: b_table.count(ImportMode.OVERWRITE) == 1, "the state change")
            got = np.concatenate(b_table.imported[ImportMode.KEEP])
            assert sorted(int(p) for p in got["sport"]) == sorted(
                int(p) for p in new["sess"]["sport"][:10]
            )
            assert a.status().sent == 11  # the stream's entries; a copy is not counted
        finally:
            await b.close()
            await a.close()

    run(body)


def test_peers_from_the_fleet_and_readiness_latches() -> None:
    async def body() -> None:
        pa, pb, pc = free_port(), free_port(), free_port()
        a = make("a", pa, {}, Table(sessions(5)), Export())
        b = make("b", pb, {}, Table(), Export())
        c = make("c", pc, {}, Table(sessions(7)), Export())
        b.wait_for_fleet()
        for n in (a, b, c):
            await n.start()
        try:
            assert "fleet's list" in (b.waiting_for() or "")
            b.set_fleet_peers({"a": f"127.0.0.1:{pa}", "b": f"127.0.0.1:{pb}"})
            await until(lambda: b.waiting_for() is None, "b synced with a")
            assert [p.node for p in b.status().peers] == ["a"]  # not itself
            # A node that joins later is followed, and changes nothing of b's readiness.
            b.set_fleet_peers({"a": f"127.0.0.1:{pa}", "c": f"127.0.0.1:{pc}"})
            assert b.waiting_for() is None
            await until(lambda: any(p.copies for p in b.status().peers if p.node == "c"), "c")
            b.set_fleet_peers({"c": f"127.0.0.1:{pc}"})  # a left the store
            assert [p.node for p in b.status().peers] == ["c"]
        finally:
            for n in (a, b, c):
                await n.close()

    run(body)


def test_a_peer_never_reached_is_not_waited_for() -> None:
    async def body() -> None:
        b = make("b", free_port(), {"gone": free_port()}, Table(), Export(), unreachable_after=0.3)
        await b.start()
        try:
            assert b.waiting_for() is not None
            await until(lambda: b.waiting_for() is None, "b not waiting for gone")
            (peer,) = b.status().peers
            assert peer.state == "unreachable" and "cannot connect" in peer.error
        finally:
            await b.close()

    run(body)


def test_a_subscriber_that_falls_behind_is_dropped_and_copies_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(node, "MAX_QUEUE", 4)

    async def body() -> None:
        pa, pb = free_port(), free_port()
        a = make("a", pa, {}, Table(sessions(2)), Export())
        b = make("b", pb, {"a": pa}, Table(), Export())
        await a.start()
        await b.start()
        try:
            await until(lambda: b.waiting_for() is None, "b synced")
            msgs = convert.to_wire(
                sessions(50 * 1024, first_port=1), convert.wire.Op.NEW, VIEW, NOW
            )
            a._publish(msgs)  # more messages at once than the queue holds
            assert a.overflows == 1 and a.status().subscribers == []
            await until(lambda: b.status().peers[0].copies == 2, "b's second copy")
        finally:
            await b.close()
            await a.close()

    run(body)
