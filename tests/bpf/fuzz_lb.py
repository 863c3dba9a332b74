"""The structure-aware fuzz of lb_xdp: hypothesis frames through BPF_PROG_TEST_RUN and
through xdplb.model, compared packet by packet, in parallel worker processes.

Each worker has its own lb_xdp (own pin root, so its own connection table and counters)
in a shared lab namespace, and the model state the differential test uses (every VIP
kind: exact, wildcard, source hash, IPIP, Beamer; IPv4 and IPv6 backends, GUE).  Per
packet it compares the verdict (exactly as the lab's FIB decides for forwarded
packets), the outer destination and every byte from the outer IP header on.  Per chunk
of packets it compares the counters (events, drops by reason, VIP and backend stats)
and the connection table with what the model says moved, then empties the table on
both sides: a chunk starts from an empty table, so any chunk can be replayed on its
own to find the packet behind a counter difference.

Nothing here knows what the program should do with a given packet: it asks the model.
So when the model and the program learn something new (ICMP, fragments, ACLs), the
fuzz checks the new behaviour with no change here.

host_tc gets what lb_xdp sends to a backend (it must decapsulate it to the client's
packet, byte for byte) and every fourth fuzz frame as it is (robustness).

Disagreements come back as :class:`Problem`; :func:`write_case` keeps each one as a
small JSON file in tests/bpf/corpus/, which test_fuzz.py replays on every run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import hashlib
import ipaddress
import json
import multiprocessing
import os
import shutil
import socket
import struct
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import fuzz_strategies as fs
import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from lb_harness import FrameRefused, LabNetns, configure_lab, serial
from test_differential import (
    VIP4,
    VIP6,
    ModelLb,
    check_forward,
    drop_deltas,
    entry_of_record,
    event_deltas,
    hexdiff,
    make_state,
    read_stats,
    record,
    stats_deltas,
    stats_diff,
)

from xdplb import model
from xdplb.core import abi, hashing, paths
from xdplb.core.acl import AclKey
from xdplb.core.errors import BpfError
from xdplb.core.state import ConnEntry, filter_bits, vip_addr_infos
from xdplb.datapath import BpfObject
from xdplb.datapath.clock import now_ticks
from xdplb.datapath.conns import ImportResult, key_of, session
from xdplb.datapath.testrun import TestRunResult
from xdplb.lab import netns

CORPUS = Path(__file__).parent / "corpus"
#: Packets per chunk: counters and the connection table are compared, and the table
#: emptied, after each.
CHUNK = 2048
DEFAULT_SEED = 0x5EEDF022


# --- the states the fuzz runs against -------------------------------------------------------


def differential_state() -> model.DataplaneState:
    """test_differential's state, without the insert budget: the model has no clock, and
    a fuzz run inserts faster than a real client population would."""
    state = make_state()
    return replace(state, config=replace(state.config, flood_max=0))


def degraded_state() -> model.DataplaneState:
    """The differential state gone wrong in the ways the program must survive: backend 2
    inactive though tables name it (NO_BACKEND), VIP 4's table missing (NO_TABLE), no
    IPv6 outer source (NO_CONFIG for IPv6 backends), and lb_vip_addrs holding two
    addresses with no VIP on them (fragments and broken L4 to them are dropped: the
    VIP filter has their bits too, as it would while a plan removes them)."""
    state = differential_state()
    backends = dict(state.backends)
    backends[2] = replace(backends[2], active=False)
    tables = {vid: t for vid, t in state.tables.items() if vid != 4}
    extra = {ipaddress.ip_address("198.19.1.99"), ipaddress.ip_address("fd78:6470:6c62:1::99")}
    return replace(
        state,
        backends=backends,
        tables=tables,
        config=replace(state.config, src6=None),
        vip_addrs=frozenset({v.addr for v in state.vips} | extra),
        vip_filter=filter_bits({v.addr for v in state.vips} | extra),
    )


def policy_state() -> model.DataplaneState:
    """The differential state with the policies of issue 5 on: echo answered on the
    first IPv4 and IPv6 VIP addresses, a global deny list, an allow list with a deny
    inside it on VIP 1 (longest prefix wins, the rest denied by default), deny lists on
    VIP 2 (a UDP wildcard: its fragments) and VIP 4. The fuzz's clients are
    198.18.128.7 + 0..32767 and fd78:6470:6c62:8000::7 + 0..32767 (fuzz_strategies)."""
    state = differential_state()
    net = ipaddress.ip_network
    rules = {
        AclKey(abi.ACL_GLOBAL, net("198.18.160.0/19")): abi.AclList.DENY,
        AclKey(abi.ACL_GLOBAL, net("fd78:6470:6c62:8000::4000/114")): abi.AclList.DENY,
        AclKey(1, net("198.18.128.0/18")): abi.AclList.ALLOW,
        AclKey(1, net("198.18.130.0/24")): abi.AclList.DENY,
        AclKey(2, net("198.18.140.0/22")): abi.AclList.DENY,
        AclKey(4, net("fd78:6470:6c62:8000::/116")): abi.AclList.DENY,
    }
    vips = {
        v: replace(
            p,
            flags=p.flags
            | (abi.VIP_F_ACL if p.vip_id in (1, 2, 4) else 0)
            | (abi.VIP_F_ACL_DENY if p.vip_id == 1 else 0),
        )
        for v, p in state.vips.items()
    }
    echo = [VIP4, VIP6]
    return replace(
        state,
        vips=vips,
        acl=rules,
        vip_addrs=vip_addr_infos(list(vips), echo=echo),
        config=replace(state.config, flags=state.config.flags | abi.CFG_F_ACL),
    )


#: State id (kept in each corpus case) -> builder.  Add a new id rather than change one
#: that corpus cases name.
STATES: dict[str, Callable[[], model.DataplaneState]] = {
    "differential-v1": differential_state,
    "degraded-v1": degraded_state,
    "policy-v1": policy_state,
}


# --- comparing one packet ----------------------------------------------------------------------


def compare(mlb: ModelLb, frame: bytes, d: model.Decision, r: TestRunResult) -> str | None:
    """None if the program did what the model decided, else what differs."""
    if d.outcome is model.Outcome.FORWARD:
        # Encapsulated: the exact action the lab's FIB gives, Ethernet and outer bytes.
        return check_forward(mlb, frame, d, r)
    got = model.XdpAction(r.retval).name if 0 <= r.retval <= 4 else str(r.retval)
    if not d.allows(r.retval):
        return f"model {d.describe()}, program returned {got}"
    if r.retval == model.XdpAction.DROP:
        return None
    if d.outcome is model.Outcome.REPLY:
        # Answered in place (echo): the model builds the whole frame, Ethernet included.
        if r.data != d.packet:
            want, got_hex = (d.packet or b"").hex(), r.data.hex()
            return f"model {d.describe()}: reply differs\n  want {want}\n  got {got_hex}"
        return None
    if d.packet is not None:
        # A packet the model built (a reply, say): the output ends with it, behind an
        # Ethernet header (and maybe a tag) that is the FIB's or the input's business.
        if not r.data.endswith(d.packet) or len(r.data) - len(d.packet) not in (14, 18):
            want, got_hex = d.packet.hex(), r.data.hex()
            return f"model {d.describe()}: packet differs\n  want {want}\n  got {got_hex}"
        return None
    if r.data != frame:
        return f"model {d.describe()}, program {got} with a modified frame {r.data.hex()}"
    return None


# --- host_tc: the other end of the tunnel ----------------------------------------------------

TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = 0, 2, 7
HOST_EVERY = 4  # host_tc also sees every HOST_EVERY-th fuzz frame as it is


def load_host(pin_root: str, state: model.DataplaneState) -> BpfObject:
    """host_tc for every backend address of ``state`` at once (one object plays every
    backend host), with the state's GUE port."""
    obj = BpfObject.load(paths.bpf_object("host_tc"), pin_root=Path(pin_root) / "host")
    cfg = abi.HostConfig(gue_port=socket.htons(state.config.gue_port))
    obj.map("host_config").update(struct.pack("<I", 0), cfg.pack())
    for be in state.backends.values():
        obj.map("host_addrs").update(abi.Addr.make(be.addr).pack(), struct.pack("<I", 1))
    return obj


