"""The real lb_xdp against the reference model, flow by flow (docs/design.md §2).

10,000 random flows (TCP and UDP, IPv4 and IPv6, an exact VIP, a port-0 wildcard,
a source-hash VIP, an IPIP VIP, a Beamer VIP, cross-family backends, Maglev tables
from xdplb.tables.maglev) go through BPF_PROG_TEST_RUN and through xdplb.model; each
must leave with exactly the model's encapsulated packet (outer destination, GUE
source port, hop list, every byte from the outer IP header on) and the Ethernet
addresses of the backend's neighbour.  Then the same flows again (connection
table hits), then again with a backend deactivated (stale entries), and the
counters and the connection table must match what the model says moved.

Packets are built with bytes concatenation (xdplb.model.frames), not scapy: the
bulk of the time is then the ~7 µs test_run call itself.
"""

from __future__ import annotations

import ctypes
import ipaddress
import struct
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import lb_fixtures as fx
import numpy as np
import pytest
from lb_harness import run_lb

from xdplb import model
from xdplb.core import abi, mapops
from xdplb.core.acl import rule_value
from xdplb.core.state import (
    DEFAULT_TIMEOUTS,
    BackendState,
    ConnEntry,
    LbConfig,
    LookupTable,
    Vip,
    VipParams,
    timeout_ticks,
)
from xdplb.datapath import BPF_F_INNER_MAP, BpfObject, Map, MapType, clock
from xdplb.datapath import conns as conns_mod
from xdplb.datapath.conns import ConnTable, Entry, ImportResult
from xdplb.datapath.lb import MAP_NAMES, TABLE_MAPS, LbMaps
from xdplb.datapath.testrun import TestRunResult
from xdplb.model import frames
from xdplb.model.parse import ETH_P_IP, ETH_P_IPV6
from xdplb.tables import maglev

pytestmark = pytest.mark.bpf

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address
TCP, UDP = abi.IPPROTO_TCP, abi.IPPROTO_UDP
#: TCP flags of a first packet (a new connection) and of a packet of an open one.
TCP_SYN, TCP_ACK = 0x02, 0x10
N_FLOWS = 10_000
SEED = 20240601

# --- the lab (tests/bpf/conftest.py): lb0 with the LB's addresses and neighbours ------------

LB_SRC4 = V4("198.18.0.2")
LB_SRC6 = V6("fd78:6470:6c62::2")
#: Backend id -> (address, active), the conftest lab's: 1-6 have permanent neighbours on
#: lb0, 7 is on link without one (FIB_PASS), 8 is inactive, 9 has no route (FIB drop).
BACKENDS: dict[int, tuple[abi.IPAddress, bool]] = {
    b.id: (b.addr, b.active) for b in fx.BACKENDS.values()
}
NEIGH_MAC = {b.addr: bytes.fromhex(b.mac.replace(":", "")) for b in fx.BACKENDS.values() if b.mac}
ADDR_TO_ID = {b.addr: b.id for b in fx.BACKENDS.values()}


#: lb0's MTU: bpf_fib_lookup() checks the outer length against it (flags 0).
LAB_MTU = 1500


def fib_action(d: model.Decision) -> model.XdpAction:
    """What step 12 does in the lab with a packet the model forwards.

    1-6 have permanent neighbours (TX), 7 has none (PASS, FIB_PASS), 9 has no route
    (DROP, FIB); and an outer packet longer than lb0's MTU is BPF_FIB_LKUP_RET_FRAG_NEEDED
    (DROP, TOO_BIG): see :func:`fib_drop`.
    """
    assert d.backend_id is not None and d.packet is not None
    be = fx.BACKENDS[d.backend_id]
    if be.addr.version == 4 and be.addr not in ipaddress.IPv4Network("198.18.0.0/24"):
        return model.XdpAction.DROP
    if outer_len(d.packet) > LAB_MTU:
        return model.XdpAction.DROP
    return model.XdpAction.TX if be.mac is not None else model.XdpAction.PASS


def outer_len(packet: bytes) -> int:
    """The outer IP length field's value (the packet may carry padding after it)."""
    if packet[0] >> 4 == 4:
        return int.from_bytes(packet[2:4], "big")
    return 40 + int.from_bytes(packet[4:6], "big")


