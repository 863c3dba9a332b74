"""The session table (issue 11) through the real lb_xdp (BPF_PROG_TEST_RUN), case by case.

Every test here asserts state, not only counters: the flow's session before and after
(``ConnTable.get`` / ``iter_entries``: its set and way, backend and hops, state,
generation, flags), the packet that left and where it went, and the exact counter
deltas. The cases are tables, each row with a description:

- generation flush: a session of the previous generation is a miss (CONN_GEN_MISS), its
  way is taken by the next packet's insert, and the flush itself writes nothing into
  the table;
- expiry: each state with its own timeout (imported ages, and the program's own stamps
  with a small timeout), and the TCP state machine (SYN, EST, FIN) read back;
- the export ring: every insert once, every state change as an UPDATE, a full ring
  counted (EXPORT_DROP) while every packet is still forwarded;
- import: an imported session is used on the next packet; a live one is kept unless
  replaced;
- every counter of the table, each shown with the state it leaves;
- liveness per VIP, driven through the planner: removed, weight 0, drained, down, a slot
  given to another address, with and without the backend serving another VIP;
- Beamer: a mid-connection flow recorded with its hops, its hit carrying them;
- the echo reply's checksum (all-zero request) against the model's bytes;
- the VIP filter: checked before anything else, kept exact by the planner.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import lb_fixtures as fx
import pytest
from lb_harness import Lb, key_of
from scapy.layers.inet import ICMP, IP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from test_conns import same_set_frames

from xdplb import model
from xdplb.config import Config, parse_config
from xdplb.control.overlay import Overlay, effective
from xdplb.core import abi, hashing, mapops
from xdplb.core.acl import AclKey, rule_value
from xdplb.core.state import BackendState, ConnEntry, filter_bits
from xdplb.datapath.clock import now_ticks
from xdplb.datapath.conns import Entry, ImportResult, SessionExport, session
from xdplb.datapath.testrun import TestRunResult
from xdplb.model import frames

pytestmark = pytest.mark.bpf

Event = abi.Event
SessState = abi.SessState
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: The hash an imported session carries (its GUE source port: 0x8000 | 0x4242).
IMPORTED_HASH = 0x4242


# --- helpers ---------------------------------------------------------------------------------


def ev(**counts: int) -> dict[str, int]:
    """Event deltas by name: ``ev(CONN_HIT=1, TX=1)``."""
    for name in counts:
        Event[name]  # a typo is a KeyError, not a silently different expectation
    return counts


def run(lb: Lb, frame: bytes) -> tuple[TestRunResult, dict[str, int]]:
    """One packet: the result and the lb_events deltas by name (drops must not move)."""
    before = lb.counters()
    r = lb.run(frame)
    delta = (lb.counters() - before).named()
    assert delta["drops"] == {}, delta
    return r, delta["events"]  # type: ignore[return-value]


def frame(
    lb: Lb, vip: str, sport: int = 40000, flags: str = "S", src: IPAddress | None = None
) -> bytes:
    """A client's packet to a fixture VIP (TCP: ``flags``; a SYN by default)."""
    v = fx.VIPS[vip]
    return bytes(
        fx.client_frame(
            v.addr, v.port or 8080, v.proto, src=src, sport=sport, lb_mac=lb.env.lb_mac, flags=flags
        )
    )


def outer_dst(data: bytes) -> IPAddress:
    """Where an encapsulated frame goes: its outer destination."""
    if data[14] >> 4 == 4:
        return ipaddress.IPv4Address(data[30:34])
    return ipaddress.IPv6Address(data[38:54])


def gue_hops(data: bytes) -> list[IPAddress]:
    """The hop list of a GUE packet over IPv4 or IPv6 (docs/datapath.md, step 11)."""
    v4 = data[14] >> 4 == 4
    gue = 14 + (20 if v4 else 40) + 8
    n, width = data[gue + 7], 4 if v4 else 16
    out: list[IPAddress] = []
    for i in range(n):
        raw = data[gue + 8 + i * width : gue + 8 + (i + 1) * width]
        out.append(ipaddress.IPv4Address(raw) if v4 else ipaddress.IPv6Address(raw))
    return out


def imp(lb: Lb, *sessions: abi.Session, replace: bool = False) -> list[ImportResult]:
    """Import under the table's generation and timeouts, as session sync would."""
    c = lb.config
    return lb.conns.import_sessions(
        list(sessions), seed=c.seed, gen=c.conn_gen, timeouts=c.conn_timeouts, replace=replace
    )


def other_backend(frm: bytes, vip: str) -> int:
    """A backend of the VIP's table (with a neighbour) the table would not pick for frm."""
    v = fx.VIPS[vip]
    assert v.backends is not None
    pick, _ = fx.pick(frm, v)
    return next(b for b in v.backends if b != pick)


def only_session(lb: Lb, frm: bytes) -> Entry:
    """The frame's flow's one session (never two ways for one flow)."""
    key = key_of(frm)
    found = [e for e in lb.conns.iter_entries() if e.key == key]
    assert len(found) == 1, found
    return found[0]


def model_events(lb: Lb, frm: bytes) -> dict[str, int]:
    """What the model counts for frm against the maps and the program's sessions now (the
    lab's FIB sends to neighbours: TX for a forward)."""
    conns = {e.key: _model_entry(e) for e in lb.conns.iter_entries()}
    state = dataclasses.replace(
        model.state_from_snapshot(lb.maps.snapshot(), conns), now=now_ticks()
    )
    d = model.decide(state, frm)
    out = Counter(e.name for e in d.events)
    if d.outcome is model.Outcome.FORWARD:
        out["TX"] += 1
    return dict(out)


def _model_entry(e: Entry) -> ConnEntry:
    return ConnEntry(e.backend_id, e.hash, e.hops[1:], e.state, e.be_gen, e.gen, e.last_seen)


