"""Map sizes from ``limits:`` in the real objects: the loader sizes maps by name, a
pinned map of another size is refused before loading, and lb_xdp with a small
connection table keeps every flow in the sets its lb_config mask names -- and still
decides exactly as the model does."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lb_harness import serial
from test_differential import (
    TCP_ACK,
    ModelLb,
    assert_none,
    event_deltas,
    make_state,
    random_flows,
    run_all,
    untimed,
)

from xdplb.config import LimitsConfig
from xdplb.core import abi, hashing, limits, paths
from xdplb.core.errors import ConfigError
from xdplb.core.mapops import SetConfig
from xdplb.core.state import ConnEntry, LbConfig
from xdplb.datapath import BpfObject
from xdplb.datapath.lb import LbDatapath, LbMaps, check_pins, destroy
from xdplb.datapath.objects import PinnedSizeError

pytestmark = pytest.mark.bpf

#: 1024 connections: 256 sets of 4 ways.
SMALL = LimitsConfig(vips=64, backends=4096, conn_table=1024, hc_targets=32)


@pytest.fixture
def pin_root() -> Iterator[Path]:
    root = Path(f"/sys/fs/bpf/xdplbt-lim-{os.getpid()}-{next(serial)}")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _sizes(obj: BpfObject) -> dict[str, int]:
    return {n: m.max_entries for n, m in obj.maps.items() if n in limits.SIZED_MAPS}


def test_default_limits_are_the_objects_own_sizes(pin_root: Path) -> None:
    """The configuration's defaults are exactly the sizes compiled into the objects."""
    want = limits.map_sizes(LimitsConfig())
    for name in ("lb_xdp", "hc_tc"):
        with BpfObject.load(paths.bpf_object(name), pin_root=pin_root / name) as obj:
            sized = _sizes(obj)
            assert sized and sized == {n: want[n] for n in sized}


def test_configured_sizes_are_the_maps_sizes(pin_root: Path) -> None:
    want = limits.map_sizes(SMALL)
    for name in ("lb_xdp", "hc_tc"):
        with BpfObject.load(
            paths.bpf_object(name), pin_root=pin_root / name, max_entries=want
        ) as obj:
            sized = _sizes(obj)
            assert sized == {n: want[n] for n in sized}
    # And the pins carry them: a reload with the same sizes reuses them.
    with BpfObject.load(
        paths.bpf_object("lb_xdp"), pin_root=pin_root / "lb_xdp", max_entries=want
    ) as obj:
        assert obj.map("lb_conns").max_entries == 256


def test_a_pinned_map_of_another_size_is_refused_before_loading(pin_root: Path) -> None:
    with BpfObject.load(
        paths.bpf_object("lb_xdp"), pin_root=pin_root, max_entries=limits.map_sizes(SMALL)
    ):
        pass
    before = sorted(p.name for p in pin_root.iterdir())
    bigger = limits.map_sizes(SMALL.model_copy(update={"conn_table": 4096}))
    with pytest.raises(PinnedSizeError) as e:
        BpfObject.load(paths.bpf_object("lb_xdp"), pin_root=pin_root, max_entries=bigger)
    assert e.value.mismatches == [("lb_conns", 256, 1024)]
    assert sorted(p.name for p in pin_root.iterdir()) == before


def test_the_datapath_names_the_field_and_the_way_out() -> None:
    """LbDatapath and the daemon's pre-check turn a size mismatch into a ConfigError
    naming ``limits.*``; ``xdplb stop``'s destroy() makes room for the new size."""
    instance = f"xdplbt-lim-{os.getpid()}-{next(serial)}"
    try:
        LbDatapath(instance, lim=SMALL).close()
        changed = SMALL.model_copy(update={"conn_table": 4096})
        with pytest.raises(ConfigError) as e:
            check_pins(instance, changed)
        assert e.value.field == "limits.conn_table"
        assert "pinned lb_conns holds 1024 connections" in e.value.message
        assert f"xdplb stop -i {instance}" in e.value.message
        with pytest.raises(ConfigError) as e2:
            LbDatapath(instance, lim=changed)
        assert e2.value.field == "limits.conn_table"
        with pytest.raises(ConfigError) as e3:
            check_pins(instance, SMALL.model_copy(update={"vips": 32}))
        assert e3.value.field == "limits.vips"
        check_pins(instance, SMALL)
        destroy(instance)
        with LbDatapath(instance, lim=changed) as dp:
            assert dp["lb_conns"].max_entries == 1024
            assert dp.conns.capacity == 4096
    finally:
        destroy(instance)