@dataclass
class ModelLb:
    """The conftest's lb_xdp and namespace, with maps written from a model state."""

    obj: BpfObject
    ifindex: int
    mac: bytes
    inner_maps: list[Map]
    #: vip id -> the lb_members states written last (each write waits for RCU).
    members: dict[int, dict[int, abi.MemberState]] = field(default_factory=dict)

    @cached_property
    def maps(self) -> LbMaps:
        """The object's maps as the daemon handles them (not closed: the object owns
        them)."""
        return LbMaps({n: self.obj.map(n) for n in MAP_NAMES})

    @property
    def table(self) -> ConnTable:
        """The session table, mapped."""
        return self.maps.conns

    def run(self, frame: bytes) -> TestRunResult:
        return run_lb(self.obj, frame, self.ifindex)

    def load_state(self, state: model.DataplaneState) -> None:
        """Write every map the model reads; whatever was there before is removed."""
        obj = self.obj
        for name in ("lb_vip_addrs", "lb_acl4", "lb_acl6"):
            m = obj.map(name)
            for key in list(m.keys()):
                m.delete(key)
        self.table.wipe()  # no program runs on it meanwhile (tests only)
        for rule, action in state.acl.items():
            obj.map(rule.map_name).update(rule.abi_key().pack(), rule_value(action))
        for key, info in state._vip_addr_index.items():
            addr = ipaddress.ip_address(key[1])
            obj.map("lb_vip_addrs").update(abi.Addr.make(addr).pack(), info.abi_value().pack())
        size = ctypes.sizeof(abi.Backend)
        slots = bytearray(abi.MAX_BACKENDS * size)
        for bid, be in state.backends.items():
            slots[bid * size : (bid + 1) * size] = be.abi_value().pack()
        obj.map("lb_backends").update_array(bytes(slots))
        for name in TABLE_MAPS.values():
            tables = obj.map(name)
            for vid in range(abi.MAX_VIPS):
                tables.delete(struct.pack("<I", vid))
        for inner in self.inner_maps:
            inner.close()
        self.inner_maps = []
        # Each table goes to the outer map of the kind of the VIP that names it.
        kinds = {p.vip_id: p.table_kind for p in state.vips.values()}
        for vid, table in state.tables.items():
            self.set_table(vid, table, kinds.get(vid, abi.TableKind.MAGLEV))
        self.set_members(state.members)
        old_keys = list(obj.map("lb_vips").keys())
        old_vips = [Vip.from_abi(abi.VipKey.from_buffer_copy(k)) for k in old_keys]
        self.maps.apply(
            [
                mapops.SetConfig(state.config),
                *(mapops.DeleteVip(v) for v in old_vips if v not in state.vips),
                *(mapops.PutVip(v, p) for v, p in state.vips.items()),
                mapops.SetVipFilter(state.vip_filter_bits),
            ]
        )
        self.import_conns(state)

    def import_conns(self, state: model.DataplaneState) -> None:
        """The model's sessions into lb_conns (ConnTable.import_sessions), each of its own
        generation; a session without a last_seen is as fresh as now."""
        cfg = state.config
        now = clock.now_ticks()
        by_gen: dict[int, list[abi.Session]] = {}
        for key, e in state.conns.items():
            by_gen.setdefault(e.gen, []).append(
                conns_mod.session(
                    key,
                    (e.backend_id, *e.later),
                    e.hash,
                    e.state,
                    now if e.last_seen is None else e.last_seen,
                    be_gen=e.be_gen,
                )
            )
        for gen, sessions in by_gen.items():
            results = self.table.import_sessions(
                sessions, seed=cfg.seed, gen=gen, timeouts=cfg.conn_timeouts, now=now
            )
            assert all(r is ImportResult.WRITTEN for r in results), results

    def set_members(self, members: Mapping[int, Mapping[int, abi.MemberState]]) -> None:
        """lb_members as ``members`` says (vip id -> backend id -> state), writing only the
        VIPs whose states changed."""
        ops: list[mapops.Op] = []
        for vid in sorted(self.members.keys() - members.keys()):
            ops.append(mapops.DeleteMembers(vid))
            del self.members[vid]
        for vid, states in members.items():
            if self.members.get(vid) != states:
                ops.append(mapops.PutMembers(vid, states))
                self.members[vid] = dict(states)
        self.maps.apply(ops)

    def set_table(self, vip_id: int, table: LookupTable, kind: abi.TableKind) -> None:
        """A new inner map, filled, then swapped into lb_tables (Maglev) or lb_btables
        (Beamer) in one update."""
        beamer = kind is abi.TableKind.BEAMER
        inner = Map.create(
            MapType.ARRAY,
            4,
            ctypes.sizeof(abi.Bucket) if beamer else 4,
            len(table),
            name=f"mt{vip_id}",
            flags=BPF_F_INNER_MAP,
        )
        inner.update_array(table.contents(kind))
        self.obj.map(TABLE_MAPS[kind]).update(
            struct.pack("<I", vip_id), struct.pack("<I", inner.fd)
        )
        self.inner_maps.append(inner)

    def counters(self, name: str, n: int) -> np.ndarray:
        """A per-CPU u64 counter array, summed over CPUs."""
        m = self.obj.map(name)
        return np.array(
            [
                sum(struct.unpack("<Q", v)[0] for v in m.lookup_percpu(struct.pack("<I", i)))
                for i in range(n)
            ],
            dtype=np.int64,
        )

    def stats(self, name: str, idx: int) -> tuple[int, int, int]:
        total = np.zeros(3, dtype=np.int64)
        for v in self.obj.map(name).lookup_percpu(struct.pack("<I", idx)):
            total += np.frombuffer(v, dtype="<u8").astype(np.int64)
        return (int(total[0]), int(total[1]), int(total[2]))

    def conns(self) -> dict[bytes, ConnEntry]:
        """The program's sessions in the model's terms, without their times
        (:func:`untimed`)."""
        return {e.key: model_entry(e) for e in self.table.iter_entries()}