@pytest.fixture
def one_cpu() -> Iterator[None]:
    """Per-CPU state (the insert budget's window) stays on one CPU for the test."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# --- generation flush ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlushCase:
    description: str
    vip: str
    #: TCP flags of the packet after the flush (the first is always a SYN).
    flags: str
    events: dict[str, int]
    state: SessState

    def __str__(self) -> str:
        return self.description


FLUSH_CASES = [
    FlushCase(
        "UDP: the old generation's session is a miss, the packet re-hashed and recorded",
        "udp4",
        "S",
        ev(CONN_GEN_MISS=1, CONN_MISS=1, CONN_INSERT=1, TX=1),
        SessState.UDP,
    ),
    FlushCase(
        "TCP mid-connection: a generation miss as well, recorded as established",
        "tcp6",
        "A",
        ev(CONN_GEN_MISS=1, CONN_MISS=1, CONN_INSERT=1, TX=1),
        SessState.TCP_EST,
    ),
    FlushCase(
        "TCP SYN: never uses a session (no miss counted), recorded in its old way",
        "tcp4",
        "S",
        ev(CONN_MISS=1, CONN_INSERT=1, TX=1),
        SessState.TCP_SYN,
    ),
]


@pytest.mark.parametrize("case", FLUSH_CASES, ids=str)
def test_generation_flush(lb: Lb, case: FlushCase) -> None:
    first = frame(lb, case.vip, sport=41000)
    assert lb.run(first).retval == fx.XDP_TX
    old = only_session(lb, first)
    gen0 = lb.config.conn_gen
    assert old.gen == gen0

    table = lb.table_bytes()
    assert lb.flush() == 1  # the old generation's one session
    assert lb.table_bytes() == table, "the flush wrote into the table"
    assert lb.config.conn_gen == (gen0 + 1) & 0xFFFF
    assert lb.conns.count(gen=lb.config.conn_gen) == 0  # none live ...
    assert only_session(lb, first) == old  # ... though the old one is still there

    after = frame(lb, case.vip, sport=41000, flags=case.flags)
    r, events = run(lb, after)
    assert r.retval == fx.XDP_TX and events == case.events
    new = only_session(lb, after)
    assert (new.set, new.way) == (old.set, old.way)  # the way now holds the new generation
    assert new.gen == lb.config.conn_gen and new.state is case.state
    assert new.flags == abi.SESS_F_USED
    # From now on a plain hit.
    _, events = run(lb, frame(lb, case.vip, sport=41000, flags="A"))
    assert events == ev(CONN_HIT=1, TX=1)


def test_another_flows_old_generation_is_a_free_way(lb: Lb) -> None:
    """A set full of another generation's sessions: a new flow takes a way without an
    eviction and without a generation miss (neither is its session)."""
    frames_ = same_set_frames(lb, abi.CONN_WAYS + 1, "udp4")
    for f in frames_[: abi.CONN_WAYS]:
        assert lb.run(f).retval == fx.XDP_TX
    assert lb.flush() == abi.CONN_WAYS
    r, events = run(lb, frames_[-1])
    assert r.retval == fx.XDP_TX
    assert events == ev(CONN_MISS=1, CONN_INSERT=1, TX=1)
    new = only_session(lb, frames_[-1])
    assert new.gen == lb.config.conn_gen
    gens = Counter(e.gen for e in lb.conns.iter_entries() if e.set == new.set)
    assert gens == {lb.config.conn_gen: 1, (lb.config.conn_gen - 1) & 0xFFFF: 3}


# --- expiry --------------------------------------------------------------------------------

#: Idle timeouts, ticks, by state: UDP, TCP_SYN, TCP_EST, TCP_FIN (each its own).
TIMEOUTS = (1000, 200, 3000, 400)


@dataclasses.dataclass(frozen=True)
class ExpiryCase:
    description: str
    vip: str
    state: SessState
    #: Ticks since the session's last packet when the next one comes.
    age: int
    expired: bool

    def __str__(self) -> str:
        return self.description


EXPIRY_CASES = [
    ExpiryCase("UDP idle 900 of its 1000 ticks: live", "udp4", SessState.UDP, 900, False),
    ExpiryCase("UDP idle 1100, past its 1000: expired", "udp4", SessState.UDP, 1100, True),
    ExpiryCase("TCP_SYN idle 100 of 200: live", "tcp4", SessState.TCP_SYN, 100, False),
    ExpiryCase(
        "TCP_SYN idle 300, past its 200 (where TCP_FIN's 400 would keep it): expired",
        "tcp4",
        SessState.TCP_SYN,
        300,
        True,
    ),
    ExpiryCase("TCP_EST idle 2900 of 3000: live", "tcp6", SessState.TCP_EST, 2900, False),
    ExpiryCase("TCP_EST idle 3100, past its 3000: expired", "tcp6", SessState.TCP_EST, 3100, True),
    ExpiryCase("TCP_FIN idle 300 of 400: live", "tcp4", SessState.TCP_FIN, 300, False),
    ExpiryCase(
        "TCP_FIN idle 500, past its 400 (where UDP's 1000 would keep it): expired",
        "tcp4",
        SessState.TCP_FIN,
        500,
        True,
    ),
]


@pytest.mark.parametrize("case", EXPIRY_CASES, ids=str)
def test_expiry_by_state(lb: Lb, case: ExpiryCase) -> None:
    """A session imported with the given idle time and another backend than the table's:
    live, its packet hits it (and refreshes last_seen); expired, the lookup counts
    CONN_EXPIRED, the packet is re-hashed and its insert takes the same way."""
    lb.update_config(conn_timeouts=TIMEOUTS)
    frm = frame(lb, case.vip, sport=42000, flags="A")
    v = fx.VIPS[case.vip]
    pick, h = fx.pick(frm, v)
    imported = other_backend(frm, case.vip)
    now = now_ticks()
    s = session(key_of(frm), [imported], IMPORTED_HASH, case.state, now - case.age)
    assert imp(lb, s) == [ImportResult.WRITTEN]
    before = only_session(lb, frm)
    assert before.age(now) == case.age and before.state is case.state

    r, events = run(lb, frm)
    after = only_session(lb, frm)
    assert (after.set, after.way) == (before.set, before.way)
    assert after.last_seen - now in range(0, 50)  # stamped at this packet
    if case.expired:
        assert events == ev(CONN_EXPIRED=1, CONN_MISS=1, CONN_INSERT=1, TX=1)
        assert outer_dst(r.data) == fx.BACKENDS[pick].addr
        want_state = SessState.UDP if v.proto == abi.IPPROTO_UDP else SessState.TCP_EST
        assert (after.hops, after.hash, after.state) == ((pick,), h, want_state)
        assert after.flags == abi.SESS_F_USED  # lb_xdp's, no longer the import
    else:
        assert events == ev(CONN_HIT=1, TX=1)
        assert outer_dst(r.data) == fx.BACKENDS[imported].addr
        want_state = SessState.TCP_EST if case.state is SessState.TCP_SYN else case.state
        assert (after.hops, after.hash, after.state) == ((imported,), IMPORTED_HASH, want_state)
        assert after.flags == abi.SESS_F_USED  # used here: this node's now (session sync)
    assert events == model_events_after(case, lb, frm, before, now)


def model_events_after(
    case: ExpiryCase, lb: Lb, frm: bytes, before: Entry, now: int
) -> dict[str, int]:
    """The model's events for the case's packet against the session as it was before."""
    conns = {before.key: dataclasses.replace(_model_entry(before), last_seen=now - case.age)}
    state = dataclasses.replace(model.state_from_snapshot(lb.maps.snapshot(), conns), now=now)
    d = model.decide(state, frm)
    return dict(Counter(e.name for e in d.events) + Counter({"TX": 1}))


def test_a_session_idle_past_a_small_timeout_expires(lb: Lb) -> None:
    """The program's own stamps: with a UDP timeout of 2 ticks, a flow idle 3 ticks is
    a miss (CONN_EXPIRED) and recorded again in its way; a TCP flow with longer
    timeouts is not."""
    lb.update_config(conn_timeouts=(2, 10_000, 10_000, 10_000))
    udp = frame(lb, "udp4", sport=43000)
    tcp = frame(lb, "tcp4", sport=43000)
    for f in (udp, tcp):
        assert lb.run(f).retval == fx.XDP_TX
    first = only_session(lb, udp)
    while now_ticks() - first.last_seen <= 2:
        time.sleep(0.5 / lb.config.hz)
    _, events = run(lb, udp)
    assert events == ev(CONN_EXPIRED=1, CONN_MISS=1, CONN_INSERT=1, TX=1)
    again = only_session(lb, udp)
    assert (again.set, again.way) == (first.set, first.way)
    assert again.last_seen > first.last_seen
    _, events = run(lb, frame(lb, "tcp4", sport=43000, flags="A"))
    assert events == ev(CONN_HIT=1, TX=1)


@dataclasses.dataclass(frozen=True)
class TcpStep:
    flags: str
    state: SessState
    events: dict[str, int]


TCP_LIVES = {
    "SYN, ACK, data, FIN: syn, established, established, closing": [
        TcpStep("S", SessState.TCP_SYN, ev(CONN_MISS=1, CONN_INSERT=1, TX=1)),
        TcpStep("A", SessState.TCP_EST, ev(CONN_HIT=1, TX=1)),
        TcpStep("PA", SessState.TCP_EST, ev(CONN_HIT=1, TX=1)),
        TcpStep("FA", SessState.TCP_FIN, ev(CONN_HIT=1, TX=1)),
        TcpStep("A", SessState.TCP_FIN, ev(CONN_HIT=1, TX=1)),  # closing stays closing
    ],
    "SYN, RST: syn, closing": [
        TcpStep("S", SessState.TCP_SYN, ev(CONN_MISS=1, CONN_INSERT=1, TX=1)),
        TcpStep("R", SessState.TCP_FIN, ev(CONN_HIT=1, TX=1)),
    ],
    "a retransmitted SYN is a new connection: recorded again, syn": [
        TcpStep("S", SessState.TCP_SYN, ev(CONN_MISS=1, CONN_INSERT=1, TX=1)),
        TcpStep("A", SessState.TCP_EST, ev(CONN_HIT=1, TX=1)),
        TcpStep("S", SessState.TCP_SYN, ev(CONN_MISS=1, CONN_INSERT=1, TX=1)),
    ],
    "met mid-connection: established, then FIN: closing": [
        TcpStep("A", SessState.TCP_EST, ev(CONN_MISS=1, CONN_INSERT=1, TX=1)),
        TcpStep("FA", SessState.TCP_FIN, ev(CONN_HIT=1, TX=1)),
    ],
}


@pytest.mark.parametrize("life", list(TCP_LIVES), ids=str)
def test_tcp_state_follows_the_connection(lb: Lb, life: str) -> None:
    """Each packet's state read back from the table, each step as the model says, the
    session staying in its one way."""
    where = None
    for step in TCP_LIVES[life]:
        frm = frame(lb, "tcp4", sport=44000, flags=step.flags)
        want = model_events(lb, frm)
        r, events = run(lb, frm)
        assert r.retval == fx.XDP_TX
        assert events == step.events == want, step
        s = only_session(lb, frm)
        assert s.state is step.state, step
        where = where or (s.set, s.way)
        assert (s.set, s.way) == where


# --- the export stream ------------------------------------------------------------------------

#: Bytes a record takes in the ring: its 8-byte header, the record, rounded to 8.
RING_RECORD = (8 + len(bytes(abi.ExportRec())) + 7) & ~7
RING_CAPACITY = abi.EXPORT_RING_SIZE // RING_RECORD


@pytest.fixture
def export(lb: Lb) -> Iterator[SessionExport]:
    """lb_config with CFG_F_EXPORT, and the consumer side of lb_sess_export, emptied."""
    ring = SessionExport(lb.obj.map("lb_sess_export"))
    ring.skip()
    lb.update_config(flags=lb.config.flags | abi.CFG_F_EXPORT)
    try:
        yield ring
    finally:
        ring.skip()
        ring.close()


def records(ring: SessionExport) -> list[abi.ExportRec]:
    return [abi.ExportRec.from_buffer_copy(r.tobytes()) for r in ring.drain_records()]


def rec_key(r: abi.ExportRec) -> bytes:
    e = r.sess.entry
    return abi.FlowKey(e.src, e.dst, e.sport, e.dport, e.proto).pack()


def test_every_insert_is_exported_once_and_every_state_change_as_an_update(
    lb: Lb, export: SessionExport
) -> None:
    flows: dict[bytes, list[str]] = {}  # key -> the frames' flags, in order
    before = lb.counters()
    for i in range(12):
        for vip in ("udp4", "udp6"):
            u = frame(lb, vip, sport=45000 + i)
            for _ in range(2):  # a new flow, then a hit (no record)
                assert lb.run(u).retval == fx.XDP_TX
            flows[key_of(u)] = ["", ""]
        for vip in ("tcp4", "tcp6"):
            seq = ["S", "A", "PA", "FA"]  # NEW, UPDATE (est), nothing, UPDATE (closing)
            for flags in seq:
                assert lb.run(frame(lb, vip, sport=45000 + i, flags=flags)).retval == fx.XDP_TX
            flows[key_of(frame(lb, vip, sport=45000 + i))] = seq
    got = records(export)
    delta = (lb.counters() - before).named()["events"]
    assert isinstance(delta, dict)
    assert delta["CONN_INSERT"] == len(flows) and "EXPORT_DROP" not in delta

    by_key: dict[bytes, list[abi.ExportRec]] = {}
    for r in got:
        by_key.setdefault(rec_key(r), []).append(r)
    assert by_key.keys() == flows.keys()
    for key, recs in by_key.items():
        s = lb.conns.get(key, lb.config.seed)
        assert s is not None
        tcp = key[36] == abi.IPPROTO_TCP
        types = [abi.ExportType(r.type) for r in recs]
        states = [SessState(r.sess.state) for r in recs]
        if tcp:
            assert types == [abi.ExportType.NEW, abi.ExportType.UPDATE, abi.ExportType.UPDATE]
            assert states == [SessState.TCP_SYN, SessState.TCP_EST, SessState.TCP_FIN]
        else:
            assert types == [abi.ExportType.NEW] and states == [SessState.UDP]
        for r in recs:
            # Where, and what: the session as the table holds it.
            assert (r.set, r.way) == (s.set, s.way)
            assert r.sess.entry.hop[0] == s.backend_id and r.sess.entry.hash == s.hash
            assert r.sess.gen == lb.config.conn_gen and r.sess.flags == abi.SESS_F_USED
    assert sum(1 for r in got if r.type == abi.ExportType.NEW) == len(flows)

    # Export off: nothing more is written.
    lb.update_config(flags=lb.config.flags & ~abi.CFG_F_EXPORT)
    assert lb.run(frame(lb, "udp4", sport=45999)).retval == fx.XDP_TX
    assert records(export) == []


def test_a_full_export_ring_counts_its_drops_and_blocks_nothing(
    lb: Lb, export: SessionExport
) -> None:
    """4 MiB of 96-byte slots: the first RING_CAPACITY inserts are kept, the rest counted
    EXPORT_DROP; every packet is still forwarded and every session still recorded. Once
    drained, the ring takes records again."""
    assert export.capacity == RING_CAPACITY
    n = RING_CAPACITY + 300
    dst = fx.VIPS["udp4"].addr
    flows = [
        model.Flow(ipaddress.IPv4Address(0xC6128000 + i // 1000), dst, 10000 + i % 1000, 53, 17)
        for i in range(n)
    ]
    before = lb.counters()
    forwarded = sum(lb.run(frames.frame(f, b"x")).retval == fx.XDP_TX for f in flows)
    delta = (lb.counters() - before).named()["events"]
    assert isinstance(delta, dict)
    assert forwarded == n
    assert {k: v for k, v in delta.items() if k != "CONN_EVICT"} == ev(
        CONN_MISS=n, CONN_INSERT=n, TX=n, EXPORT_DROP=n - RING_CAPACITY
    )
    got = records(export)
    assert len(got) == RING_CAPACITY
    # The oldest are kept: the records are the first flows', in order.
    assert [rec_key(r) for r in got] == [f.key() for f in flows[:RING_CAPACITY]]
    assert all(r.type == abi.ExportType.NEW for r in got)
    for f in (flows[0], flows[-1]):
        assert lb.conns.get(f.key(), lb.config.seed) is not None

    one = frame(lb, "udp4", sport=999, src=ipaddress.ip_address("198.18.99.1"))
    _, events = run(lb, one)
    assert events == ev(CONN_MISS=1, CONN_INSERT=1, TX=1)
    assert [rec_key(r) for r in records(export)] == [key_of(one)]


# --- import -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ImportCase:
    description: str
    vip: str
    #: What the flow has before the import: nothing, a session lb_xdp recorded from a
    #: SYN / UDP packet, or one imported already and idle past its timeout.
    before: str
    #: The imported session's backend: "other" (not the table's pick) or a backend id.
    backend: str | int
    replace: bool
    result: ImportResult
    #: TCP flags of the next packet.
    flags: str
    events: dict[str, int]
    #: Where the next packet goes: "imported", "recorded" (what lb_xdp had) or "table".
    goes: str

    def __str__(self) -> str:
        return self.description


HIT = ev(CONN_HIT=1, TX=1)
IMPORT_CASES = [
    ImportCase(
        "UDP flow unknown here: the imported backend takes its next packet",
        "udp4", "none", "other", False, ImportResult.WRITTEN, "S", HIT, "imported",
    ),
    ImportCase(
        "TCP mid-connection: an ACK hits the imported session",
        "tcp6", "none", "other", False, ImportResult.WRITTEN, "A", HIT, "imported",
    ),
    ImportCase(
        "a SYN of an imported flow's 5-tuple follows the table",
        "tcp4", "none", "other", False, ImportResult.WRITTEN, "S",
        ev(CONN_MISS=1, CONN_INSERT=1, TX=1), "table",
    ),
    ImportCase(
        "a live session lb_xdp recorded is kept without replace (PRESENT)",
        "udp4", "recorded", "other", False, ImportResult.PRESENT, "S", HIT, "recorded",
    ),
    ImportCase(
        "... and overwritten with replace (REPLACED)",
        "udp4", "recorded", "other", True, ImportResult.REPLACED, "S", HIT, "imported",
    ),
    ImportCase(
        "TCP: the same with replace, the ACK goes to the imported backend",
        "tcp4", "recorded", "other", True, ImportResult.REPLACED, "A", HIT, "imported",
    ),
    ImportCase(
        "the flow's expired session is replaced without asking",
        "udp4", "expired", "other", False, ImportResult.REPLACED, "S", HIT, "imported",
    ),
    ImportCase(
        "an imported UDP session whose backend is no member of the VIP is stale",
        "udp4", "none", 7, False, ImportResult.WRITTEN, "S",
        ev(CONN_STALE=1, CONN_MISS=1, CONN_INSERT=1, TX=1), "table",
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", IMPORT_CASES, ids=str)
def test_import(lb: Lb, case: ImportCase) -> None:
    first = frame(lb, case.vip, sport=46000)
    v = fx.VIPS[case.vip]
    pick, h = fx.pick(first, v)
    backend = other_backend(first, case.vip) if case.backend == "other" else int(case.backend)
    if case.before == "recorded":
        assert lb.run(first).retval == fx.XDP_TX
    elif case.before == "expired":
        old = session(key_of(first), [pick], 7, SessState.UDP, now_ticks() - 10**6)
        assert imp(lb, old) == [ImportResult.WRITTEN]
    recorded = lb.conn(first)
    st = SessState.UDP if v.proto == abi.IPPROTO_UDP else SessState.TCP_EST
    s = session(key_of(first), [backend], IMPORTED_HASH, st, now_ticks())
    assert imp(lb, s, replace=case.replace) == [case.result]
    held = only_session(lb, first)
    if case.result is ImportResult.PRESENT:
        assert held == recorded
    else:
        assert (held.hops, held.hash, held.state) == ((backend,), IMPORTED_HASH, st)
        assert held.flags == abi.SESS_F_USED | abi.SESS_F_IMPORTED
        if recorded is not None:
            assert (held.set, held.way) == (recorded.set, recorded.way)

    nxt = frame(lb, case.vip, sport=46000, flags=case.flags)
    want = model_events(lb, nxt)
    r, events = run(lb, nxt)
    assert events == case.events == want
    goes = {"imported": backend, "recorded": pick, "table": pick}[case.goes]
    be = fx.BACKENDS[goes]
    assert outer_dst(r.data) == be.addr
    if case.goes == "imported":
        # Byte for byte: the imported backend, the imported hash as GUE source port.
        assert be.mac is not None
        assert r.data == fx.encapsulated(
            nxt, v, be, IMPORTED_HASH, eth_dst=be.mac, eth_src=lb.env.lb_mac
        )
    after = only_session(lb, nxt)
    assert after.backend_id == goes
    assert after.hash == (IMPORTED_HASH if case.goes == "imported" else h)


# --- every counter ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CounterCase:
    description: str
    #: Sets the scene; returns the frame whose packet is counted.
    prepare: Callable[[Lb], bytes]
    events: dict[str, int]
    #: The state the packet leaves (lb, the frame, the session it had before).
    check: Callable[[Lb, bytes, Entry | None], None]
    #: Hold the frame's set (a writer in the middle of a write) while it runs.
    hold: bool = False
    #: True if only timing undid the scene (a loaded machine let a 100 ms window
    #: pass): prepare and run again, with another flow.
    too_late: Callable[[Lb], bool] | None = None

    def __str__(self) -> str:
        return self.description


def _udp(lb: Lb, sport: int = 47000) -> bytes:
    return frame(lb, "udp4", sport=sport)


def _known(lb: Lb) -> bytes:
    f = _udp(lb)
    assert lb.run(f).retval == fx.XDP_TX
    return f


def _check_hit(lb: Lb, f: bytes, before: Entry | None) -> None:
    after = only_session(lb, f)
    assert before is not None and dataclasses.replace(after, last_seen=0) == (
        dataclasses.replace(before, last_seen=0)
    )
    assert after.last_seen >= before.last_seen


def _check_recorded(lb: Lb, f: bytes, before: Entry | None) -> None:
    after = only_session(lb, f)
    assert before is None and after.hops == (fx.pick(f, fx.VIPS["udp4"])[0],)


def _check_nothing(lb: Lb, f: bytes, before: Entry | None) -> None:
    assert before is None and lb.conn(f) is None


_flood_sport = iter(range(47100, 47200))


def _flood(lb: Lb) -> bytes:
    """A budget of one insert a window, used up by a window opened 10 ms ago on every
    CPU (bpf_ktime_get_coarse_ns lags CLOCK_MONOTONIC by a tick at most)."""
    lb.update_config(flood_max=1)
    flood = lb.obj.map("lb_flood")
    window = struct.pack("<QQ", time.monotonic_ns() - 10_000_000, 1)
    flood.update(bytes(4), window * (flood.value_stride // len(window)))
    return _udp(lb, next(_flood_sport))


def _window_restarted(lb: Lb) -> bool:
    """lb_under_flood found the window over (100 ms passed) and opened a new one."""
    return any(
        struct.unpack_from("<Q", v, 8)[0] == 1
        for v in lb.obj.map("lb_flood").lookup_percpu(bytes(4))
    )


def _full_set(lb: Lb, expired: int | None = None) -> bytes:
    """Four sessions in the set of a fifth flow, idle 40, 30, 20, 10 ticks (one of them,
    ``expired``, idle past the UDP timeout instead: imported last, since an import takes
    an expired way as a free one); returns the fifth's frame."""
    fs = same_set_frames(lb, abi.CONN_WAYS + 1, "udp4")
    now = now_ticks()
    tmo = lb.config.conn_timeouts[SessState.UDP]
    order = sorted(range(abi.CONN_WAYS), key=lambda i: i == expired)
    for i in order:
        f = fs[i]
        age = tmo + 100 if i == expired else 40 - 10 * i
        s = session(key_of(f), [fx.pick(f, fx.VIPS["udp4"])[0]], 1, SessState.UDP, now - age)
        assert imp(lb, s) == [ImportResult.WRITTEN]
    assert all(lb.conn(f) is not None for f in fs[: abi.CONN_WAYS])
    return fs[-1]