def test_a_mask_beyond_the_table_is_never_written(pin_root: Path) -> None:
    with BpfObject.load(
        paths.bpf_object("lb_xdp"), pin_root=pin_root, max_entries=limits.map_sizes(SMALL)
    ) as obj:
        maps = LbMaps({n: obj.map(n) for n in ("lb_config", "lb_conns")})
        ok = LbConfig(None, None, conn_mask=255)
        maps.apply([SetConfig(ok)])
        for bad in (511, 100, abi.CONN_SETS - 1):
            with pytest.raises(ValueError, match="does not fit lb_conns' 256 sets"):
                maps.apply([SetConfig(replace(ok, conn_mask=bad))])
        raw = obj.map("lb_config").lookup(bytes(4))
        assert raw is not None and abi.Config.from_buffer_copy(raw).conn_mask == 255


@pytest.fixture(scope="module")
def small_mlb(lb_netns: Any) -> Iterator[ModelLb]:
    """lb_xdp with a 1024-connection table, in the conftest's lab namespace."""
    root = Path(f"/sys/fs/bpf/xdplbt-lim-{os.getpid()}-{next(serial)}")
    obj = BpfObject.load(paths.bpf_object("lb_xdp"), pin_root=root, max_entries={"lb_conns": 256})
    mac = bytes.fromhex(lb_netns.lb_mac.replace(":", ""))
    harness = ModelLb(obj, lb_netns.lb_ifindex, mac, [])
    try:
        yield harness
    finally:
        for inner in harness.inner_maps:
            inner.close()
        obj.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_small_conn_table_keeps_flows_in_its_sets_and_matches_the_model(
    small_mlb: ModelLb,
) -> None:
    """3000 new flows into 256 sets of 4: every session sits in set sess_hash & 255 with
    that hash as its tag, the table never holds more than 1024, each insert into a full
    set evicts one (counted CONN_EVICT), and every packet -- the new flows, then the
    same flows again against whatever the table kept -- leaves exactly as the model
    says, counters included."""
    state = make_state()
    state = replace(state, config=replace(state.config, conn_mask=255), conns={})
    small_mlb.load_state(state)
    flows = random_flows(state, 3000, seed=77)
    conns: dict[bytes, ConnEntry] = {}
    ev0 = small_mlb.counters("lb_events", len(abi.Event))
    first, problems, _ = run_all(small_mlb, state, flows, conns)
    assert_none(problems)
    assert all(d.events == (abi.Event.CONN_MISS, abi.Event.CONN_INSERT) for d in first)

    table = small_mlb.table
    assert (table.sets_count, table.capacity, table.mask) == (256, 1024, 255)
    seed = state.config.seed
    kept = 0
    for e in table.iter_entries():
        h = hashing.sess_hash(e.key, seed)
        raw = table.map.lookup(e.set.to_bytes(4, "little"))
        assert raw is not None
        assert h & 255 == e.set and abi.ConnSet.from_buffer_copy(raw).meta.tag[e.way] == h
        kept += 1
    # 3000 flows over 256 sets: almost every set filled, the rest of the flows evicted.
    assert 900 < kept <= 1024
    got = small_mlb.counters("lb_events", len(abi.Event)) - ev0
    want = event_deltas(first)
    want[abi.Event.CONN_EVICT] = len(flows) - kept
    assert dict(zip(abi.Event, got.tolist(), strict=True)) == dict(
        zip(abi.Event, want.tolist(), strict=True)
    )
    entries = small_mlb.conns()
    assert len(entries) == kept
    model_conns = untimed(conns)
    assert all(model_conns[k] == v for k, v in entries.items())  # what it kept is right

    # Again, as packets of open connections: the flows the table kept hit (a hit moves
    # a SYN's session to TCP_EST), then the evicted ones are placed again by the table,
    # same backend, each insert into a full set evicting one.
    backend_of = {f.key(): d.backend_id for f, d in zip(flows, first, strict=True)}
    for subset, event in (
        ([f for f in flows if f.key() in entries], abi.Event.CONN_HIT),
        ([f for f in flows if f.key() not in entries], abi.Event.CONN_MISS),
    ):
        assert subset
        live = dict(small_mlb.conns())
        occupied = Counter(hashing.sess_hash(k, seed) & 255 for k in live)
        state = replace(state, conns=live)
        ev0 = small_mlb.counters("lb_events", len(abi.Event))
        again, problems, _ = run_all(small_mlb, state, subset, live, TCP_ACK)
        assert_none(problems)
        assert all(event in d.events for d in again)
        assert [d.backend_id for d in again] == [backend_of[f.key()] for f in subset]
        got = small_mlb.counters("lb_events", len(abi.Event)) - ev0
        want = event_deltas(again)
        inserts = Counter(
            hashing.sess_hash(d.conn_insert[0], seed) & 255
            for d in again
            if d.conn_insert is not None
        )
        want[abi.Event.CONN_EVICT] = sum(
            max(0, min(n, occupied[s] + n - abi.CONN_WAYS)) for s, n in inserts.items()
        )
        assert np.array_equal(got, want)
        # What the table holds is what the model wrote last (the model does not evict).
        held = small_mlb.conns()
        assert len(held) <= table.capacity
        model_conns = untimed(live)
        assert all(model_conns[k] == v for k, v in held.items())
