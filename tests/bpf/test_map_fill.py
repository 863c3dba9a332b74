"""Map fill is honest: an array always has max_entries slots, so its fill counts the
slots the ids in use occupy. A fresh instance with one VIP shows low fill for every map
(lb_nexthops and lb_acl_hits said 100 % before), N backends show N, and the pins say
what the daemon's maps say, lb_nexthops (not pinned) included."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from xdplb.config import parse_config
from xdplb.control import planner
from xdplb.control.status import from_pins
from xdplb.core import abi
from xdplb.datapath.lb import LbDatapath, destroy
from xdplb.datapath.maps import MapType

pytestmark = pytest.mark.bpf

ARRAYS = {MapType.ARRAY, MapType.PERCPU_ARRAY, MapType.ARRAY_OF_MAPS}
TUNNEL = {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"}


def config(instance: str, n_vips: int, n_backends: int) -> Any:
    backends = [{"address": f"198.18.0.{10 + i}"} for i in range(n_backends)]
    vips = [
        {"address": f"198.18.100.{1 + i}", "port": 80, "backends": backends} for i in range(n_vips)
    ]
    return parse_config({"instance": instance, "tunnel": TUNNEL, "vips": vips})


@pytest.fixture
def instance() -> Iterator[str]:
    name = f"filltest-{os.getpid()}"
    try:
        yield name
    finally:
        destroy(name)


def fill_of(dp: LbDatapath) -> dict[str, tuple[int, int]]:
    snap = dp.snapshot()
    return {f.name: (f.entries, f.max_entries) for f in dp.fill(snap, conns_used=0)}


def test_array_fill_counts_the_ids_in_use(instance: str) -> None:
    dp = LbDatapath(instance)
    try:
        arrays = {n for n, m in dp.maps.items() if m.type in ARRAYS}
        assert {"lb_nexthops", "lb_acl_hits", "lb_backends", "lb_vip_stats"} <= arrays
        dp.apply(planner.plan(config(instance, 1, 1), dp.snapshot()))
        fresh = fill_of(dp)
        # No map of a fresh instance is full, the arrays least of all.
        full = {n: f for n, f in fresh.items() if f[0] >= f[1]}
        assert full == {}, full
        assert fresh["lb_nexthops"] == (1, 4096)
        assert fresh["lb_backends"] == fresh["lb_be_stats"] == (1, 4096)
        assert fresh["lb_vip_stats"][0] == fresh["lb_tables"][0] == 1
        assert fresh["lb_acl_hits"][0] == 2 * len(abi.AclList)  # the VIP's slot, the global
        assert {m.name: (m.entries, m.max_entries) for m in from_pins(instance).maps} == fresh

        n_vips, n_backends = 5, 37
        dp.apply(planner.plan(config(instance, n_vips, n_backends), dp.snapshot()))
        grown = fill_of(dp)
        for name in ("lb_nexthops", "lb_backends", "lb_be_stats"):
            assert grown[name][0] == n_backends, name
        for name in ("lb_vip_stats", "lb_tables", "lb_vips"):
            assert grown[name][0] == n_vips, name
        assert grown["lb_acl_hits"][0] == (n_vips + 1) * len(abi.AclList)

        # The pins (the CLI with no daemon) say the same of every map.
        pins = {m.name: (m.entries, m.max_entries) for m in from_pins(instance).maps}
        assert pins == grown
    finally:
        dp.close()