def _check_replaced(victim: int) -> Callable[[Lb, bytes, Entry | None], None]:
    def check(lb: Lb, f: bytes, before: Entry | None) -> None:
        fs = same_set_frames(lb, abi.CONN_WAYS + 1, "udp4")
        assert [lb.conn(g) is not None for g in fs] == [
            i != victim for i in range(abi.CONN_WAYS)
        ] + [True]

    return check


def _expired_own(lb: Lb) -> bytes:
    f = _udp(lb)
    pick, _ = fx.pick(f, fx.VIPS["udp4"])
    old = session(key_of(f), [pick], 1, SessState.UDP, now_ticks() - 10**6)
    assert imp(lb, old) == [ImportResult.WRITTEN]
    return f


def _check_same_way(lb: Lb, f: bytes, before: Entry | None) -> None:
    after = only_session(lb, f)
    assert before is not None and (after.set, after.way) == (before.set, before.way)
    assert after.last_seen != before.last_seen and after.flags == abi.SESS_F_USED


def _flushed(lb: Lb) -> bytes:
    f = _known(lb)
    lb.flush()
    return f


def _check_new_gen(lb: Lb, f: bytes, before: Entry | None) -> None:
    _check_same_way(lb, f, before)
    assert before is not None and only_session(lb, f).gen == (before.gen + 1) & 0xFFFF