def host_round_trip(
    host: BpfObject, frame: bytes, d: model.Decision, r: TestRunResult
) -> str | None:
    """What lb_xdp sent to a backend, through host_tc: the client's IP packet comes out,
    byte for byte (with the frame's Ethernet padding), behind the same MAC addresses.

    Checked where host_tc decides without sockets or routes: one hop, or not a TCP
    segment of an open connection (a SYN, UDP, ICMP); else host_tc may chain to a
    later hop."""
    inner = frame[fs.l3_offset(frame) :]
    v4 = inner[0] >> 4 == 4
    l4, proto = ((inner[0] & 0xF) * 4, inner[9]) if v4 else (40, inner[6])
    tcp = proto == abi.IPPROTO_TCP and len(inner) >= l4 + 20
    if len(d.hops) > 1 and tcp and inner[l4 + 13] & 0x12 != 0x02:
        return None  # a TCP segment, not a SYN, and later hops: host_tc asks its sockets
    h = host.program("host_tc").test_run(r.data)
    ethertype = b"\x08\x00" if inner[0] >> 4 == 4 else b"\x86\xdd"
    want = r.data[:12] + ethertype + inner
    if h.retval != TC_ACT_OK or h.data != want:
        return f"host_tc round trip: retval {h.retval}, {hexdiff(want, h.data)}"
    return None


