"""lb_conns, the set-associative connection table: eviction within a set, through lb_xdp."""

from __future__ import annotations

import lb_fixtures as fx
import numpy as np
import pytest
from lb_harness import Lb

from xdplb.core import abi, hashing
from xdplb.datapath.conns import SETS, ConnTable, TornRead, set_index

pytestmark = pytest.mark.bpf


def _same_set_frames(lb: Lb, n: int) -> list[bytes]:
    """n frames to the tcp4 VIP whose flows all fall into one set (source ports differ)."""
    v = fx.VIPS["tcp4"]
    sports = np.arange(1024, 65536)
    keys = [abi.FlowKey.make(fx.CLIENT4, v.addr, int(p), v.port, v.proto) for p in sports]
    sets = hashing.flow_hash_many(hashing.flow_words(keys), fx.SEED) & (SETS - 1)
    counts = np.bincount(sets, minlength=SETS)
    target = int(np.argmax(counts >= n))
    assert counts[target] >= n
    chosen = sports[sets == target][:n]
    return [
        bytes(fx.client_frame(v.addr, v.port, v.proto, sport=int(p), lb_mac=lb.env.lb_mac))
        for p in chosen
    ]


def test_a_full_set_evicts_its_least_recently_used_flow(lb: Lb) -> None:
    frames = _same_set_frames(lb, abi.CONN_WAYS + 1)
    for f in frames[: abi.CONN_WAYS]:
        assert lb.run(f).retval == fx.XDP_TX
    assert all(lb.conn(f) is not None for f in frames[: abi.CONN_WAYS])
    # A hit makes the oldest flow the most recent: the second one goes instead.
    assert lb.run(frames[0]).retval == fx.XDP_TX
    assert lb.run(frames[-1]).retval == fx.XDP_TX
    present = [lb.conn(f) is not None for f in frames]
    assert present == [True, False] + [True] * (abi.CONN_WAYS - 1)


def test_conn_table_put_get_flush(lb: Lb) -> None:
    table = ConnTable(lb.obj.map("lb_conns"))
    keys = [
        abi.FlowKey.make(fx.CLIENT4, fx.VIPS["tcp4"].addr, 1000 + i, 80, abi.IPPROTO_TCP).pack()
        for i in range(10)
    ]
    for i, k in enumerate(keys):
        table.put(k, i + 1, 0x1000 + i, fx.SEED)
    assert table.count() == 10
    assert table.entries() == {k: (i + 1, 0x1000 + i) for i, k in enumerate(keys)}
    assert table.get(keys[3], fx.SEED) == (4, 0x1003)
    table.put(keys[3], 7, 9, fx.SEED)  # replaces, never duplicates
    assert table.get(keys[3], fx.SEED) == (7, 9)
    assert table.count() == 10
    assert 0 <= set_index(keys[0], fx.SEED) < SETS
    assert table.flush() == 10
    assert table.count() == 0


def _set_seq(table: ConnTable, idx: int, seq: int) -> None:
    """Write a set's seq as a writer in the middle of an insert would leave it."""
    key = idx.to_bytes(4, "little")
    raw = bytearray(table.map.lookup(key) or b"")
    off = abi.ConnSet.seq.offset
    raw[off : off + 4] = seq.to_bytes(4, "little")
    table.map.update(key, bytes(raw))


def test_an_insert_into_a_set_being_written_is_skipped(
    lb: Lb, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writers claim a set by making seq odd; another writer then skips its (best-effort)
    insert, and the flow is still balanced. Once seq is even again, the insert happens."""
    table = ConnTable(lb.obj.map("lb_conns"))
    frame = _same_set_frames(lb, 1)[0]
    src, dst, sport, dport, proto, _ = fx.flow_of(frame)
    idx = set_index(abi.FlowKey.make(src, dst, sport, dport, proto).pack(), fx.SEED)
    _set_seq(table, idx, 7)
    before = lb.counters()
    assert lb.run(frame).retval == fx.XDP_TX
    delta = (lb.counters() - before).events
    assert delta.get(abi.Event.CONN_MISS) == 1 and abi.Event.CONN_HIT not in delta
    monkeypatch.setattr("xdplb.datapath.conns._READ_TRIES", 3)
    with pytest.raises(TornRead):
        table.get(abi.FlowKey.make(src, dst, sport, dport, proto).pack(), fx.SEED)
    _set_seq(table, idx, 8)
    assert lb.conn(frame) is None
    assert lb.run(frame).retval == fx.XDP_TX
    assert lb.conn(frame) is not None
    assert int(table.sets()["seq"][idx]) == 10  # claimed (9), then released (10)