def _left_the_vip(lb: Lb) -> bytes:
    f = _known(lb)
    s = lb.conn(f)
    assert s is not None
    v = fx.VIPS["udp4"]
    assert v.backends is not None
    lb.set_table(v.id, [b for b in v.backends if b != s.backend_id])
    return f


def _check_moved(lb: Lb, f: bytes, before: Entry | None) -> None:
    after = only_session(lb, f)
    assert before is not None and (after.set, after.way) == (before.set, before.way)
    assert after.backend_id != before.backend_id


COUNTER_CASES = [
    CounterCase("CONN_HIT: a live session gives the backend", _known, HIT, _check_hit),
    CounterCase(
        "CONN_MISS, CONN_INSERT: a new flow is hashed and recorded",
        _udp,
        ev(CONN_MISS=1, CONN_INSERT=1, TX=1),
        _check_recorded,
    ),
    CounterCase(
        "CONN_BUSY: the set is held through every read and at the insert (test-only hold "
        "from user space): balanced by the table, nothing recorded, counted once",
        _udp,
        ev(CONN_BUSY=1, CONN_MISS=1, TX=1),
        _check_nothing,
        hold=True,
    ),
    CounterCase(
        "CONN_FLOOD: over the insert budget, balanced but not recorded",
        _flood,
        ev(CONN_MISS=1, CONN_FLOOD=1, TX=1),
        _check_nothing,
        too_late=_window_restarted,
    ),
    CounterCase(
        "CONN_EVICT: a full set of live sessions loses the one idle longest",
        _full_set,
        ev(CONN_MISS=1, CONN_INSERT=1, CONN_EVICT=1, TX=1),
        _check_replaced(0),
    ),
    CounterCase(
        "CONN_EXPIRED at the insert: another flow's expired way is taken, nothing evicted",
        lambda lb: _full_set(lb, expired=2),
        ev(CONN_MISS=1, CONN_INSERT=1, CONN_EXPIRED=1, TX=1),
        _check_replaced(2),
    ),
    CounterCase(
        "CONN_EXPIRED at the lookup: the flow's own session idle too long",
        _expired_own,
        ev(CONN_EXPIRED=1, CONN_MISS=1, CONN_INSERT=1, TX=1),
        _check_same_way,
    ),
    CounterCase(
        "CONN_GEN_MISS: the flow's session is of the generation before the flush",
        _flushed,
        ev(CONN_GEN_MISS=1, CONN_MISS=1, CONN_INSERT=1, TX=1),
        _check_new_gen,
    ),
    CounterCase(
        "CONN_STALE: a UDP session whose backend left the VIP (table and members)",
        _left_the_vip,
        ev(CONN_STALE=1, CONN_MISS=1, CONN_INSERT=1, TX=1),
        _check_moved,
    ),
]


