"""Sessions between a node's table and the sync wire (xdplb.sync.convert): backend ids
become addresses and back (each node has its own ids and slot generations), jiffies
become ages and back, a session the receiver cannot place is counted, not imported."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from xdplb.core import abi
from xdplb.core.addresses import IPAddress
from xdplb.datapath.conns import SESSION_DTYPE, ImportMode, records
from xdplb.sync import convert, wire

pytestmark = pytest.mark.unit

VIP = ipaddress.ip_address("198.18.100.1")
OTHER_VIP = ipaddress.ip_address("198.18.100.2")
HZ = 250
KEY = b"k" * 32
#: 300 backends: more than one message's address table holds.
ADDRS: list[IPAddress] = [ipaddress.ip_address(f"198.19.{i >> 8}.{i & 255}") for i in range(300)]


def view(
    ids: list[int], gens: list[int], synced: list[IPAddress], gen: int = 3
) -> convert.TableView:
    return convert.view_of(
        seed=1,
        gen=gen,
        timeouts=[30 * HZ, 10 * HZ, 300 * HZ, 10 * HZ],
        hz=HZ,
        backends={i: (a, g) for i, a, g in zip(ids, ADDRS[: len(ids)], gens, strict=True)},
        synced=[convert.VipMatch.of(v, 80, abi.IPPROTO_TCP) for v in synced],
    )


def sessions(n: int, dst: IPAddress, backend_ids: np.ndarray, now: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint32)
    keys = np.zeros((n, 10), dtype=np.uint32)
    keys[:, 0] = (0xCB000000 + i).byteswap()
    keys[:, 4] = np.frombuffer(dst.packed, dtype="<u4")[0]
    ports = (1024 + i).astype(np.uint16).byteswap().astype(np.uint32)
    keys[:, 8] = ports | (np.uint32(80 << 8) << 16)
    keys[:, 9] = abi.IPPROTO_TCP
    out = records(keys, backend_ids.astype(np.uint16), i * 7, abi.SessState.TCP_EST, now)
    out["last_seen"] = now - (i % 500)  # up to 2 s idle
    return out


def over_the_wire(msgs: list[wire.Entries]) -> list[wire.Entries]:
    out = []
    for seq, m in enumerate(msgs, 1):
        _, got = wire.decode(KEY, wire.encode(KEY, "a", 9, seq, m))
        assert isinstance(got, wire.Entries)
        out.append(got)
    return out


def test_a_session_keeps_its_flow_and_backends_by_address_on_another_node() -> None:
    n = 2000
    sender = view(list(range(1, 301)), [1] * 300, [VIP])
    # The receiver numbers the same backends otherwise, with other slot generations.
    recv_ids = [1000 - i for i in range(300)]
    receiver = view(recv_ids, [i % 7 for i in range(300)], [VIP], gen=9)
    rng = np.random.default_rng(1)
    recs = sessions(n, VIP, rng.integers(1, 301, n), now=100_000)
    recs["hop"][:, 1] = rng.integers(1, 301, n)  # a later hop each (Beamer)
    msgs = convert.to_wire(recs, wire.Op.NEW, sender, now=100_000)
    assert sum(len(m.entries) for m in msgs) == n
    assert all(len(m.addrs) <= wire.MAX_ADDRS for m in msgs)
    got = [convert.from_wire(m, receiver, now=7_000_000) for m in over_the_wire(msgs)]
    assert all(g.unknown_backend == 0 and g.not_synced == 0 for g in got)
    out = np.concatenate([g.batches[ImportMode.KEEP] for g in got])
    assert len(out) == n
    for f in ("src", "dst", "sport", "dport", "proto", "state", "hash"):
        assert (out[f] == recs[f]).all(), f
    to_recv = {sid: recv_ids[sid - 1] for sid in range(1, 301)}
    want_hops = np.vectorize(lambda h: to_recv.get(int(h), 0))(recs["hop"])
    assert (out["hop"] == want_hops).all()
    gen_of = dict(zip(recv_ids, [i % 7 for i in range(300)], strict=True))
    assert [int(g) for g in out["be_gen"]] == [gen_of[int(h)] for h in want_hops[:, 0]]
    # Idle as long on the receiver's clock, to a tick (ms on the wire, rounded down).
    idle_sent = 100_000 - recs["last_seen"].astype(np.int64)
    idle_got = 7_000_000 - out["last_seen"].astype(np.int64)
    assert ((idle_sent - idle_got) >= 0).all() and ((idle_sent - idle_got) <= 1).all()


def test_what_a_node_cannot_place_is_left_out_and_counted() -> None:
    sender = view([1, 2, 3], [0, 0, 0], [VIP, OTHER_VIP])
    recs = np.concatenate(
        [
            sessions(10, VIP, np.array([1] * 10), 50),
            sessions(4, VIP, np.array([3] * 4), 50),  # b3: the receiver has no such backend
            sessions(5, OTHER_VIP, np.array([2] * 5), 50),  # a VIP it does not sync
            sessions(2, VIP, np.array([77] * 2), 50),  # an id not in the sender's maps
        ]
    )
    msgs = convert.to_wire(recs, wire.Op.REFRESH, sender, now=60)
    assert sum(len(m.entries) for m in msgs) == 19  # the stale slot is not sent
    receiver = view([5, 6], [0, 0], [VIP])  # knows b1 and b2 only, syncs VIP only
    (got,) = [convert.from_wire(m, receiver, now=60) for m in over_the_wire(msgs)]
    assert (got.unknown_backend, got.not_synced) == (4, 5)
    assert list(got.batches) == [ImportMode.NEWER]  # a refresh only moves last_seen on
    assert len(got.batches[ImportMode.NEWER]) == 10


def test_ops_import_as_their_modes() -> None:
    v = view([1], [0], [VIP])
    recs = sessions(4, VIP, np.array([1] * 4), 10)
    ops = np.array([wire.Op.NEW, wire.Op.UPDATE, wire.Op.REFRESH, wire.Op.COPY], dtype=np.uint8)
    (msg,) = convert.to_wire(recs, ops, v, now=10)
    got = convert.from_wire(msg, v, now=10)
    assert {m: len(r) for m, r in got.batches.items()} == {
        ImportMode.KEEP: 1,
        ImportMode.OVERWRITE: 1,
        ImportMode.NEWER: 2,
    }


def test_a_refresh_sends_only_live_sessions_this_node_used() -> None:
    v = view([1], [0], [VIP], gen=3)
    recs = sessions(6, VIP, np.array([1] * 6), 0)
    now = 10_000
    recs["gen"] = 3
    recs["flags"] = abi.SESS_F_USED
    recs["last_seen"] = now - np.array([10, 10, 10, 10, 5000, 10 * 300 * HZ])
    recs["gen"][1] = 2  # flushed
    recs["flags"][2] |= abi.SESS_F_IMPORTED  # a peer's, unused here since
    recs["dst"][3] = recs["dst"][3] + 1  # to no VIP that syncs
    assert len(convert.live_synced(recs, v, now)) == 3  # 0, 2 and 4; 5 expired
    used = convert.live_synced(recs, v, now, used_within=100)
    assert list(used["last_seen"]) == [now - 10]  # only the first
    assert SESSION_DTYPE.itemsize == recs.itemsize


def test_ipv6_flows_and_backends_cross_too() -> None:
    vip6 = ipaddress.ip_address("fd78:6470:6c62:100::1")
    client6 = ipaddress.ip_address("fd78:6470:6c62::1")
    backends = [ipaddress.ip_address(f"fd78:6470:6c62::{11 + i:x}") for i in range(3)]
    sender = convert.view_of(
        seed=1, gen=1, timeouts=[7500] * 4, hz=HZ,
        backends={i + 1: (b, 0) for i, b in enumerate(backends)},
        synced=[convert.VipMatch.of(vip6, 443, abi.IPPROTO_UDP)],
    )  # fmt: skip
    receiver = convert.view_of(
        seed=1, gen=4, timeouts=[7500] * 4, hz=HZ,
        backends={40 + i: (b, 2) for i, b in enumerate(reversed(backends))},
        synced=[convert.VipMatch.of(vip6, 0, abi.IPPROTO_UDP)],  # a wildcard VIP there
    )  # fmt: skip
    keys = np.zeros((3, 10), dtype=np.uint32)
    keys[:, 0:4] = np.frombuffer(client6.packed, dtype="<u4")
    keys[:, 4:8] = np.frombuffer(vip6.packed, dtype="<u4")
    keys[:, 8] = np.array([5000, 5001, 5002], dtype=np.uint16).byteswap().astype(np.uint32) | (
        np.uint32(np.array(443, dtype=np.uint16).byteswap()) << 16
    )
    keys[:, 9] = abi.IPPROTO_UDP
    recs = records(keys, np.array([1, 2, 3], dtype=np.uint16), np.arange(3), abi.SessState.UDP, 9)
    (msg,) = over_the_wire(convert.to_wire(recs, wire.Op.NEW, sender, now=9))
    assert set(msg.addrs) == set(backends)
    got = convert.from_wire(msg, receiver, now=9)
    (out,) = got.batches.values()
    assert (out["src"] == recs["src"]).all() and (out["dst"] == recs["dst"]).all()
    assert (out["sport"] == recs["sport"]).all() and (out["dport"] == recs["dport"]).all()
    assert [int(h) for h in out["hop"][:, 0]] == [42, 41, 40]  # b1, b2, b3 by address
