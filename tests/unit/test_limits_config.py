"""Map sizes from the configuration (``limits:``): validation, what each map gets, and
the capacity checks that refuse a change before anything is written."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from xdplb.config import Config, LimitsConfig, check_limits_unchanged, parse_config
from xdplb.control.planner import apply_to_snapshot, desired_config, plan
from xdplb.control.status import MapStatus, Status
from xdplb.core import abi, limits
from xdplb.core.errors import ConfigError
from xdplb.core.state import BackendState, Snapshot
from xdplb.daemon.metrics import families

pytestmark = pytest.mark.unit

TUNNEL = {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"}


def cfg(vip_list: list[dict[str, Any]], /, **limits_: int) -> Config:
    doc: dict[str, Any] = {"tunnel": TUNNEL, "table_size": 251, "vips": vip_list}
    if limits_:
        doc["limits"] = limits_
    return parse_config(doc)


def vip(i: int, *backends: str, **kw: Any) -> dict[str, Any]:
    return {
        "address": f"198.18.100.{i}",
        "port": 80,
        "backends": [{"address": b} for b in backends],
        **kw,
    }


def refused(doc_or_call: Any) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        doc_or_call()
    return e.value


# --- defaults and validation ----------------------------------------------------------------


def test_defaults_are_the_compile_time_sizes() -> None:
    lim = Config().limits
    assert (lim.vips, lim.backends, lim.conn_table, lim.hc_targets) == (
        abi.MAX_VIPS,
        abi.MAX_BACKENDS,
        abi.CONN_ENTRIES,
        abi.MAX_HC_TARGETS,
    )
    assert (lim.acl_rules, lim.rate_limit_sources) == (16384, 65536)
    sizes = limits.map_sizes(lim)
    assert sizes["lb_vips"] == 2 * abi.MAX_VIPS
    assert sizes["lb_conns"] == abi.CONN_SETS
    assert sizes["lb_backends"] == sizes["lb_be_stats"] == abi.MAX_BACKENDS
    assert sizes["hc_targets"] == abi.MAX_HC_TARGETS
    assert sizes["lb_acl4"] == sizes["lb_acl6"] == 16384
    assert sizes["lb_rate"] == 65536
    assert lim.conn_mask == abi.CONN_SETS - 1
    assert desired_config(Config()).conn_mask == abi.CONN_SETS - 1


def test_configured_sizes_reach_every_map_and_the_mask() -> None:
    c = cfg([], vips=8, backends=64, conn_table=1024, hc_targets=16, acl_rules=32)
    sizes = limits.map_sizes(c.limits)
    assert sizes["lb_vips"] == 16
    assert {sizes[n] for n in ("lb_vip_addrs", "lb_tables", "lb_btables", "lb_vip_stats")} == {8}
    assert sizes["lb_backends"] == sizes["lb_nexthops"] == 64
    assert sizes["lb_conns"] == 256
    assert desired_config(c).conn_mask == 255
    assert limits.config_key("lb_conns") == "limits.conn_table"
    assert limits.config_key("lb_acl6") == "limits.acl_rules"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (
            100000,
            "must be a power of 2 (sets of 4 ways, a power-of-2 number of sets), got 100000"
            ": 65536 or 131072?",
        ),
        (32, "must be between 64 and 67108864, got 32"),
        (1 << 27, "must be between 64 and 67108864"),
    ],
)
def test_conn_table_is_validated_not_rounded(value: int, text: str) -> None:
    e = refused(lambda: cfg([], conn_table=value))
    assert e.field == "limits.conn_table"
    assert text in e.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vips", 0),
        ("backends", 1),
        ("hc_targets", 0x10000),
        ("acl_rules", 0),
        ("rate_limit_sources", 1 << 25),
    ],
)
def test_limits_out_of_bounds_name_the_field(field: str, value: int) -> None:
    e = refused(lambda: cfg([], **{field: value}))
    assert e.field == f"limits.{field}"
    assert "must be between" in e.message


def test_unknown_limit_is_refused() -> None:
    e = refused(lambda: parse_config({"limits": {"conns": 1024}}))
    assert e.field == "limits.conns"


# --- the configuration must fit ------------------------------------------------------------


def test_more_vips_than_the_limit_is_refused() -> None:
    vips = [vip(i, "198.18.0.11") for i in range(1, 5)]
    assert len(cfg(vips, vips=4).vips) == 4
    e = refused(lambda: cfg(vips, vips=3))
    assert (e.field, e.message) == ("limits.vips", "4 VIPs configured, the limit is 3")


def test_more_backends_than_the_slots_is_refused() -> None:
    vips = [vip(1, *(f"198.18.0.{i}" for i in range(10, 14)))]
    assert len(cfg(vips, backends=5).backend_addresses()) == 4  # slot 0 is never one
    e = refused(lambda: cfg(vips, backends=4))
    assert e.field == "limits.backends"
    assert "4 distinct backends configured, at most 3 fit" in e.message


def test_more_tunnelled_health_targets_than_the_limit_is_refused() -> None:
    hc = {"checker": {"tcp": {}}, "fall_count": 1, "interval_ms": 1000, "rise_count": 1}
    vips = [vip(1, "198.18.0.11", "198.18.0.12", health=hc)]
    e = refused(lambda: cfg(vips, hc_targets=1))
    assert (e.field, e.message) == (
        "limits.hc_targets",
        "2 tunnelled health-check targets configured, the limit is 1",
    )
    assert cfg(vips, hc_targets=2).limits.hc_targets == 2


def test_more_acl_rules_than_the_limit_is_refused() -> None:
    """Counted per family (one trie each), global and per-VIP rules together."""
    acl = {"deny": ["198.19.1.0/24", "198.19.2.0/24", "fd78:6470:6c62:7::/64"]}
    vips = [vip(1, "198.18.0.11", acl={"allow": ["198.18.0.0/24"]})]
    doc: dict[str, Any] = {"tunnel": TUNNEL, "table_size": 251, "vips": vips, "acl": acl}
    assert parse_config({**doc, "limits": {"acl_rules": 3}}).limits.acl_rules == 3
    e = refused(lambda: parse_config({**doc, "limits": {"acl_rules": 2}}))
    assert (e.field, e.message) == (
        "limits.acl_rules",
        "3 IPv4 ACL rules configured, the limit is 2",
    )


# --- what a change needs on the way: planner.check_capacity ----------------------------------


def test_a_vip_moving_to_a_fresh_id_needs_a_spare_id() -> None:
    """A VIP whose table changes size moves to a fresh id (its old one is freed at the
    end of the plan): with every id in use the change is refused, naming the field,
    before any operation is produced."""
    before = cfg([vip(i, "198.18.0.11") for i in (1, 2)], vips=2)
    snap = apply_to_snapshot(Snapshot(), plan(before, Snapshot()))
    grown = cfg([vip(1, "198.18.0.11", table_size=1009), vip(2, "198.18.0.11")], vips=2)
    e = refused(lambda: plan(grown, snap))
    assert e.field == "limits.vips"
    assert "needs 3 VIP ids at once" in e.message
    roomy = cfg([vip(1, "198.18.0.11", table_size=1009), vip(2, "198.18.0.11")], vips=3)
    after = apply_to_snapshot(snap, plan(roomy, snap))
    assert {p.vip_id for p in after.vips.values()} == {1, 2}


def test_replacing_backends_needs_their_old_slots_until_the_end() -> None:
    """New backends get ids while the old ones are still active (connection entries and
    tables name them until the plan's deletions): both must fit."""
    before = cfg([vip(1, "198.18.0.11", "198.18.0.12")], backends=4)
    snap = apply_to_snapshot(Snapshot(), plan(before, Snapshot()))
    after = cfg([vip(1, "198.18.0.13", "198.18.0.14")], backends=4)
    e = refused(lambda: plan(after, snap))
    assert e.field == "limits.backends"
    assert "needs 4 backend slots at once (2 active now" in e.message
    ok = cfg([vip(1, "198.18.0.13", "198.18.0.14")], backends=5)
    out = apply_to_snapshot(snap, plan(ok, snap))
    assert max(out.backends) == 4


def test_plans_stay_within_the_configured_ids() -> None:
    c = cfg([vip(i, f"198.18.0.{10 + i}") for i in range(1, 4)], vips=3, backends=4)
    snap = apply_to_snapshot(Snapshot(), plan(c, Snapshot()))
    assert {p.vip_id for p in snap.vips.values()} == {0, 1, 2}
    assert set(snap.backends) == {1, 2, 3}


def test_new_vip_addresses_must_fit_next_to_the_old_ones() -> None:
    snap = Snapshot(vip_addrs={ipaddress.ip_address("198.18.100.9"): 1})
    snap.backends[1] = BackendState(ipaddress.ip_address("198.18.0.11"))
    e = refused(lambda: plan(cfg([vip(1, "198.18.0.11")], vips=1), snap))
    assert e.field == "limits.vips"
    assert "2 VIP addresses at once" in e.message


# --- a running instance keeps its sizes --------------------------------------------------------


def test_changing_limits_while_running_names_the_field() -> None:
    old = LimitsConfig()
    check_limits_unchanged(old, LimitsConfig())
    e = refused(lambda: check_limits_unchanged(old, LimitsConfig(conn_table=65536)))
    assert e.field == "limits.conn_table"
    assert "cannot change while running (262144 -> 65536)" in e.message


def test_a_pinned_size_mismatch_says_how_to_start_afresh() -> None:
    e = limits.PinnedSizeMismatch("lb_conns", 65536, 16384).error("lab")
    assert e.field == "limits.conn_table"
    assert "pinned lb_conns holds 262144 connections" in e.message
    assert "asks for 65536" in e.message
    assert "xdplb stop -i lab" in e.message and "connection table" in e.message
    e = limits.PinnedSizeMismatch("lb_vips", 1024, 64).error("lab")
    assert (e.field, "holds 512 entries" in e.message) == ("limits.vips", True)
    assert limits.mismatches({"lb_conns": 4, "lb_vips": 8}, {"lb_conns": 4, "lb_vips": 2}) == [
        limits.PinnedSizeMismatch("lb_vips", 8, 2)
    ]


# --- fill levels in the metrics ------------------------------------------------------------------


def test_map_fill_levels_are_gauges() -> None:
    st = Status.model_validate(
        {
            "source": "daemon",
            "instance": "lab",
            "config_path": "/x",
            "attached": [],
            "runtime_changes": False,
            "uptime": 1.0,
            "vips": [],
            "drops": {},
            "events": {},
            "conn_table": {"capacity": 1024, "used": 12},
            "maps": [
                MapStatus(
                    name="lb_conns",
                    config_key="limits.conn_table",
                    entries=12,
                    max_entries=1024,
                    estimated=True,
                ).model_dump(),
                MapStatus(
                    name="lb_vips", config_key="limits.vips", entries=3, max_entries=16
                ).model_dump(),
            ],
            "rebuilds": 0,
            "last_rebuild_ms": None,
            "health_checks": 0,
        }
    )
    fams = {f.name: f for f in families(st)}
    got = {
        (f, s.labels["map"]): s.value
        for f in ("xdplb_map_entries", "xdplb_map_max_entries")
        for s in fams[f].samples
    }
    assert got == {
        ("xdplb_map_entries", "lb_conns"): 12,
        ("xdplb_map_entries", "lb_vips"): 3,
        ("xdplb_map_max_entries", "lb_conns"): 1024,
        ("xdplb_map_max_entries", "lb_vips"): 16,
    }


def test_the_model_takes_the_backend_slots_from_its_state() -> None:
    """An id at or beyond lb_backends' size has no slot (the array lookup finds none),
    whatever the backends mapping says: the model follows ``max_backends``."""
    from xdplb import model as m

    be = BackendState(ipaddress.ip_address("198.18.0.11"))
    s = m.DataplaneState({}, {1: be, 20: be}, {}, desired_config(Config()), max_backends=16)
    assert s.backend_usable(1) and not s.backend_usable(20) and not s.backend_usable(0)
    assert m.DataplaneState({}, {20: be}, {}, s.config).backend_usable(20)  # default 4096