@pytest.mark.parametrize("case", COUNTER_CASES, ids=str)
def test_every_outcome_is_counted(lb: Lb, one_cpu: None, case: CounterCase) -> None:
    for _attempt in range(5):
        f = case.prepare(lb)
        before = lb.conn(f)
        if case.hold:
            with lb.holding(lb.set_of(f)):
                r, events = run(lb, f)
        else:
            r, events = run(lb, f)
        if case.too_late is None or not case.too_late(lb):
            break
    assert r.retval == fx.XDP_TX
    assert events == case.events
    case.check(lb, f, before)


# --- liveness per VIP, through the planner ----------------------------------------------------

VA = "198.19.2.1"
VB = "198.19.2.2"
B1, B2, B3 = (fx.BACKENDS[i].addr for i in (1, 2, 3))
TUNNEL = {"source_v4": str(fx.LB_SRC4), "source_v6": str(fx.LB_SRC6)}


def lab_config(b2: dict[str, Any] | None, *, shared: bool, **extra: Any) -> Config:
    """VIP A (UDP 53 and TCP 80 on one address) with backends 1-3, ``b2`` being backend
    2's entry (None: not a backend of A); with ``shared``, VIP B (UDP 53 on another
    address) has backend 2 alone."""
    backends = [{"address": str(B1)}, {"address": str(B3)}]
    if b2 is not None:
        backends.insert(1, {"address": str(B2), **b2})
    vips: list[dict[str, Any]] = [
        {"address": VA, "port": 53, "protocol": "udp", "backends": backends},
        {"address": VA, "port": 80, "protocol": "tcp", "backends": backends},
    ]
    if shared:
        vips.append(
            {"address": VB, "port": 53, "protocol": "udp", "backends": [{"address": str(B2)}]}
        )
    return parse_config(
        {"instance": "lbtest", "tunnel": TUNNEL, "hash_seed": fx.SEED, "vips": vips, **extra}
    )