def host_robust(host: BpfObject, frame: bytes) -> str | None:
    """Any frame through host_tc: a verdict it may give, and a changed frame only as a
    decapsulation (the inner bytes a suffix of the input's, the MACs kept).

    BPF_PROG_TEST_RUN builds no skb from an IPv4 / IPv6 frame shorter than its IP header
    (EINVAL before the program runs): those frames are not host_tc's to see."""
    try:
        h = host.program("host_tc").test_run(frame)
    except BpfError as e:
        if e.errno == errno.EINVAL and len(frame) < 14 + 40:
            return None
        raise
    if h.retval not in (TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT):
        return f"host_tc returned {h.retval}"
    changed = h.retval == TC_ACT_OK and h.data != frame
    if changed and (h.data[:12] != frame[:12] or not frame[14:].endswith(h.data[14:])):
        return f"host_tc changed a frame it accepted: {h.data.hex()}"
    return None


@dataclass
class Problem:
    """One disagreement: a frame, the connection-table entries it ran against, what the
    model decided, what the program did, and how they differ."""

    frame: str  # hex
    detail: str
    expected: str  # Decision.describe()
    retval: int
    output: str  # hex
    #: The sessions it ran against: (key hex, backend, hash[, later hops, state]).
    conns: list[tuple[Any, ...]] = field(default_factory=list)
    state: str = "differential-v1"


# --- one worker -----------------------------------------------------------------------------


@dataclass
class WorkerResult:
    packets: int = 0
    examples: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    #: Frames run through host_tc (round trips of lb_xdp's output, and fuzz frames).
    host_runs: int = 0
    #: The first frame of each outcome (state, model decision, program action), as a
    #: case: seeds for the corpus, which then replays every outcome the fuzz reached.
    samples: dict[str, Problem] = field(default_factory=dict)