def model_entry(e: Entry) -> ConnEntry:
    """A session read from lb_conns as the model's :class:`ConnEntry`, without its
    last_seen (the model's clock is None in these tests: compared with :func:`untimed`)."""
    return ConnEntry(
        e.backend_id, e.hash, e.hops[1:], e.state, be_gen=e.be_gen, gen=e.gen, last_seen=None
    )


def entry_of_record(rec: np.void) -> ConnEntry:
    """A session record (``conns.SESSION_DTYPE``, from ``ConnTable.read``) as the model's
    :class:`ConnEntry`, untimed."""
    hops = tuple(int(h) for h in rec["hop"] if h)
    return ConnEntry(
        hops[0] if hops else 0,
        int(rec["hash"]),
        hops[1:],
        abi.SessState(int(rec["state"]) & 3),
        be_gen=int(rec["be_gen"]),
        gen=int(rec["gen"]),
        last_seen=None,
    )


def untimed(conns: Mapping[bytes, ConnEntry]) -> dict[bytes, ConnEntry]:
    """The model's sessions without their last_seen, to compare with :meth:`ModelLb.conns`."""
    return {k: replace(e, last_seen=None) for k, e in conns.items()}


def table_members(
    tables: Mapping[int, LookupTable],
) -> dict[int, dict[int, abi.MemberState]]:
    """lb_members as the planner leaves it for VIPs whose backends all have a weight:
    every backend a VIP's table names, first hop or later, ACTIVE."""
    out: dict[int, dict[int, abi.MemberState]] = {}
    for vid, table in tables.items():
        ids = set(np.unique(table.first).tolist())
        if table.rest is not None:
            ids |= set(np.unique(table.rest).tolist())
        out[vid] = {int(b): abi.MemberState.ACTIVE for b in sorted(ids) if b}
    return out


@pytest.fixture(scope="module")
def mlb(lb_obj: BpfObject, lb_netns: Any) -> Iterator[ModelLb]:
    """lb_xdp (conftest ``lb_obj``) in the lab namespace (conftest ``lb_netns``)."""
    mac = bytes.fromhex(lb_netns.lb_mac.replace(":", ""))
    harness = ModelLb(lb_obj, lb_netns.lb_ifindex, mac, [])
    try:
        yield harness
    finally:
        for inner in harness.inner_maps:
            inner.close()


# --- the state: VIPs of every kind ----------------------------------------------------------


def maglev_ids(ids: list[int], size: int, weights: list[int] | None = None) -> np.ndarray:
    """A Maglev table of backend ids (xdplb.tables.maglev: a missing build fails the import)."""
    names = {f"be{i}": w for i, w in zip(ids, weights or [1] * len(ids), strict=True)}
    return maglev.build(names, size).map_ids({f"be{i}": i for i in ids})


VIP4 = V4("198.19.1.1")
VIP4_SRC = V4("198.19.1.2")
VIP4_IPIP = V4("198.19.1.3")
VIP4_BEAMER = V4("198.19.1.4")
VIP6 = V6("fd78:6470:6c62:1::1")
VIP6_SRC = V6("fd78:6470:6c62:1::2")