A_NAMES = (f"{VA}:53/udp", f"{VA}:80/tcp")

Change = Callable[[bool], tuple[Config, dict[str, dict[IPAddress, abi.MemberState]]]]


def _removed(shared: bool) -> tuple[Config, dict[str, dict[IPAddress, abi.MemberState]]]:
    return lab_config(None, shared=shared), {}


def _weight0(shared: bool) -> tuple[Config, dict[str, dict[IPAddress, abi.MemberState]]]:
    return lab_config({"weight": 0}, shared=shared), {}


def _drained(shared: bool) -> tuple[Config, dict[str, dict[IPAddress, abi.MemberState]]]:
    eff = effective(
        lab_config({}, shared=shared), Overlay(drained=frozenset((n, B2) for n in A_NAMES)), {}
    )
    return eff.config, eff.members


def _down(shared: bool) -> tuple[Config, dict[str, dict[IPAddress, abi.MemberState]]]:
    eff = effective(
        lab_config({}, shared=shared), Overlay(down=frozenset((n, B2) for n in A_NAMES)), {}
    )
    assert eff.members == {n: {B2: abi.MemberState.DOWN} for n in A_NAMES}
    return eff.config, eff.members


@dataclasses.dataclass(frozen=True)
class LivenessCase:
    description: str
    change: Change
    #: Backend 2's state in VIP A afterwards (lb_members).
    member: abi.MemberState
    #: Its UDP flows: "kept" (until idle) or "moved" (re-hashed at once).
    udp: str

    def __str__(self) -> str:
        return self.description


LIVENESS_CASES = [
    LivenessCase(
        "removed from the VIP: its UDP flows re-hash", _removed, abi.MemberState.NONE, "moved"
    ),
    LivenessCase(
        "weight 0 in the configuration: draining, its UDP flows stay",
        _weight0,
        abi.MemberState.DRAINING,
        "kept",
    ),
    LivenessCase(
        "drained by an operator (overlay): its UDP flows stay",
        _drained,
        abi.MemberState.DRAINING,
        "kept",
    ),
    LivenessCase(
        "down (health check, members DOWN): its UDP flows re-hash at once",
        _down,
        abi.MemberState.DOWN,
        "moved",
    ),
]


def _flows_on(lb: Lb, backend_id: int, proto: int, port: int, n: int) -> list[model.Flow]:
    """n flows to VIP A whose table sends them to backend_id (the model's prediction)."""
    state = model.state_from_snapshot(lb.maps.snapshot())
    out: list[model.Flow] = []
    client = ipaddress.IPv4Address("198.18.5.1")
    for sport in range(20000, 30000):
        f = model.Flow(client, ipaddress.IPv4Address(VA), sport, port, proto)
        if model.predict_backend(state, f) == backend_id:
            out.append(f)
            if len(out) == n:
                return out
    raise AssertionError("no flows on the backend")


def _send(lb: Lb, f: model.Flow, flags: int) -> tuple[TestRunResult, dict[str, int]]:
    return run(lb, frames.frame(f, b"data", tcp_flags=flags))


SYN, ACK = 0x02, 0x10


@pytest.mark.parametrize("shared", [False, True], ids=["b2-only-in-A", "b2-also-serves-B"])
@pytest.mark.parametrize("case", LIVENESS_CASES, ids=str)
def test_liveness_per_vip(lb: Lb, case: LivenessCase, shared: bool) -> None:
    """Issue 11: an entry whose backend has left this VIP's table is stale for UDP and for
    a TCP SYN; a drained backend keeps its established TCP connections and its UDP flows
    until they go idle; a backend that is down loses its UDP flows at once. The same
    whether or not backend 2's address still serves VIP B (the old code's answer
    depended on it)."""
    lb.plan(lab_config({}, shared=shared))
    snap = lb.maps.snapshot()
    ids = {b.addr: i for i, b in snap.backends.items() if b.active}
    b2 = ids[B2]
    udp = _flows_on(lb, b2, abi.IPPROTO_UDP, 53, 3)
    tcp = _flows_on(lb, b2, abi.IPPROTO_TCP, 80, 3)
    for f in udp:
        r, _ = _send(lb, f, 0)
        assert outer_dst(r.data) == B2
    for f in tcp:
        for flags in (SYN, ACK):
            r, _ = _send(lb, f, flags)
            assert outer_dst(r.data) == B2
        assert lb.conns.get(f.key(), lb.config.seed).state is SessState.TCP_EST  # type: ignore[union-attr]

    cfg, members = case.change(shared)
    lb.plan(cfg, members=members)
    snap = lb.maps.snapshot()
    vid = {(v.port, v.proto): p.vip_id for v, p in snap.vips.items() if str(v.addr) == VA}
    for port, proto in ((53, abi.IPPROTO_UDP), (80, abi.IPPROTO_TCP)):
        assert snap.members[vid[port, proto]].get(b2, abi.MemberState.NONE) is case.member
    # Backend 2's slot: still active where it serves VIP B, else retired (inactive).
    assert snap.backends[b2].active is (shared or case.member is not abi.MemberState.NONE)
    assert snap.backends[b2].addr == B2

    for f in udp:
        frm = frames.frame(f, b"data", tcp_flags=0)
        want = model_events(lb, frm)
        r, events = run(lb, frm)
        assert events == want
        s = lb.conns.get(f.key(), lb.config.seed)
        assert s is not None
        if case.udp == "kept":
            assert events == HIT and outer_dst(r.data) == B2 and s.backend_id == b2
        else:
            assert events == ev(CONN_STALE=1, CONN_MISS=1, CONN_INSERT=1, TX=1)
            assert outer_dst(r.data) != B2 and s.backend_id != b2
            assert outer_dst(r.data) == snap.backends[s.backend_id].addr
    for f in tcp:
        # An established connection keeps its backend, whatever happened to it ...
        ack = frames.frame(f, b"data", tcp_flags=ACK)
        assert model_events(lb, ack) == HIT
        r, events = run(lb, ack)
        assert events == HIT and outer_dst(r.data) == B2
        # ... while a SYN of the same 5-tuple (a reused port) follows the table.
        syn = frames.frame(f, b"data", tcp_flags=SYN)
        r, events = run(lb, syn)
        assert events == ev(CONN_MISS=1, CONN_INSERT=1, TX=1)
        s = lb.conns.get(f.key(), lb.config.seed)
        assert s is not None and s.state is SessState.TCP_SYN
        assert s.backend_id != b2 and outer_dst(r.data) == snap.backends[s.backend_id].addr