class Checker:
    """One lb_xdp and the model in step: runs frames, compares, keeps the tables equal."""

    def __init__(
        self,
        mlb: ModelLb,
        state_id: str,
        host: BpfObject | None = None,
        host_every: int = HOST_EVERY,
    ) -> None:
        self.mlb = mlb
        #: host_tc, which gets every frame lb_xdp sends to a backend, and every
        #: ``host_every``-th fuzz frame.
        self.host = host
        self.host_every = host_every
        self.state_id = state_id
        self.conns: dict[bytes, ConnEntry] = {}
        self.state = replace(STATES[state_id](), conns=self.conns)
        mlb.load_state(self.state)
        self.seed = self.state.config.seed
        self.mask = self.state.config.conn_mask
        self.result = WorkerResult()
        self._chunk: list[bytes] = []
        self._decisions: list[model.Decision] = []
        self._sets: dict[int, set[bytes]] = {}
        #: Sets of every flow the chunk's packets named: the only ones either side wrote.
        self._touched: set[int] = set()
        self._flush()

    # -- the connection tables ------------------------------------------------------------

    def _flush(self) -> None:
        """Empty both session tables and start a chunk (a wipe: between packets no
        program runs on the table)."""
        self.mlb.table.wipe()
        self._start_chunk()

    def _start_chunk(self) -> None:
        self.conns.clear()
        self._sets.clear()
        self._touched.clear()
        self._chunk.clear()
        self._decisions.clear()
        self._base = self._read_counters()

    def _read_counters(
        self,
    ) -> tuple[np.ndarray, np.ndarray, dict[tuple[str, int], tuple[int, int, int]]]:
        return (
            self.mlb.counters("lb_events", len(abi.Event)),
            self.mlb.counters("lb_drops", len(abi.DropReason)),
            read_stats(self.mlb),
        )

    def _set_of(self, key: bytes) -> int:
        return hashing.sess_hash(key, self.seed) & self.mask

    def _table(self) -> dict[bytes, ConnEntry]:
        """The program's sessions in the touched sets, untimed (reading all 2^16 sets
        takes longer than a chunk)."""
        out = {}
        for idx in sorted(self._touched):
            recs, _ = self.mlb.table.read(idx, 1)
            for rec in recs:
                out[key_of(rec)] = entry_of_record(rec)
        return out

    def _clear_touched(self) -> None:
        """Empty the table (a memset of the mapping: a few ms), start a chunk."""
        self._flush()

    def _would_evict(self, key: bytes) -> bool:
        """Whether inserting ``key`` would push a fifth flow into its set (the program
        evicts, the model does not model eviction)."""
        ways = self._sets.get(self._set_of(key), set())
        return key not in ways and len(ways) >= abi.CONN_WAYS

    # -- running ----------------------------------------------------------------------------

    def run(self, frame: bytes) -> None:
        if len(frame) < 14:  # test_run refuses frames shorter than Ethernet
            return
        d = model.decide(self.state, frame)
        if d.conn_insert is not None and self._would_evict(d.conn_insert[0]):
            self.end_chunk()
            d = model.decide(self.state, frame)
        try:
            r = self.mlb.run(frame)
        except FrameRefused:  # lb_tc: a frame no skb test run can carry
            self.result.outcomes["refused by the skb test run"] += 1
            return
        self.result.packets += 1
        action = model.XdpAction(r.retval).name if 0 <= r.retval <= 4 else str(r.retval)
        why = d.drop.name if d.drop is not None else (d.events[0].name if d.events else "")
        outcome = f"{d.outcome.value}:{why}:{action}"
        self.result.outcomes[outcome] += 1
        problem = compare(self.mlb, frame, d, r)
        if self.host is not None:
            problem = problem or self._host_checks(frame, d, r)
        if problem is None and f"{self.state_id}:{outcome}" not in self.result.samples:
            sample = self._problem(frame, d, r, f"seed: {outcome} (not a disagreement)")
            self.result.samples[f"{self.state_id}:{outcome}"] = sample
        if problem is not None:
            self.result.problems.append(self._problem(frame, d, r, problem))
        self._chunk.append(frame)
        self._decisions.append(d)
        record(self.conns, d)
        if d.conn_insert is not None:
            key = d.conn_insert[0]
            self._sets.setdefault(self._set_of(key), set()).add(key)
        if d.flow is not None:
            self._touched.add(self._set_of(d.flow.key()))
        if len(self._chunk) >= CHUNK:
            self.end_chunk()

    def _host_checks(self, frame: bytes, d: model.Decision, r: TestRunResult) -> str | None:
        assert self.host is not None
        problem = None
        if d.outcome is model.Outcome.FORWARD and r.retval == model.XdpAction.TX:
            self.result.host_runs += 1
            problem = host_round_trip(self.host, frame, d, r)
        if problem is None and self.result.packets % self.host_every == 0:
            self.result.host_runs += 1
            problem = host_robust(self.host, frame)
        return problem

    def _problem(self, frame: bytes, d: model.Decision, r: TestRunResult, detail: str) -> Problem:
        conns = [
            (k.hex(), e.backend_id, e.hash, list(e.later), int(e.state))
            for k, e in self._relevant_conns(frame).items()
        ]
        return Problem(
            frame.hex(), detail, d.describe(), r.retval, r.data.hex(), conns, self.state_id
        )

    def _relevant_conns(self, frame: bytes) -> dict[bytes, ConnEntry]:
        """The entries a frame may read: those whose key's addresses both occur in it."""
        out = {}
        for key, entry in self.conns.items():
            v4 = not any(key[4:16]) and not any(key[20:32])
            src, dst = (key[:4], key[16:20]) if v4 else (key[:16], key[16:32])
            if src in frame and dst in frame:
                out[key] = entry
        return out

    def end_chunk(self) -> None:
        """Compare counters and tables for the chunk, locate any difference, flush."""
        if self._chunk:
            ev, dr, st = self._read_counters()
            ev0, dr0, st0 = self._base
            decisions = self._decisions
            ok = (
                np.array_equal(ev - ev0, event_deltas(decisions))
                and np.array_equal(dr - dr0, drop_deltas(decisions))
                and stats_diff(st, st0) == stats_deltas(decisions)
            )
            if not ok:
                self._locate_counter_difference(list(self._chunk))
            table = self._table()
            if table != self.conns:
                self._report_table_difference(table)
        self._clear_touched()

    def _locate_counter_difference(self, frames: list[bytes]) -> None:
        """Replay a chunk packet by packet from an empty table, counters read around each."""
        self._flush()
        for frame in frames:
            d = model.decide(self.state, frame)
            if d.flow is not None:
                self._touched.add(self._set_of(d.flow.key()))
            ev0, dr0, st0 = self._read_counters()
            r = self.mlb.run(frame)
            ev, dr, st = self._read_counters()
            want_ev, want_dr = event_deltas([d]), drop_deltas([d])
            if not (
                np.array_equal(ev - ev0, want_ev)
                and np.array_equal(dr - dr0, want_dr)
                and stats_diff(st, st0) == stats_deltas([d])
            ):
                got = {abi.Event(i).name: int(v) for i, v in enumerate(ev - ev0) if v}
                got |= {abi.DropReason(i).name: int(v) for i, v in enumerate(dr - dr0) if v}
                want = {abi.Event(i).name: int(v) for i, v in enumerate(want_ev) if v}
                want |= {abi.DropReason(i).name: int(v) for i, v in enumerate(want_dr) if v}
                detail = (
                    f"counters: model {want} {stats_deltas([d])}, "
                    f"program {got} {stats_diff(st, st0)}"
                )
                self.result.problems.append(self._problem(frame, d, r, detail))
            record(self.conns, d)

    def _report_table_difference(self, table: dict[bytes, ConnEntry]) -> None:
        keys = set(table) ^ set(self.conns)
        keys |= {k for k in table if k in self.conns and table[k] != self.conns[k]}
        for key in sorted(keys)[:4]:
            frame = next(
                (
                    f
                    for f, d in zip(self._chunk, self._decisions, strict=True)
                    if d.flow is not None and d.flow.key() == key
                ),
                self._chunk[-1],
            )
            d = model.decide(replace(self.state, conns={}), frame)
            detail = (
                f"conn table: key {key.hex()} model {self.conns.get(key)} program {table.get(key)}"
            )
            self.result.problems.append(
                Problem(frame.hex(), detail, d.describe(), -1, "", [], self.state_id)
            )


