"""lb_conns, the set-associative session table, from user space and through lb_xdp:
eviction within a set, ConnTable's import, get and entries, and a set held by a writer.

tests/bpf/test_session_table.py covers the session table's outcomes one by one
(generations, expiry, export, import, every counter, liveness per VIP)."""

from __future__ import annotations

import functools

import lb_fixtures as fx
import numpy as np
import pytest
from lb_harness import Lb, key_of

from xdplb.core import abi, hashing
from xdplb.datapath.clock import now_ticks
from xdplb.datapath.conns import SETS, ImportMode, ImportResult, TornRead, session, set_index

pytestmark = pytest.mark.bpf

Event = abi.Event


def same_set_frames(lb: Lb, n: int, vip: str = "tcp4", flags: str = "S") -> list[bytes]:
    """n frames to a fixture VIP whose flows all fall into one set (source ports differ)."""
    v = fx.VIPS[vip]
    return [
        bytes(
            fx.client_frame(
                v.addr, v.port, v.proto, sport=int(p), lb_mac=lb.env.lb_mac, flags=flags
            )
        )
        for p in same_set_sports(vip, n)
    ]


@functools.cache
def same_set_sports(vip: str, n: int) -> tuple[int, ...]:
    """The first n client ports whose flows to a fixture VIP share a set (sess_hash in
    numpy: 64,512 keys)."""
    v = fx.VIPS[vip]
    sports = np.arange(1024, 65536)
    keys = b"".join(
        abi.FlowKey.make(fx.CLIENT4, v.addr, int(p), v.port, v.proto).pack() for p in sports
    )
    words = np.frombuffer(keys, dtype="<u4").astype(np.uint64).reshape(-1, hashing.FLOW_WORDS)
    sets = sess_hash_many(words, fx.SEED) & np.uint64(SETS - 1)
    assert [int(x) for x in sets[:64]] == [
        hashing.sess_hash(keys[i * 40 : i * 40 + 40], fx.SEED) & (SETS - 1) for i in range(64)
    ]
    counts = np.bincount(sets.astype(np.int64), minlength=SETS)
    target = int(np.argmax(counts >= n))
    assert counts[target] >= n
    return tuple(int(p) for p in sports[sets == target][:n])


def sess_hash_many(words: np.ndarray, seed: int) -> np.ndarray:
    """hashing.sess_hash over rows of ten uint64-held words (uint64 arithmetic wraps as
    C's __u64 does)."""
    mul = [np.uint64(m) for m in hashing.sess_keys(seed)]
    with np.errstate(over="ignore"):
        s = words[:, 0] * mul[0]
        for i in range(1, hashing.FLOW_WORDS):
            s = s + words[:, i] * mul[i]
        h = (s >> np.uint64(32)) ^ (s & np.uint64(0xFFFFFFFF))
        m32 = np.uint64(0xFFFFFFFF)
        h ^= h >> np.uint64(16)
        h = (h * np.uint64(0x85EBCA6B)) & m32
        h ^= h >> np.uint64(13)
        h = (h * np.uint64(0xC2B2AE35)) & m32
        h ^= h >> np.uint64(16)
    return h


def test_a_full_set_evicts_its_least_recently_used_flow(lb: Lb) -> None:
    """Four sessions in one set, idle 40, 30, 20 and 10 ticks; a hit makes the oldest the
    most recent, so a fifth flow takes the way of the one idle longest then (the
    second), counted CONN_INSERT and CONN_EVICT."""
    frames = same_set_frames(lb, abi.CONN_WAYS + 1, "udp4")
    cfg = lb.config
    now = now_ticks()
    sessions = []
    for i, f in enumerate(frames[: abi.CONN_WAYS]):
        be_id, h = fx.pick(f, fx.VIPS["udp4"])
        sessions.append(session(key_of(f), [be_id], h, abi.SessState.UDP, now - 40 + 10 * i))
    results = lb.conns.import_sessions(
        sessions, seed=cfg.seed, gen=cfg.conn_gen, timeouts=cfg.conn_timeouts, now=now
    )
    assert results == [ImportResult.WRITTEN] * abi.CONN_WAYS
    ways = {}
    for f in frames[: abi.CONN_WAYS]:
        e = lb.conn(f)
        assert e is not None
        ways[f] = e.way
    before = lb.counters()
    assert lb.run(frames[0]).retval == fx.XDP_TX  # a hit: last_seen is now
    assert lb.run(frames[-1]).retval == fx.XDP_TX
    delta = (lb.counters() - before).events
    assert delta == {
        Event.CONN_HIT: 1,
        Event.CONN_MISS: 1,
        Event.CONN_INSERT: 1,
        Event.CONN_EVICT: 1,
        Event.TX: 2,
    }
    present = [lb.conn(f) is not None for f in frames]
    assert present == [True, False] + [True] * (abi.CONN_WAYS - 1)
    fifth = lb.conn(frames[-1])
    assert fifth is not None and fifth.way == ways[frames[1]]
    assert fifth.flags == abi.SESS_F_USED  # written by lb_xdp, not imported