def make_state() -> model.DataplaneState:
    rng = np.random.default_rng(SEED)
    vips = {
        Vip(VIP4, 80, TCP): VipParams(1),
        Vip(VIP4, 0, UDP): VipParams(2, table_size=251),  # wildcard, small table
        Vip(VIP4, 443, UDP): VipParams(3, table_size=65537),  # exact beats wildcard
        Vip(VIP6, 443, TCP): VipParams(4),
        Vip(VIP6, 0, UDP): VipParams(5, table_size=1009),
        Vip(VIP4_SRC, 8080, TCP): VipParams(6, flags=abi.VIP_F_SRC_HASH),
        Vip(VIP6_SRC, 53, UDP): VipParams(7, flags=abi.VIP_F_SRC_HASH, table_size=1009),
        Vip(VIP4_IPIP, 0, TCP): VipParams(8, table_size=251, encap=abi.Encap.IPIP),
        Vip(VIP4_BEAMER, 80, TCP): VipParams(9, table_size=1009, table_kind=abi.TableKind.BEAMER),
    }
    # Later hops, three per bucket: none, usable, other family (left out), inactive (left
    # out), in any order and with gaps, so every hop count 1-4 occurs.
    rest = rng.choice(np.array([0, 1, 2, 3, 4, 7, 8], dtype=np.uint32), (1009, abi.MAX_HOPS - 1))
    tables = {
        1: LookupTable(maglev_ids([1, 2, 3], 65537, [1, 2, 3])),
        2: LookupTable(maglev_ids([1, 2, 3], 251)),
        3: LookupTable(maglev_ids([1, 2], 65537)),
        4: LookupTable(maglev_ids([4, 5, 6], 65537)),
        # Cross-family: IPv6 clients to IPv4 backends and back.
        5: LookupTable(maglev_ids([1, 2, 5, 6], 1009)),
        6: LookupTable(maglev_ids([4, 5, 3], 65537)),
        7: LookupTable(maglev_ids([1, 4], 1009)),
        8: LookupTable(maglev_ids([2, 3, 4], 251)),
        9: LookupTable(maglev_ids([1, 2, 3], 1009), rest),
    }
    backends = {i: BackendState(a, active) for i, (a, active) in BACKENDS.items()}
    hz = clock.hz()  # the session clock's: timeouts in the kernel's jiffies
    config = LbConfig(
        LB_SRC4,
        LB_SRC6,
        gue_port=6080,
        seed=0x9E3779B9,
        conn_timeouts=tuple(timeout_ticks(t, hz) for t in DEFAULT_TIMEOUTS),
        hz=hz,
    )
    return model.DataplaneState(
        vips, backends, tables, config, conns={}, members=table_members(tables)
    )


def random_flows(state: model.DataplaneState, n: int, seed: int) -> list[model.Flow]:
    """n distinct flows, spread over the VIPs (wildcards on random ports)."""
    rng = np.random.default_rng(seed)
    vips = list(state.vips)
    seen: set[bytes] = set()
    flows: list[model.Flow] = []
    while len(flows) < n:
        vip = vips[int(rng.integers(len(vips)))]
        if vip.addr.version == 4:
            src: abi.IPAddress = V4(int(V4("198.18.128.0")) + int(rng.integers(1, 1 << 15)))
        else:
            src = V6(int(V6("fd78:6470:6c62:8000::")) + int(rng.integers(1, 1 << 62)))
        dport = vip.port or int(rng.integers(1, 65536))
        if vip.port == 0 and Vip(vip.addr, dport, vip.proto) in state.vips:
            continue
        f = model.Flow(src, vip.addr, int(rng.integers(1024, 65536)), dport, vip.proto)
        if f.key() not in seen:
            seen.add(f.key())
            flows.append(f)
    return flows


def frame_of(f: model.Flow, i: int, tcp_flags: int = TCP_SYN) -> bytes:
    """Vary what must not matter: payload, TOS, a VLAN tag, Ethernet padding."""
    payload = bytes((i * 7 + k) & 0xFF for k in range(i % 41))
    vlan = (i % 4000) + 1 if i % 10 == 3 else None
    fr = frames.frame(f, payload, vlan=vlan, tos=(i * 4) & 0xFF, tcp_flags=tcp_flags)
    if i % 17 == 5:
        fr += b"\x00" * max(0, 60 - len(fr)) + b"\xee" * (i % 3)
    return fr


# --- comparing -------------------------------------------------------------------------------