@dataclass(frozen=True)
class WorkerArgs:
    index: int
    ns: str
    ifindex: int
    mac: str
    pin_root: str
    packets: int
    seed: int
    state: str = "differential-v1"
    #: The balancer's object: lb_xdp or lb_tc.
    program: str = "lb_xdp"
    #: Stop early after this long, whatever the packet count (a guard, not a target).
    max_seconds: float = 1800.0


class _Done(Exception):
    """The worker's packet budget is spent (ends hypothesis' loop)."""


def worker(args: WorkerArgs) -> WorkerResult:
    """A worker process: its own balancer, the lab namespace, hypothesis until the budget."""
    t0 = time.perf_counter()
    with netns.enter(args.ns):
        obj = BpfObject.load(paths.bpf_object(args.program), pin_root=args.pin_root)
        mlb = ModelLb(obj, args.ifindex, bytes.fromhex(args.mac.replace(":", "")), [])
        host: BpfObject | None = None
        try:
            host = load_host(args.pin_root, STATES[args.state]())
            checker = Checker(mlb, args.state, host)
            res = checker.result
            targets = fs.Targets.of(checker.state)

            @seed(args.seed)
            @settings(
                max_examples=10**9,
                database=None,
                phases=[Phase.generate],
                deadline=None,
                suppress_health_check=list(HealthCheck),
                verbosity=Verbosity.quiet,
                report_multiple_bugs=False,
            )
            @given(fs.drawn(targets))
            def one(drawn: fs.Drawn) -> None:
                if res.packets >= args.packets or time.perf_counter() - t0 > args.max_seconds:
                    raise _Done
                res.examples += 1
                for frame in fs.expand(drawn):
                    checker.run(frame)

            with contextlib.suppress(_Done):
                one()
            checker.end_chunk()
        finally:
            for inner in mlb.inner_maps:
                inner.close()
            obj.close()
            if host is not None:
                host.close()
    res.seconds = time.perf_counter() - t0
    return res