def test_a_drained_backend_keeps_its_udp_flows_until_they_go_idle(lb: Lb) -> None:
    """Weight 0: a UDP flow on backend 2 hits it while it keeps talking; idle past the
    UDP timeout (its session aged by re-importing it), it expires and re-hashes."""
    lb.plan(lab_config({}, shared=False))
    b2 = next(i for i, b in lb.maps.snapshot().backends.items() if b.addr == B2 and b.active)
    (f,) = _flows_on(lb, b2, abi.IPPROTO_UDP, 53, 1)
    _send(lb, f, 0)
    lb.plan(lab_config({"weight": 0}, shared=False))
    for _ in range(3):
        r, events = _send(lb, f, 0)
        assert events == HIT and outer_dst(r.data) == B2
    s = lb.conns.get(f.key(), lb.config.seed)
    assert s is not None
    tmo = lb.config.conn_timeouts[SessState.UDP]
    idle = session(f.key(), [b2], s.hash, SessState.UDP, now_ticks() - tmo - 10, be_gen=s.be_gen)
    assert imp(lb, idle, replace=True) == [ImportResult.REPLACED]
    r, events = _send(lb, f, 0)
    assert events == ev(CONN_EXPIRED=1, CONN_MISS=1, CONN_INSERT=1, TX=1)
    s = lb.conns.get(f.key(), lb.config.seed)
    assert s is not None and s.backend_id != b2 and outer_dst(r.data) != B2


def test_a_slot_given_to_another_address_makes_old_sessions_stale(lb: Lb) -> None:
    """Backend 2 leaves; its slot is retired (inactive, its TCP sessions still reach its
    address); then a new address takes the slot (limits leave no never-used slot) and
    the planner bumps the slot's gen: the old sessions name someone else's slot, so
    even TCP ones are stale and re-hash."""
    limits = {"limits": {"backends": 12}}  # the lab's 11 slots: none never used
    lb.plan(lab_config({}, shared=False, **limits))
    b2 = next(i for i, b in lb.maps.snapshot().backends.items() if b.addr == B2 and b.active)
    tcp = _flows_on(lb, b2, abi.IPPROTO_TCP, 80, 3)
    for f in tcp:
        for flags in (SYN, ACK):
            _send(lb, f, flags)
    lb.plan(lab_config(None, shared=False, **limits))
    assert lb.maps.snapshot().backends[b2] == BackendState(B2, False, 0)
    for f in tcp:
        r, events = _send(lb, f, ACK)
        assert events == HIT and outer_dst(r.data) == B2  # a retired slot: still reached

    newcomer = ipaddress.IPv4Address("198.18.0.16")
    cfg = lab_config({"address": str(newcomer)}, shared=False, **limits)
    assert cfg.backend_addresses() == {B1, B3, newcomer}
    lb.plan(cfg)
    snap = lb.maps.snapshot()
    assert snap.backends[b2] == BackendState(newcomer, True, 1)
    for f in tcp:
        frm = frames.frame(f, b"data", tcp_flags=ACK)
        want = model_events(lb, frm)
        before = lb.counters()
        r = lb.run(frm)
        events = (lb.counters() - before).named()["events"]
        assert isinstance(events, dict)
        # Forwarded by the table; the newcomer (slot 2 again) has no neighbour: FIB_PASS.
        fib = {k: v for k, v in events.items() if k in ("TX", "FIB_PASS")}
        rest = {k: v for k, v in events.items() if k not in fib}
        assert rest == ev(CONN_STALE=1, CONN_MISS=1, CONN_INSERT=1)
        assert sum(fib.values()) == 1
        assert {k: v for k, v in want.items() if k != "TX"} == rest
        s = lb.conns.get(f.key(), lb.config.seed)
        assert s is not None and s.be_gen == snap.backends[s.backend_id].gen
        assert outer_dst(r.data) != B2


# --- Beamer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("vip", ["beamer", "beamer4", "beamer_skip", "beamer6"])
def test_beamer_mid_connection_flow_keeps_its_hop_list(lb: Lb, vip: str) -> None:
    """A TCP packet of a connection lb_xdp has not seen is recorded with the bucket's
    usable later hops; the next packet, a hit, leaves with the same GUE hop list (the
    same bytes). An imported Beamer session's hops are used the same way."""
    v = fx.VIPS[vip]
    ack = frame(lb, vip, sport=48000, flags="A")
    hops = fx.beamer_hops(ack, v)
    r, events = run(lb, ack)
    assert events == ev(CONN_MISS=1, CONN_INSERT=1, TX=1)
    assert gue_hops(r.data) == [b.addr for b in hops]
    s = only_session(lb, ack)
    assert s.hops == tuple(b.id for b in hops) and s.state is SessState.TCP_EST
    r2, events = run(lb, ack)
    assert events == HIT and r2.data == r.data

    other = frame(lb, vip, sport=48001, flags="A")
    first = fx.beamer_hops(other, v)[0]
    later = [b.id for b in fx.beamer_hops(other, v)[1:]][::-1]  # not the bucket's order
    imported = session(
        key_of(other), [first.id, *later], IMPORTED_HASH, SessState.TCP_EST, now_ticks()
    )
    assert imp(lb, imported) == [ImportResult.WRITTEN]
    r, events = run(lb, other)
    assert events == HIT
    assert gue_hops(r.data) == [first.addr, *(fx.BACKENDS[i].addr for i in later)]


# --- the echo reply's checksum ----------------------------------------------------------------