def hexdiff(want: bytes, got: bytes) -> str:
    first = next((k for k in range(min(len(want), len(got))) if want[k] != got[k]), None)
    if first is None:
        first = min(len(want), len(got))
    lo = max(0, first - 8)
    return (
        f"lengths want {len(want)} got {len(got)}, first difference at byte {first}\n"
        f"  want[{lo}:] {want[lo : lo + 48].hex(' ')}\n"
        f"  got [{lo}:] {got[lo : lo + 48].hex(' ')}"
    )


def check_forward(mlb: ModelLb, frame: bytes, d: model.Decision, r: TestRunResult) -> str | None:
    """None if the program did exactly what the model says, else a readable difference."""
    got = model.XdpAction(r.retval).name if 0 <= r.retval <= 4 else str(r.retval)
    if d.outcome is model.Outcome.REPLY:
        assert d.packet is not None
        if r.retval != model.XdpAction.TX:
            return f"model {d.describe()}, program returned {got}"
        if r.data != d.packet:
            return f"reply differs: {hexdiff(d.packet, r.data)}"
        return None
    if d.outcome is not model.Outcome.FORWARD:
        want = model.XdpAction.DROP if d.outcome is model.Outcome.DROP else model.XdpAction.PASS
        if r.retval != want:
            return f"model {d.describe()}, program returned {got}"
        if want == model.XdpAction.PASS and r.data != frame:
            return f"passed frame was modified: {hexdiff(frame, r.data)}"
        return None
    assert d.packet is not None and d.backend_id is not None
    action = fib_action(d)
    if r.retval != action:
        return f"model {d.describe()} (FIB: {action.name}), program returned {got}"
    be_addr = BACKENDS[d.backend_id][0]
    ethertype = ETH_P_IP if be_addr.version == 4 else ETH_P_IPV6
    if action == model.XdpAction.TX:
        eth = NEIGH_MAC[be_addr] + mlb.mac + ethertype.to_bytes(2, "big")
    else:  # no neighbour (or no route): the original MACs stay
        eth = frame[:12] + ethertype.to_bytes(2, "big")
    if r.data[:14] != eth:
        return f"Ethernet header: {hexdiff(eth, r.data[:14])}"
    if r.data[14:] != d.packet:
        return f"model {d.describe()}\n{hexdiff(d.packet, r.data[14:])}"
    return None


def run_all(
    mlb: ModelLb,
    state: model.DataplaneState,
    flows: list[model.Flow],
    conns: dict[bytes, ConnEntry],
    tcp_flags: int = TCP_SYN,
) -> tuple[list[model.Decision], list[str], list[int]]:
    """Every flow through both; ``conns`` (the state's table) follows the model's inserts.
    TCP flows are SYNs (new connections) unless ``tcp_flags`` says otherwise."""
    decisions, problems, backends = [], [], []
    for i, f in enumerate(flows):
        fr = frame_of(f, i, tcp_flags)
        d = model.decide(state, fr)
        r = mlb.run(fr)
        problem = check_forward(mlb, fr, d, r)
        if problem is not None:
            problems.append(f"flow {i} {f}: {problem}\n  frame {fr.hex()}")
        record(conns, d)
        decisions.append(d)
        forwarded = d.outcome is model.Outcome.FORWARD and r.retval != model.XdpAction.DROP
        backends.append(backend_of(r.data) if forwarded else 0)
    return decisions, problems, backends


def record(conns: dict[bytes, ConnEntry], d: model.Decision) -> None:
    """What a decision writes into the session table (an insert, or a hit's update)."""
    for written in (d.conn_insert, d.conn_update):
        if written is not None:
            conns[written[0]] = written[1]


def backend_of(out: bytes) -> int:
    """The backend id an output frame is addressed to (outer destination)."""
    if out[14] >> 4 == 4:
        return ADDR_TO_ID.get(V4(out[30:34]), -1)
    return ADDR_TO_ID.get(V6(out[38:54]), -1)


def assert_none(problems: list[str]) -> None:
    assert not problems, f"{len(problems)} mismatches; first ones:\n" + "\n".join(problems[:5])


def event_deltas(decisions: list[model.Decision]) -> np.ndarray:
    """lb_events deltas: the model's events, plus step 12's as the lab's FIB decides it."""
    ev = np.zeros(len(abi.Event), dtype=np.int64)
    for d in decisions:
        for e in d.events:
            ev[e] += 1
        if d.outcome is model.Outcome.FORWARD:
            action = fib_action(d)
            if action == model.XdpAction.TX:
                ev[abi.Event.TX] += 1
            elif action == model.XdpAction.PASS:
                ev[abi.Event.FIB_PASS] += 1
    return ev