# --- the run ----------------------------------------------------------------------------------


@dataclass
class FuzzReport:
    packets: int
    examples: int
    seconds: float
    seed: int
    workers: int
    problems: list[Problem]
    outcomes: Counter[str]
    samples: dict[str, Problem] = field(default_factory=dict)
    host_runs: int = 0

    @property
    def rate(self) -> float:
        return self.packets / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        return (
            f"fuzz seed {self.seed:#x}: {self.packets} packets from {self.examples} examples "
            f"in {self.seconds:.1f} s ({self.rate:,.0f} packets/s, {self.workers} workers), "
            f"{self.host_runs} host_tc runs, "
            f"{len(self.problems)} disagreements; outcomes {dict(sorted(self.outcomes.items()))}"
        )


@dataclass
class Lab:
    """The shared lab namespace and the workers' pin roots, removed on exit."""

    ns: LabNetns
    pin_roots: list[Path]


def _lab(workers: int) -> Iterator[Lab]:
    name = f"xdplbf-{os.getpid()}-{next(serial)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    roots = [Path(f"/sys/fs/bpf/{name}-w{i}") for i in range(workers)]
    try:
        with netns.enter(name):
            ns = configure_lab(name)
        yield Lab(ns, roots)
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def run_fuzz(
    packets: int,
    seed_: int = DEFAULT_SEED,
    workers: int = 2,
    states: tuple[str, ...] = (),
    program: str = "lb_xdp",
) -> FuzzReport:
    """``packets`` frames split over ``max(workers, len(states))`` jobs run by ``workers``
    processes (spawned: each job loads its own ``program``), job i drawing with hypothesis
    seed ``seed_ + i`` against state ``states[i % len(states)]`` (default: every state
    of :data:`STATES`), so every state gets its share whatever the worker count."""
    states = states or tuple(STATES)
    t0 = time.perf_counter()
    njobs = max(workers, len(states))
    gen = _lab(njobs)
    lab = next(gen)
    try:
        share = -(-packets // njobs)
        jobs = [
            WorkerArgs(
                i,
                lab.ns.name,
                lab.ns.lb_ifindex,
                lab.ns.lb_mac,
                str(lab.pin_roots[i]),
                share,
                seed_ + i,
                states[i % len(states)],
                program,
            )
            for i in range(njobs)
        ]
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            results = list(pool.map(worker, jobs))
    finally:
        gen.close()
    outcomes: Counter[str] = Counter()
    samples: dict[str, Problem] = {}
    for r in results:
        outcomes.update(r.outcomes)
        samples = r.samples | samples
    return FuzzReport(
        sum(r.packets for r in results),
        sum(r.examples for r in results),
        time.perf_counter() - t0,
        seed_,
        workers,
        [p for r in results for p in r.problems],
        outcomes,
        samples,
        sum(r.host_runs for r in results),
    )


# --- the corpus -------------------------------------------------------------------------------


def case_name(problem: Problem, prefix: str = "") -> str:
    what = json.dumps([problem.frame, problem.state, problem.conns]).encode()
    digest = hashlib.sha256(what).hexdigest()
    return f"{prefix}{problem.state}-{digest[:16]}.json"


def write_case(problem: Problem, corpus: Path = CORPUS, note: str = "", prefix: str = "") -> Path:
    """Keep a case as tests/bpf/corpus/[prefix]<state>-<hash>.json (one per frame)."""
    corpus.mkdir(parents=True, exist_ok=True)
    path = corpus / case_name(problem, prefix)
    doc = dataclasses.asdict(problem) | {"note": note}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load_cases(corpus: Path = CORPUS) -> list[tuple[str, Problem]]:
    out = []
    for path in sorted(corpus.glob("*.json")):
        doc = json.loads(path.read_text())
        doc.pop("note", None)
        doc["conns"] = [tuple(c) for c in doc.get("conns", [])]
        out.append((path.name, Problem(**doc)))
    return out


def replay(mlb: ModelLb, case: Problem, host: BpfObject | None = None) -> str | None:
    """One corpus case on an empty table plus its recorded entries: None if the program
    and today's model agree on it (verdict, bytes, counters, table; with ``host``, the
    host_tc checks too)."""
    checker = Checker(mlb, case.state, host, host_every=1)
    cfg = checker.state.config
    sessions = []
    for key_hex, backend, hash_, *rest in case.conns:
        key = bytes.fromhex(key_hex)
        # Cases from before sessions had a state: a TCP flow's is mid-connection.
        tcp = key[36] == abi.IPPROTO_TCP
        default = abi.SessState.TCP_EST if tcp else abi.SessState.UDP
        later = tuple(rest[0]) if rest else ()
        st = abi.SessState(rest[1]) if len(rest) > 1 else default
        sessions.append(session(key, [backend, *later], hash_, st, now_ticks()))
        checker.conns[key] = ConnEntry(backend, hash_, later, st)
        checker._touched.add(checker._set_of(key))
    results = mlb.table.import_sessions(
        sessions, seed=cfg.seed, gen=cfg.conn_gen, timeouts=cfg.conn_timeouts
    )
    assert all(r is ImportResult.WRITTEN for r in results), results
    frame = bytes.fromhex(case.frame)
    checker.run(frame)
    checker.end_chunk()
    problems = checker.result.problems
    return None if not problems else "\n".join(p.detail for p in problems)


def main() -> None:
    """``python tests/bpf/fuzz_lb.py --packets N [--seed S] [--write-seeds]``: a run
    outside pytest; --write-seeds keeps one frame per outcome reached as corpus seeds."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--packets", type=int, default=100_000)
    ap.add_argument("--seed", type=lambda v: int(v, 0), default=DEFAULT_SEED)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--write-seeds", action="store_true")
    args = ap.parse_args()
    report = run_fuzz(args.packets, args.seed, args.workers)
    print(report.summary())
    note = f"fuzz seed {args.seed:#x}"
    for p in report.problems:
        print(f"disagreement kept in {write_case(p, note=note)}: {p.detail}")
    if args.write_seeds:
        for p in report.samples.values():
            write_case(p, note=note, prefix="seed-")
        print(f"{len(report.samples)} seeds kept in {CORPUS}")


if __name__ == "__main__":
    main()
