"""The session table migrated from another layout into today's, entry by entry.

Each case fills an old layout's table through its own lb_xdp (BPF_PROG_TEST_RUN on
real packets), reads it independently (a ctypes mirror of that layout, checked against
its BTF), migrates it with xdplb.datapath.upgrade into maps the planner filled from a
configuration whose backend ids and table differ, and checks every session: in the new
table under the same key, with the same backend address, and used by today's lb_xdp on
the flow's next packet (a hit, where the table would now send it elsewhere).

Old layouts: the legacy one (the release before versioned pins, 3e42602, built by
`make build/test/lb_xdp_legacy.bpf.o`), and a test build of the next layout (ABI 3, a
field added to the session entry). A layout whose key lacks a field is refused.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.config import Config, parse_config
from xdplb.control import planner
from xdplb.core import abi, limits, mapops, paths
from xdplb.core.addresses import IPAddress
from xdplb.core.state import Snapshot
from xdplb.datapath import BpfObject, Map, clock, layout
from xdplb.datapath.lb import LbDatapath, LbMaps, destroy
from xdplb.datapath.upgrade import OldTable, Upgrade, UpgradeRefused, WayFields

pytestmark = pytest.mark.bpf

serial = itertools.count()
VIP = "198.18.100.1"
CLIENT = "198.18.1.1"
BACKENDS = {"b1": "198.18.0.11", "b2": "198.18.0.12", "b3": "198.18.0.13", "b4": "198.18.0.14"}
TCP_PORTS = range(20000, 20300)
UDP_PORTS = range(30000, 30200)
LATE_PORTS = range(31000, 31040)
CONN_TABLE = 65536  # 16384 sets: a few hundred flows never fill one


def config(instance: str, weights: dict[str, int]) -> Config:
    backends = [{"address": BACKENDS[n], "weight": w} for n, w in weights.items()]
    return parse_config(
        {
            "instance": instance,
            "interfaces": [],
            "tunnel": {"source_v4": "198.18.0.2"},
            "hash_seed": 12345,
            "limits": {"conn_table": CONN_TABLE},
            "vips": [
                {"address": VIP, "port": 80, "backends": backends},
                {"address": VIP, "port": 53, "protocol": "udp", "backends": backends},
            ],
        }
    )


#: The old program's configuration: four backends. The new one: b4 gone, b1 drained
#: (weight 0: out of the table, its sessions kept), the rest listed in another order so
#: that ids differ.
OLD_WEIGHTS = {"b1": 1, "b2": 1, "b3": 1, "b4": 1}
NEW_WEIGHTS = {"b3": 1, "b2": 2, "b1": 0}


def frame(sport: int, proto: int, *, syn: bool) -> bytes:
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.l2 import Ether

    l4 = TCP(sport=sport, dport=80, flags="S" if syn else "A") if proto == abi.IPPROTO_TCP else (
        UDP(sport=sport, dport=53)
    )  # fmt: skip
    return bytes(Ether() / IP(src=CLIENT, dst=VIP) / l4 / (b"x" * 16))


def flows() -> Iterator[tuple[int, int, bool]]:
    """(source port, protocol, first packet is a SYN): TCP from SYNs and mid-flow, UDP."""
    for p in TCP_PORTS:
        yield p, abi.IPPROTO_TCP, p % 3 != 0
    for p in UDP_PORTS:
        yield p, abi.IPPROTO_UDP, False


def key_of(sport: int, proto: int) -> bytes:
    dport = 80 if proto == abi.IPPROTO_TCP else 53
    import ipaddress

    return abi.FlowKey.make(
        ipaddress.ip_address(CLIENT), ipaddress.ip_address(VIP), sport, dport, proto
    ).pack()


@pytest.fixture
def instance() -> Iterator[str]:
    name = f"xdplbt-up-{os.getpid()}-{next(serial)}"
    try:
        yield name
    finally:
        destroy(name)


def plan_into(maps: LbMaps, cfg: Config) -> list[mapops.Op]:
    ops = planner.plan(cfg, maps.snapshot(), hz=clock.hz())
    maps.apply(ops)
    return ops


def new_datapath(instance: str) -> LbDatapath:
    cfg = config(instance, NEW_WEIGHTS)
    dp = LbDatapath(instance, lim=cfg.limits)
    plan_into(dp, cfg)
    return dp


def run_flows(prog: Any, *, first: bool) -> None:
    for sport, proto, syn in flows():
        prog.test_run(frame(sport, proto, syn=syn and first))


# -- the legacy layout -------------------------------------------------------------------


class LegacySlot(ctypes.Structure):
    _fields_ = [
        ("src", ctypes.c_uint32 * 4),
        ("dst", ctypes.c_uint32 * 4),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 27),
    ]


class LegacySet(ctypes.Structure):
    """``struct xdplb_conn_set`` of 3e42602 (bpf/include/xdplb_abi.h there)."""

    _fields_ = [
        ("lock", ctypes.c_uint32),
        ("rank", ctypes.c_uint8 * 4),
        ("tag", ctypes.c_uint32 * 4),
        ("backend_id", ctypes.c_uint32 * 4),
        ("hash", ctypes.c_uint32 * 4),
        ("seq", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("slot", LegacySlot * 4),
    ]


def legacy_object() -> Path:
    path = paths.test_object("lb_xdp_legacy")
    if not path.exists():
        pytest.fail(f"{path} is missing: `make {path.relative_to(paths.ROOT)}` builds it")
    return path


def load_legacy(instance: str, cfg: Config) -> BpfObject:
    """The legacy lb_xdp pinned as its release pinned it (maps in the pin root), its
    maps written from the plan (what that release's maps hold)."""
    obj = BpfObject.load(
        legacy_object(),
        pin_root=paths.pin_root(instance),
        max_entries=limits.map_sizes(cfg.limits),
    )
    maps = LbMaps({n: obj.map(n) for n in ("lb_vips", "lb_vip_addrs", "lb_backends",
                                          "lb_tables", "lb_btables", "lb_config")})  # fmt: skip
    for op in planner.plan(cfg, Snapshot(), hz=clock.hz()):
        match op:
            case mapops.SetConfig(c):
                raw = c.abi_value().pack()[: obj.map("lb_config").value_size]
                obj.map("lb_config").update(struct.pack("<I", 0), raw)  # a prefix of today's
            case mapops.PutBackend() | mapops.PutTable() | mapops.PutVip() | mapops.PutVipAddr():
                maps._apply(op)
    return obj


def legacy_entries(obj: BpfObject, backends: dict[int, IPAddress]) -> dict[bytes, dict[str, Any]]:
    """Every session of the legacy table, read with the ctypes mirror."""
    btf, tid = layout.map_btf(obj.map("lb_conns"))
    offsets = {f.name: f.offset for f in btf.fields(tid)}
    assert ctypes.sizeof(LegacySet) == obj.map("lb_conns").value_size
    assert offsets["seq"] == LegacySet.seq.offset
    assert offsets["slot[1].key.dport"] == LegacySet.slot.offset + 64 + LegacySlot.dport.offset
    out = {}
    raw = obj.map("lb_conns").lookup_array()
    for i in range(len(raw) // ctypes.sizeof(LegacySet)):
        s = LegacySet.from_buffer_copy(raw, i * ctypes.sizeof(LegacySet))
        for w in range(4):
            if not s.backend_id[w]:
                continue
            k = s.slot[w]
            key = abi.FlowKey(src=k.src, dst=k.dst, sport=k.sport, dport=k.dport, proto=k.proto)
            out[key.pack()] = {
                "backend": backends[s.backend_id[w]],
                "hash": s.hash[w],
                "state": abi.SessState.TCP_EST if k.proto == abi.IPPROTO_TCP else abi.SessState.UDP,
            }
    return out


def old_backends(m: Any) -> dict[int, IPAddress]:
    raw = m.lookup_array()
    size = ctypes.sizeof(abi.Backend)
    out = {}
    for bid in range(1, len(raw) // size):
        be = abi.Backend.from_buffer_copy(raw, bid * size)
        if be.family:
            out[bid] = abi.words_addr(be.addr, be.family)
    return out


# -- the next layout (a test build) ------------------------------------------------------


class NextEntry(ctypes.Structure):
    _fields_ = [("entry", abi.ConnEntry), ("test_extra", ctypes.c_uint32)]


class NextSet(ctypes.Structure):
    _fields_ = [("meta", abi.ConnMeta), ("way", NextEntry * 4)]


def next_entries(dp: LbDatapath, backends: dict[int, IPAddress]) -> dict[bytes, dict[str, Any]]:
    assert ctypes.sizeof(NextSet) == dp["lb_conns"].value_size == 64 + 4 * 68
    out = {}
    raw = dp["lb_conns"].lookup_array()
    for i in range(len(raw) // ctypes.sizeof(NextSet)):
        s = NextSet.from_buffer_copy(raw, i * ctypes.sizeof(NextSet))
        for w in range(4):
            if not s.meta.flags[w] & abi.SESS_F_USED:
                continue
            e = s.way[w].entry
            key = abi.FlowKey(src=e.src, dst=e.dst, sport=e.sport, dport=e.dport, proto=e.proto)
            out[key.pack()] = {
                "backend": backends[e.hop[0]],
                "hash": e.hash,
                "state": abi.SessState(s.meta.state[w]),
                "last_seen": s.meta.last_seen[w],
            }
    return out


# -- checking ----------------------------------------------------------------------------


def check_migrated(
    dp: LbDatapath, old: dict[bytes, dict[str, Any]], skipped: int, copied: int
) -> None:
    """Every old session whose backend the new maps have is in the new table, as it was;
    lb_xdp uses each on the flow's next packet."""
    removed = {k for k, v in old.items() if v["backend"] == abi_addr(BACKENDS["b4"])}
    assert skipped == len(removed) > 0
    assert copied == len(old) - len(removed)
    snap = dp.snapshot()
    addr = {i: b.addr for i, b in snap.backends.items()}
    new = dp.conns.entries()
    assert set(new) == set(old) - removed
    moved = 0
    for key, e in new.items():
        want = old[key]
        got = {"backend": addr[e.backend_id], "hash": e.hash, "state": e.state}
        if "last_seen" in want:
            got["last_seen"] = e.last_seen
        assert got == want, key.hex()
        assert e.flags & abi.SESS_F_IMPORTED and e.gen == snap.config.conn_gen
        assert e.be_gen == snap.backends[e.backend_id].gen
        moved += want["backend"] == abi_addr(BACKENDS["b1"])  # the table sends none there now
    assert moved > 0
    # Today's lb_xdp hits every migrated session on the flow's next packet.
    events = dp["lb_events"]

    def hits() -> int:
        return sum(
            struct.unpack("<Q", v)[0]
            for v in events.lookup_percpu(struct.pack("<I", abi.Event.CONN_HIT))
        )

    before = hits()
    run_flows(dp.program, first=False)
    sent_to_kept = sum(1 for p, proto, _ in flows() if key_of(p, proto) in new)
    assert hits() - before == sent_to_kept
    after = dp.conns.entries()
    assert {k: after[k].backend_id for k in new} == {k: e.backend_id for k, e in new.items()}


def events(m: Any) -> dict[abi.Event, int]:
    return {
        e: sum(struct.unpack("<Q", v)[0] for v in m.lookup_percpu(struct.pack("<I", e)))
        for e in abi.Event
    }


def check_counters_carried(up: Upgrade, dp: LbDatapath, old_dir: Path) -> None:
    """The old program's event counters, added to the new maps' by name."""
    with Map.from_pinned(old_dir / "lb_events") as m:
        old = events(m)
    assert old[abi.Event.CONN_MISS] >= len(list(flows()))
    assert up.carry_counters(dp.maps) >= len(abi.Event) - 6  # the legacy lacks 6 events
    new = events(dp["lb_events"])
    assert new[abi.Event.CONN_MISS] == old[abi.Event.CONN_MISS]
    assert new[abi.Event.CONN_HIT] == old[abi.Event.CONN_HIT]


def abi_addr(a: str) -> IPAddress:
    import ipaddress

    return ipaddress.ip_address(a)


def test_the_legacy_table_migrates_entry_by_entry(instance: str) -> None:
    old_cfg = config(instance, OLD_WEIGHTS)
    obj = load_legacy(instance, old_cfg)
    try:
        run_flows(obj.program("lb_xdp"), first=True)
        old = legacy_entries(obj, old_backends(obj.map("lb_backends")))
    finally:
        obj.close()
    assert {key_of(p, proto) for p, proto, _ in flows()} == set(old)
    assert layout.pinned_layouts(instance) == {paths.LEGACY_LAYOUT: paths.pin_root(instance)}
    up = Upgrade.prepare(instance, abi.ABI_VERSION)
    assert up is not None and up.from_versions == [paths.LEGACY_LAYOUT]
    with new_datapath(instance) as dp:
        snap = dp.snapshot()
        from xdplb.datapath.upgrade import new_maps_of

        backends = {i: (b.addr, b.active, b.gen) for i, b in snap.backends.items()}
        new = new_maps_of(backends, snap.config.seed, snap.config.conn_gen,
                          snap.config.conn_timeouts)  # fmt: skip
        r = up.copy(dp.conns, new, "pass 1")
        assert (r.found, r.busy, r.stale, r.expired) == (len(old), 0, 0, 0)
        again = up.copy(dp.conns, new, "pass 2")
        assert (again.copied, again.present) == (0, r.copied)
        check_counters_carried(up, dp, paths.pin_root(instance))
        check_migrated(dp, old, r.no_backend, r.copied)
        (paths.pin_root(instance) / paths.LINKS_DIR).mkdir()
        removed = up.remove_old()
        assert removed >= 10
    root = paths.pin_root(instance)
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [paths.LINKS_DIR, paths.layout_name(abi.ABI_VERSION)]
    )
    assert layout.pinned_layouts(instance) == {abi.ABI_VERSION: layout.pins_dir(instance)}


def test_the_next_layouts_table_migrates_entry_by_entry(instance: str) -> None:
    old_cfg = config(instance, OLD_WEIGHTS)
    nxt = paths.test_object("lb_xdp_abi_next")
    with LbDatapath(instance, nxt, lim=old_cfg.limits) as old_dp:
        assert old_dp.abi_version == abi.ABI_VERSION + 1 and not old_dp.conns_readable
        plan_into(old_dp, old_cfg)
        run_flows(old_dp.program, first=True)
        old = next_entries(old_dp, {i: b.addr for i, b in old_dp.snapshot().backends.items()})
        assert old_dp.counters().conns is None  # its count is unavailable, the rest is not
    assert {key_of(p, proto) for p, proto, _ in flows()} == set(old)
    syn = {key_of(p, proto) for p, proto, s in flows() if s}
    assert {k for k, v in old.items() if v["state"] is abi.SessState.TCP_SYN} == syn
    with OldTable(instance, abi.ABI_VERSION + 1, abi.ABI_VERSION) as table:
        assert table.ways.by_name["hop"][3][1].name == "way[3].hop[1]"
        assert sum(1 for s in table.sessions() if s is not None) == len(old)
    up = Upgrade.prepare(instance, abi.ABI_VERSION)
    assert up is not None and up.from_versions == [abi.ABI_VERSION + 1]
    with new_datapath(instance) as dp:
        snap = dp.snapshot()
        from xdplb.datapath.upgrade import new_maps_of

        backends = {i: (b.addr, b.active, b.gen) for i, b in snap.backends.items()}
        new = new_maps_of(backends, snap.config.seed, snap.config.conn_gen,
                          snap.config.conn_timeouts)  # fmt: skip
        r = up.copy(dp.conns, new, "pass 1")
        assert (r.found, r.busy, r.stale, r.expired, r.evicted) == (len(old), 0, 0, 0, 0)
        check_counters_carried(up, dp, paths.layout_dir(instance, abi.ABI_VERSION + 1))
        check_migrated(dp, old, r.no_backend, r.copied)
        # Flows the old program records after pass 1 (before the swap): pass 2 takes
        # exactly those, and leaves what the new program has recorded since.
        with LbDatapath(instance, nxt, lim=old_cfg.limits) as old_dp:
            for p in LATE_PORTS:
                old_dp.program.test_run(frame(p, abi.IPPROTO_UDP, syn=False))
            late = next_entries(old_dp, {i: b.addr for i, b in old_dp.snapshot().backends.items()})
        late_keys = {key_of(p, abi.IPPROTO_UDP) for p in LATE_PORTS}
        assert set(late) == set(old) | late_keys
        kept = sum(1 for k in late_keys if late[k]["backend"] != abi_addr(BACKENDS["b4"]))
        r2 = up.copy(dp.conns, new, "pass 2")
        assert (r2.copied, r2.present, r2.no_backend - r.no_backend) == (
            kept,
            r.copied,
            len(late_keys) - kept,
        )
        entries = dp.conns.entries()
        assert late_keys - set(entries) == {
            k for k in late_keys if late[k]["backend"] == abi_addr(BACKENDS["b4"])
        }
        up.remove_old()
    assert layout.pinned_layouts(instance) == {abi.ABI_VERSION: layout.pins_dir(instance)}


def test_a_layout_without_a_key_field_is_refused_naming_it(instance: str) -> None:
    cfg = config(instance, OLD_WEIGHTS)
    with LbDatapath(instance, paths.test_object("lb_xdp_abi_bad"), lim=cfg.limits):
        pass
    with pytest.raises(UpgradeRefused) as e:
        Upgrade.prepare(instance, abi.ABI_VERSION)
    msg = str(e.value)
    assert "lb_conns: no field dport in a way" in msg
    assert f"`xdplb stop -i {instance}`" in msg and "drops every connection" in msg
    assert f"abi-{abi.ABI_VERSION + 1} to abi-{abi.ABI_VERSION}" in msg
    # Its pins are untouched, and a reader of this xdplb's layout says which one runs.
    assert list(layout.pinned_layouts(instance)) == [abi.ABI_VERSION + 1]
    runs = f"instance {instance} runs layout abi-{abi.ABI_VERSION + 1}; "
    reads = f"this xdplb reads abi-{abi.ABI_VERSION}"
    with pytest.raises(layout.LayoutMismatch, match=runs + reads):
        layout.pins_dir(instance)


def test_way_fields_are_found_by_name_in_every_layout() -> None:
    for path, seq, backend in [
        (paths.bpf_object("lb_xdp"), "meta.seq", "way[2].hop[0]"),
        (paths.test_object("lb_xdp_abi_next"), "meta.seq", "way[2].hop[0]"),
        (legacy_object(), "seq", "backend_id[2]"),
    ]:
        btf = layout.object_btf(path)
        wf = WayFields.find(btf, btf.find("xdplb_conn_set").id)
        assert wf.ways == 4 and wf.seq is not None and wf.seq.name == seq
        name = "hop" if "hop" in wf.by_name else "backend_id"
        assert wf.by_name[name][2][0].name == backend
        assert [f.name for f in wf.by_name["src"][1]][:1] in (["way[1].src[0]"],
                                                              ["slot[1].key.src[0]"])  # fmt: skip