def fib_drop(d: model.Decision) -> abi.DropReason:
    """Why step 12 drops a packet :func:`fib_action` says it drops: no route comes first."""
    assert d.backend_id is not None
    be = fx.BACKENDS[d.backend_id]
    if be.addr.version == 4 and be.addr not in ipaddress.IPv4Network("198.18.0.0/24"):
        return abi.DropReason.FIB
    return abi.DropReason.TOO_BIG


def drop_deltas(decisions: list[model.Decision]) -> np.ndarray:
    dr = np.zeros(len(abi.DropReason), dtype=np.int64)
    for d in decisions:
        if d.drop is not None:
            dr[d.drop] += 1
        elif d.outcome is model.Outcome.FORWARD and fib_action(d) == model.XdpAction.DROP:
            dr[fib_drop(d)] += 1
    return dr


def stats_deltas(
    decisions: list[model.Decision],
) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(map, id) -> (packets, bytes, new_flows) the model moves in lb_vip_stats / lb_be_stats."""
    out: dict[tuple[str, int], tuple[int, int, int]] = {}
    for d in decisions:
        if d.stats_bytes is None:
            continue
        assert d.vip_params is not None and d.backend_id is not None
        for key in (("lb_vip_stats", d.vip_params.vip_id), ("lb_be_stats", d.backend_id)):
            p, b, n = out.get(key, (0, 0, 0))
            out[key] = (p + 1, b + d.stats_bytes, n + d.new_flow)
    return out


def read_stats(mlb: ModelLb) -> dict[tuple[str, int], tuple[int, int, int]]:
    """Every VIP's and backend's stats the differential states can move."""
    keys = [("lb_vip_stats", v) for v in range(1, 10)] + [("lb_be_stats", b) for b in fx.BACKENDS]
    return {key: mlb.stats(*key) for key in keys}


def stats_diff(
    after: dict[tuple[str, int], tuple[int, int, int]],
    before: dict[tuple[str, int], tuple[int, int, int]],
) -> dict[tuple[str, int], tuple[int, int, int]]:
    out = {}
    for key, a in after.items():
        d = (a[0] - before[key][0], a[1] - before[key][1], a[2] - before[key][2])
        if any(d):
            out[key] = d
    return out


# --- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scenario(mlb: ModelLb) -> tuple[model.DataplaneState, list[model.Flow]]:
    state = make_state()
    mlb.load_state(state)
    return state, random_flows(state, N_FLOWS, SEED)


def test_new_flows_match_the_model(
    mlb: ModelLb, scenario: tuple[model.DataplaneState, list[model.Flow]]
) -> None:
    state, flows = scenario
    conns: dict[bytes, ConnEntry] = {}
    state = replace(state, conns=conns)
    mlb.load_state(state)
    ev0, dr0 = (
        mlb.counters("lb_events", len(abi.Event)),
        mlb.counters("lb_drops", len(abi.DropReason)),
    )
    st0 = read_stats(mlb)

    decisions, problems, observed = run_all(mlb, state, flows, conns)
    assert_none(problems)

    # Every flow is new and forwarded (no drops in this scenario by construction).
    assert all(d.outcome is model.Outcome.FORWARD for d in decisions)
    assert all(d.events == (abi.Event.CONN_MISS, abi.Event.CONN_INSERT) for d in decisions)
    # Coverage: every VIP, both outer families, every hop count 1-4 was exercised.
    assert {d.vip_params.vip_id for d in decisions if d.vip_params} == set(range(1, 10))
    assert {len(d.hops) for d in decisions} == {1, 2, 3, 4}
    assert {BACKENDS[d.backend_id][0].version for d in decisions if d.backend_id} == {4, 6}

    # The vectorised prediction agrees with what the program did.
    pred = model.predict_many(replace(state, conns={}), flows)
    assert np.array_equal(pred.backend, np.array(observed, dtype=np.uint32))
    assert pred.gue_sport.tolist() == [d.gue_sport for d in decisions]

    # Counters and the connection table moved exactly as the model says.
    assert np.array_equal(mlb.counters("lb_events", len(abi.Event)) - ev0, event_deltas(decisions))
    assert np.array_equal(
        mlb.counters("lb_drops", len(abi.DropReason)) - dr0, drop_deltas(decisions)
    )
    assert stats_diff(read_stats(mlb), st0) == stats_deltas(decisions)
    assert mlb.conns() == untimed(conns)
    states = Counter(e.state for e in conns.values())
    assert set(states) == {abi.SessState.TCP_SYN, abi.SessState.UDP}


def test_known_flows_hit_the_connection_table(
    mlb: ModelLb, scenario: tuple[model.DataplaneState, list[model.Flow]]
) -> None:
    state, flows = scenario
    conns: dict[bytes, ConnEntry] = {}
    state = replace(state, conns=conns)
    mlb.load_state(state)
    first, problems, _ = run_all(mlb, state, flows, conns)
    assert_none(problems)
    st0 = read_stats(mlb)
    ev0 = mlb.counters("lb_events", len(abi.Event))

    second, problems, _ = run_all(mlb, state, flows, conns, TCP_ACK)
    assert_none(problems)
    for a, b in zip(first, second, strict=True):
        assert b.events == (abi.Event.CONN_HIT,)
        assert b.backend_id == a.backend_id and b.gue_sport == a.gue_sport
        # A SYN's session keeps its first hop only: a hit carries that one.
        assert b.hops == a.hops[:1]
    assert np.array_equal(mlb.counters("lb_events", len(abi.Event)) - ev0, event_deltas(second))
    assert stats_diff(read_stats(mlb), st0) == stats_deltas(second)
    # The ACKs moved every TCP session from TCP_SYN to TCP_EST, in both.
    assert mlb.conns() == untimed(conns)
    assert {e.state for e in conns.values()} == {abi.SessState.TCP_EST, abi.SessState.UDP}


def _run_phase(
    mlb: ModelLb,
    state: model.DataplaneState,
    flows: list[model.Flow],
    conns: dict[bytes, ConnEntry],
    tcp_flags: int = TCP_ACK,
) -> list[model.Decision]:
    """Every flow through both; counters, stats and the session table must move as the
    model says."""
    ev0 = mlb.counters("lb_events", len(abi.Event))
    dr0 = mlb.counters("lb_drops", len(abi.DropReason))
    st0 = read_stats(mlb)
    decisions, problems, _ = run_all(mlb, state, flows, conns, tcp_flags)
    assert_none(problems)
    assert np.array_equal(mlb.counters("lb_events", len(abi.Event)) - ev0, event_deltas(decisions))
    assert np.array_equal(
        mlb.counters("lb_drops", len(abi.DropReason)) - dr0, drop_deltas(decisions)
    )
    assert stats_diff(read_stats(mlb), st0) == stats_deltas(decisions)
    assert mlb.conns() == untimed(conns)
    return decisions


def test_a_backend_leaving_moves_its_udp_flows_and_keeps_its_tcp_connections(
    mlb: ModelLb, scenario: tuple[model.DataplaneState, list[model.Flow]]
) -> None:
    """Backend 2 leaves every VIP (members NONE, slot inactive, VIPs 1 and 2 get tables
    without it; VIPs 3, 5 and 8 still name it). Issue 11: its UDP sessions are stale (they
    re-hash: moved where the table no longer names it, dropped NO_BACKEND where it still
    does), its TCP sessions are hits that still go to it."""
    state, flows = scenario
    conns: dict[bytes, ConnEntry] = {}
    state = replace(state, conns=conns)
    mlb.load_state(state)
    first, problems, _ = run_all(mlb, state, flows, conns)
    assert_none(problems)

    backends = dict(state.backends)
    backends[2] = replace(backends[2], active=False)
    tables = dict(state.tables)
    tables[1] = LookupTable(maglev_ids([1, 3], 65537, [1, 3]))
    tables[2] = LookupTable(maglev_ids([1, 3], 251))
    members = {
        vid: {b: st for b, st in m.items() if b != 2} for vid, m in table_members(tables).items()
    }
    state2 = replace(state, backends=backends, tables=tables, members=members, conns=conns)
    mlb.obj.map("lb_backends").update(struct.pack("<I", 2), backends[2].abi_value().pack())
    mlb.set_table(1, tables[1], abi.TableKind.MAGLEV)
    mlb.set_table(2, tables[2], abi.TableKind.MAGLEV)
    mlb.set_members(members)
    third = _run_phase(mlb, state2, flows, conns)

    on_2 = [(a, b) for a, b in zip(first, third, strict=True) if a.backend_id == 2]
    tcp = [b for a, b in on_2 if a.flow is not None and a.flow.proto == TCP]
    udp = [b for a, b in on_2 if a.flow is not None and a.flow.proto == UDP]
    assert tcp and all(d.events == (abi.Event.CONN_HIT,) and d.backend_id == 2 for d in tcp)
    assert udp and all(d.events[0] is abi.Event.CONN_STALE for d in udp)
    assert any(d.drop is abi.DropReason.NO_BACKEND for d in udp)
    assert any(d.outcome is model.Outcome.FORWARD and d.backend_id != 2 for d in udp)
    # Nothing else moved: every other session is a hit on its backend.
    others = [b for a, b in zip(first, third, strict=True) if a.backend_id != 2]
    assert all(d.events == (abi.Event.CONN_HIT,) for d in others)


def test_a_slot_given_to_another_address_makes_its_sessions_stale(
    mlb: ModelLb, scenario: tuple[model.DataplaneState, list[model.Flow]]
) -> None:
    """Backend 2's slot is given to another address (the planner bumps its gen): every
    session recorded for the old address is stale, TCP ones too, and re-hashes."""
    state, flows = scenario
    conns: dict[bytes, ConnEntry] = {}
    state = replace(state, conns=conns)
    mlb.load_state(state)
    first, problems, _ = run_all(mlb, state, flows, conns)
    assert_none(problems)

    backends = dict(state.backends)
    backends[2] = BackendState(backends[2].addr, True, gen=1)  # the new owner's gen
    state2 = replace(state, backends=backends, conns=conns)
    mlb.obj.map("lb_backends").update(struct.pack("<I", 2), backends[2].abi_value().pack())
    third = _run_phase(mlb, state2, flows, conns)
    for a, b in zip(first, third, strict=True):
        if a.backend_id == 2:
            assert b.events[:2] == (abi.Event.CONN_STALE, abi.Event.CONN_MISS), b.describe()
            assert b.conn_insert is not None and b.conn_insert[1].be_gen == 1
        else:
            assert b.events == (abi.Event.CONN_HIT,)
    assert any(e.be_gen == 1 for e in conns.values())


@pytest.mark.parametrize(
    ("vip", "dport"), [(VIP4, 80), (VIP6, 443), (VIP4_BEAMER, 80), (VIP6_SRC, 53)]
)
def test_mtu_boundary(mlb: ModelLb, vip: abi.IPAddress, dport: int) -> None:
    """Inner sizes around lb0's MTU minus the tunnel overhead.

    The outer packet may be exactly the MTU; one byte more and bpf_fib_lookup says
    FRAG_NEEDED, which lb_xdp counts as drop TOO_BIG (no ICMP goes back to the client yet).
    A client's full-size 1500-byte packet is therefore never forwarded over a
    1500-byte path.
    """
    conns: dict[bytes, ConnEntry] = {}
    state = replace(make_state(), conns=conns)
    mlb.load_state(state)
    proto = UDP if vip == VIP6_SRC else TCP
    src = V4("198.18.128.77") if vip.version == 4 else V6("fd78:6470:6c62:8000::77")
    seen: Counter[tuple[int, int]] = Counter()
    problems: list[str] = []
    # A new flow per packet, so that every packet has the hop count of a table lookup.
    for sport in range(20000, 20080):
        f = model.Flow(src, vip, sport, dport, proto)
        small = model.decide(state, frames.frame(f))
        assert small.packet is not None
        overhead = outer_len(small.packet) - (small.stats_bytes or 0)
        hdrs = len(frames.frame(f)) - 14
        inner = LAB_MTU - overhead + (sport % 5) - 2
        fr = frames.frame(f, bytes(inner - hdrs))
        d = model.decide(state, fr)
        r = mlb.run(fr)
        record(conns, d)
        seen[(outer_len(d.packet or b"") - LAB_MTU, r.retval)] += 1
        problem = check_forward(mlb, fr, d, r)
        if problem:
            problems.append(problem)
        full = model.decide(state, frames.frame(f, bytes(1500 - hdrs)))
        assert full.outcome is model.Outcome.FORWARD
        assert fib_action(full) == model.XdpAction.DROP
    assert_none(problems)
    # Over the MTU by 1 and 2 bytes: dropped; at or under it: sent.
    assert {excess for excess, action in seen if action == model.XdpAction.DROP} == {1, 2}
    assert {excess for excess, action in seen if action == model.XdpAction.TX} == {-2, -1, 0}
