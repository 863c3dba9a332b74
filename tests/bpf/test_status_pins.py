"""The status read from the pins (the CLI's, when no daemon answers) against loaded
lb_xdp maps: what the daemon's status built from the same maps says of VIPs, backends,
shares and map fill (tests/unit/test_status.py compares the two schemas)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from xdplb.config import parse_config
from xdplb.control import planner
from xdplb.control.status import (
    BackendView,
    DaemonView,
    MapsView,
    VipView,
    build,
    from_pins,
)
from xdplb.datapath.lb import LbDatapath, destroy

pytestmark = pytest.mark.bpf

CONFIG = {
    "tunnel": {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"},
    "vips": [
        {
            "address": "198.18.100.1",
            "port": 80,
            "backends": [{"address": "198.18.0.11", "weight": 3}, {"address": "198.18.0.12"}],
        },
        {
            "address": "fd78:6470:6c62:100::1",
            "port": 53,
            "protocol": "udp",
            "table": "beamer",
            "backends": [{"address": "fd78:6470:6c62::11"}, {"address": "198.18.0.12"}],
        },
    ],
}


@pytest.fixture(scope="module")
def instance() -> Iterator[str]:
    name = f"sttest-{os.getpid()}"
    try:
        yield name
    finally:
        destroy(name)


def test_the_pins_give_the_daemons_schema_and_the_maps_values(instance: str) -> None:
    cfg = parse_config({**CONFIG, "instance": instance})
    dp = LbDatapath(instance)
    try:
        dp.apply(planner.plan(cfg, dp.snapshot()))
        snap = dp.snapshot()
        counters = dp.counters(snap=snap)
        maps = MapsView(
            instance=instance,
            snapshot=snap,
            counters=counters,
            conns_estimated=False,
            fill=dp.fill(snap, conns_used=counters.conns),
            attached=dp.attached(),
            conn_capacity=dp.conns.capacity,
        )
        daemon = DaemonView(
            config_path="/etc/xdplb/st.yaml",
            runtime_changes=False,
            uptime=1.0,
            rebuilds=1,
            last_rebuild_ms=None,
            health_checks=0,
            vips=[
                VipView.configured(
                    v,
                    table_size=cfg.vip_table_size(v),
                    all_down=False,
                    backends=[BackendView(b.address, b.weight, b.weight) for b in v.backends],
                )
                for v in cfg.vips
            ],
        )
        pins = from_pins(instance)  # another set of descriptors, as the CLI opens them
    finally:
        dp.close()
    st = build(maps, daemon)
    # lb_nexthops (a per-CPU cache, not pinned) too: its size is lb_backends'.
    assert st.maps == pins.maps
    assert pins.model_dump(exclude={"maps"}) == build(maps).model_dump(exclude={"maps"})
    assert (pins.source, st.source, pins.uptime) == ("pins", "daemon", None)
    for pv, dv in zip(pins.vips, st.vips, strict=True):
        same = {"name", "id", "encap", "hash", "table", "table_size", "packets"}
        assert pv.model_dump(include=same) == dv.model_dump(include=same)
        got = {(b.address, b.id, b.table_share) for b in pv.backends}
        assert got == {(b.address, b.id, b.table_share) for b in dv.backends}
    shares = {b.address: b.table_share for b in pins.vips[0].backends}
    assert shares["198.18.0.11"] == pytest.approx(0.75, abs=0.02)
    assert pins.conn_table == st.conn_table