def test_an_all_zero_echo_request_gets_checksum_0xffff(lb: Lb) -> None:
    """Issue 11: id 0, seq 0, no payload. The reply's ICMP header is all zero but its
    checksum, which must then be 0xffff (RFC 1624: csum_replace16 may not leave 0x0000,
    which receivers reject). The model builds the same bytes."""
    vip = fx.VIPS["tcp4"].addr
    lb.set_vip_addrs(echo=[vip])
    req = bytes(
        Ether(dst=lb.env.lb_mac, src=fx.CLIENT_MAC)
        / IP(src=str(fx.CLIENT4), dst=str(vip), ttl=61, id=5)
        / ICMP(type=8, code=0, id=0, seq=0)
    )
    assert req[14 + 20 + 2 : 14 + 20 + 4] == b"\xf7\xff"  # the request's own checksum
    r, events = run(lb, req)
    assert r.retval == fx.XDP_TX and events == ev(ICMP_ECHO=1)
    icmp = r.data[14 + 20 :]
    assert icmp == b"\x00\x00\xff\xff\x00\x00\x00\x00"
    total = sum(struct.unpack("!4H", icmp))
    assert (total & 0xFFFF) + (total >> 16) == 0xFFFF  # verifies: the sum is all ones
    want = bytes(
        Ether(dst=fx.CLIENT_MAC, src=lb.env.lb_mac)
        / IP(src=str(vip), dst=str(fx.CLIENT4), ttl=64, id=5)
        / ICMP(type=0, code=0, id=0, seq=0)
        / Raw(b"")
    )
    assert r.data == want
    d = model.decide(model.state_from_snapshot(lb.maps.snapshot()), req)
    assert d.outcome is model.Outcome.REPLY and d.packet == r.data


# --- the VIP filter -------------------------------------------------------------------------


def test_a_destination_outside_the_filter_passes_before_anything_is_read(lb: Lb) -> None:
    """tcp4's address has a VIP in lb_vips and lb_vip_index, and a global ACL denies the
    client; with the address's filter bit clear the packet passes PASS_NOT_VIP and
    nothing else moves (no ACL hit, no drop, no session): neither the ACL (step 2a) nor
    the VIP index (step 6) was read. With the bit set, the ACL drops it."""
    vip = fx.VIPS["tcp4"].addr
    rule = AclKey(abi.ACL_GLOBAL, ipaddress.ip_network("198.18.5.0/24"))
    lb.obj.map(rule.map_name).update(rule.abi_key().pack(), rule_value(abi.AclList.DENY))
    try:
        lb.update_config(flags=abi.CFG_F_ACL)
        bit = hashing.addr_filter_bit(vip.packed)
        others = {v.addr for v in fx.VIPS.values()} - {vip}
        assert bit not in filter_bits(others), "another fixture VIP shares tcp4's bit"
        lb.set_vip_filter(others)
        f = frame(lb, "tcp4", sport=49000)
        before = lb.counters()
        r = lb.run(f)
        delta = lb.counters() - before
        assert r.retval == fx.XDP_PASS and r.data == f
        assert delta.named() == {
            "events": {"PASS_NOT_VIP": 1},
            "drops": {},
            "vip_stats": {},
            "be_stats": {},
        }
        assert lb.conn(f) is None
        assert model_events(lb, f) == {"PASS_NOT_VIP": 1}

        lb.set_vip_filter({v.addr for v in fx.VIPS.values()})
        before = lb.counters()
        assert lb.run(f).retval == fx.XDP_DROP
        assert (lb.counters() - before).named()["drops"] == {"ACL": 1}
    finally:
        lb.obj.map(rule.map_name).delete(rule.abi_key().pack())


def _sharing_address(addr: ipaddress.IPv4Address) -> ipaddress.IPv4Address:
    """Another address with ``addr``'s filter bit. Within a /16 every address has its own
    (the varying bytes are the top of the word multiplied by an odd constant), so the
    search runs over 198.18.0.0/15."""
    bit = hashing.addr_filter_bit(addr.packed)
    base = int(ipaddress.IPv4Address("198.18.0.0"))
    for i in range(1 << 17):
        cand = ipaddress.IPv4Address(base + i)
        if cand != addr and hashing.addr_filter_bit(cand.packed) == bit:
            return cand
    raise AssertionError("no address shares the bit")


def _filter_config(addrs: list[ipaddress.IPv4Address]) -> Config:
    vips = [{"address": str(a), "port": 80, "backends": [{"address": str(B1)}]} for a in addrs]
    return parse_config({"instance": "lbtest", "tunnel": TUNNEL, "vips": vips})


def _filter(lb: Lb) -> frozenset[int]:
    return lb.maps.snapshot().vip_filter


def test_the_planner_keeps_the_filter_exact(lb: Lb) -> None:
    """SetVipFilter: a VIP added has its bit set before its VIP is written (never a
    window where the VIP is unreachable); a VIP removed has its bit cleared after its
    VIP is deleted, unless another VIP's address shares the bit."""
    a, b, c = (ipaddress.IPv4Address(x) for x in ("198.19.3.1", "198.19.3.2", "198.19.3.3"))
    d = _sharing_address(b)
    assert len({hashing.addr_filter_bit(x.packed) for x in (a, b, c)}) == 3
    assert hashing.addr_filter_bit(d.packed) not in filter_bits([a, c])

    lb.plan(_filter_config([a, b]))
    assert _filter(lb) == filter_bits([a, b])

    ops = lb.plan(_filter_config([a, b, c]))
    assert _filter(lb) == filter_bits([a, b, c])
    sets = [i for i, op in enumerate(ops) if isinstance(op, mapops.SetVipFilter)]
    puts = [i for i, op in enumerate(ops) if isinstance(op, mapops.PutVip) and op.vip.addr == c]
    assert len(sets) == 1 and puts and sets[0] < puts[0]
    flow_c = model.Flow(fx.CLIENT4, c, 40000, 80, abi.IPPROTO_TCP)  # type: ignore[arg-type]
    r, events = run(lb, frames.frame(flow_c))
    assert events == ev(CONN_MISS=1, CONN_INSERT=1, TX=1)

    ops = lb.plan(_filter_config([a, c]))
    assert _filter(lb) == filter_bits([a, c])
    assert hashing.addr_filter_bit(b.packed) not in _filter(lb)
    sets = [i for i, op in enumerate(ops) if isinstance(op, mapops.SetVipFilter)]
    dels = [i for i, op in enumerate(ops) if isinstance(op, mapops.DeleteVip)]
    assert len(sets) == 1 and dels and dels[-1] < sets[0]
    flow_b = model.Flow(fx.CLIENT4, b, 40000, 80, abi.IPPROTO_TCP)  # type: ignore[arg-type]
    r, events = run(lb, frames.frame(flow_b))
    assert r.retval == fx.XDP_PASS and events == ev(PASS_NOT_VIP=1)

    # b and d share a bit: removing b leaves it set for d.
    lb.plan(_filter_config([a, b, d]))
    lb.plan(_filter_config([a, d]))
    assert _filter(lb) == filter_bits([a, d])
    assert hashing.addr_filter_bit(b.packed) in _filter(lb)
    r, events = run(lb, frames.frame(flow_b))
    assert r.retval == fx.XDP_PASS and events == ev(PASS_NOT_VIP=1)  # the VIP index says no