def test_import_get_and_entries(lb: Lb) -> None:
    """ConnTable's import writes each session into its set under this table's generation,
    keeps a live one unless asked to replace it, and get / entries read them back."""
    cfg = lb.config
    keys = [
        abi.FlowKey.make(fx.CLIENT4, fx.VIPS["tcp4"].addr, 1000 + i, 80, abi.IPPROTO_TCP).pack()
        for i in range(10)
    ]
    now = now_ticks()

    def imp(sessions: list[abi.Session], replace: bool | ImportMode = False) -> list[ImportResult]:
        return lb.conns.import_sessions(
            sessions,
            seed=cfg.seed,
            gen=cfg.conn_gen,
            timeouts=cfg.conn_timeouts,
            now=now,
            replace=replace,
        )

    est = abi.SessState.TCP_EST
    assert (
        imp([session(k, [i + 1], 0x1000 + i, est, now) for i, k in enumerate(keys)])
        == [ImportResult.WRITTEN] * 10
    )
    assert lb.conns.count() == 10
    entries = lb.conns.entries()
    assert {k: (e.hops, e.hash, e.state) for k, e in entries.items()} == {
        k: ((i + 1,), 0x1000 + i, est) for i, k in enumerate(keys)
    }
    got = lb.conns.get(keys[3], fx.SEED)
    assert got is not None and (got.backend_id, got.hash) == (4, 0x1003)
    assert got.flags == abi.SESS_F_USED | abi.SESS_F_IMPORTED
    assert (got.set, got.last_seen, got.gen) == (set_index(keys[3], fx.SEED), now, cfg.conn_gen)
    # A live session stays unless replace is asked; then it is overwritten in place,
    # never duplicated.
    assert imp([session(keys[3], [7, 2], 9, est, now)]) == [ImportResult.PRESENT]
    assert imp([session(keys[3], [7, 2], 9, est, now)], replace=True) == [ImportResult.REPLACED]
    again = lb.conns.get(keys[3], fx.SEED)
    assert again is not None
    assert (again.hops, again.hash, again.set, again.way) == ((7, 2), 9, got.set, got.way)
    assert lb.conns.count() == 10
    # NEWER (a peer's refresh): only the last-seen tick moves, and only forward.
    assert imp([session(keys[3], [1], 5, est, now - 5)], replace=ImportMode.NEWER) == [
        ImportResult.PRESENT
    ]
    assert imp([session(keys[3], [1], 5, est, now + 3)], replace=ImportMode.NEWER) == [
        ImportResult.REPLACED
    ]
    fresh = lb.conns.get(keys[3], fx.SEED)
    assert fresh is not None
    assert (fresh.hops, fresh.hash, fresh.last_seen, fresh.way) == ((7, 2), 9, now + 3, got.way)
    # ... and a flow without a session gets the whole one.
    k11 = abi.FlowKey.make(fx.CLIENT4, fx.VIPS["tcp4"].addr, 999, 80, abi.IPPROTO_TCP).pack()
    assert imp([session(k11, [3], 1, est, now)], replace=ImportMode.NEWER) == [ImportResult.WRITTEN]
    assert lb.conns.count() == 11
    assert 0 <= set_index(keys[0], fx.SEED) < SETS
    lb.conns.wipe()
    assert lb.conns.count() == 0


def test_a_set_held_by_a_writer_is_neither_read_nor_written(lb: Lb) -> None:
    """A writer claims a set by making its seq odd. While it holds it, lb_xdp's lookup
    gives up on the set (CONN_BUSY, once for the packet; the flow is hashed into the
    table) and its insert is skipped: the packet is still balanced, nothing is written, and
    ConnTable.get cannot read the set either. Once seq is even again the insert
    happens, with a claim (seq + 2)."""
    frame = same_set_frames(lb, 1, "udp4")[0]
    idx = lb.set_of(frame)
    seq0 = lb.seq(idx)
    be_id, _ = fx.pick(frame, fx.VIPS["udp4"])
    with lb.holding(idx):
        before = lb.counters()
        assert lb.run(frame).retval == fx.XDP_TX
        delta = lb.counters() - before
        assert delta.events == {Event.CONN_BUSY: 1, Event.CONN_MISS: 1, Event.TX: 1}
        assert delta.be_stats == {be_id: (1, fx.flow_of(frame)[5], 1)}
        with pytest.raises(TornRead):
            lb.conns.get(key_of(frame), fx.SEED)
        assert lb.seq(idx) == seq0 + 1  # untouched by the program
    assert lb.conn(frame) is None
    assert lb.run(frame).retval == fx.XDP_TX
    assert lb.conn(frame) is not None
    assert lb.seq(idx) == seq0 + 4  # ours (+2), then the program's claim and release
