"""ACLs, the rate limit and the insert budget without a kernel: the configuration, the
planner's operations and their order, and the model's decisions."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import pytest

from xdplb import model
from xdplb.config import Config, parse_config
from xdplb.control.planner import apply_to_snapshot, plan
from xdplb.core import abi
from xdplb.core.acl import AclIndex, AclKey, rate_key
from xdplb.core.mapops import DeleteAcl, PutAcl, PutTable, PutVip, SetConfig
from xdplb.core.state import BackendState, LbConfig, LookupTable, Snapshot, Vip, VipParams
from xdplb.model import frames

pytestmark = pytest.mark.unit

N = ipaddress.ip_network
A = ipaddress.ip_address
G = abi.ACL_GLOBAL
ALLOW, DENY, DEFAULT = abi.AclList.ALLOW, abi.AclList.DENY, abi.AclList.DEFAULT


def config(
    acl: dict[str, Any] | None = None, vip_acl: dict[str, Any] | None = None, **kw: Any
) -> Config:
    vip: dict[str, Any] = {
        "address": "198.18.100.1",
        "port": 80,
        "backends": [{"address": "198.18.0.11"}],
    }
    if vip_acl is not None:
        vip["acl"] = vip_acl
    doc: dict[str, Any] = {"tunnel": {"source_v4": "198.18.0.2"}, "vips": [vip], **kw}
    if acl is not None:
        doc["acl"] = acl
    return parse_config(doc)


# --- configuration -------------------------------------------------------------------------


def test_flood_section_sets_lb_config() -> None:
    snap = apply_to_snapshot(Snapshot(), plan(config(), Snapshot()))
    assert (snap.config.flood_max, snap.config.rl_rate, snap.config.flags) == (12500, 0, 0)
    cfg = config(
        flood={
            "conn_insert_budget": 2000,
            "rate_limit": {"new_flows_per_second": 50, "prefix_v4": 24, "prefix_v6": 56},
        }
    )
    c = apply_to_snapshot(Snapshot(), plan(cfg, Snapshot())).config
    assert (c.flood_max, c.rl_rate, c.rl_burst, c.rl_prefix4, c.rl_prefix6) == (200, 50, 50, 24, 56)
    assert config(flood={"conn_insert_budget": 0}).flood.flood_max == 0
    assert config(flood={"conn_insert_budget": 3}).flood.flood_max == 1  # never rounded to "off"


# --- the planner ---------------------------------------------------------------------------


def test_acl_rules_and_flags() -> None:
    cfg = config({"deny": ["198.18.9.0/24"]}, {"allow": ["198.18.7.0/24", "fd78:6470:6c62::/48"]})
    snap = apply_to_snapshot(Snapshot(), plan(cfg, Snapshot()))
    (params,) = snap.vips.values()
    vid = params.vip_id
    assert snap.acl == {
        AclKey(G, N("198.18.9.0/24")): DENY,
        AclKey(vid, N("198.18.7.0/24")): ALLOW,
        AclKey(vid, N("fd78:6470:6c62::/48")): ALLOW,
    }
    assert snap.config.flags == abi.CFG_F_ACL
    assert params.flags == abi.VIP_F_ACL | abi.VIP_F_ACL_DENY
    cfg2 = config({"allow": ["198.18.0.0/15"]})
    snap2 = apply_to_snapshot(snap, plan(cfg2, snap))
    assert snap2.config.flags == abi.CFG_F_ACL | abi.CFG_F_ACL_DENY
    assert snap2.acl == {AclKey(G, N("198.18.0.0/15")): ALLOW}
    assert next(iter(snap2.vips.values())).flags == 0


def test_acl_changes_touch_no_table_and_add_before_they_remove() -> None:
    cfg = config({"deny": ["198.18.9.0/24", "198.18.10.0/24"]})
    snap = apply_to_snapshot(Snapshot(), plan(cfg, Snapshot()))
    ops = plan(config({"deny": ["198.18.10.0/24", "198.18.11.0/24"]}), snap)
    assert ops == [
        PutAcl(AclKey(G, N("198.18.11.0/24")), DENY),
        DeleteAcl(AclKey(G, N("198.18.9.0/24"))),
    ]
    # A VIP's allow list appearing: rules first, then the VIP's flags.
    ops = plan(
        config({"deny": ["198.18.9.0/24", "198.18.10.0/24"]}, {"allow": ["198.18.7.0/24"]}), snap
    )
    assert [type(op) for op in ops] == [PutAcl, PutVip]
    assert not any(isinstance(op, PutTable) for op in ops)
    # The global ACL going away: flags off first, rules deleted last.
    ops = plan(config(), snap)
    assert [type(op) for op in ops] == [SetConfig, DeleteAcl, DeleteAcl]


def test_a_vip_moving_to_a_fresh_id_finds_its_rules_in_place() -> None:
    cfg = config(vip_acl={"deny": ["198.18.9.0/24"]})
    snap = apply_to_snapshot(Snapshot(), plan(cfg, Snapshot()))
    old = next(iter(snap.vips.values())).vip_id
    moved = config(vip_acl={"deny": ["198.18.9.0/24"]}, table_size=251)
    ops = plan(moved, snap)
    new = next(op.params.vip_id for op in ops if isinstance(op, PutVip))
    assert new != old
    put = ops.index(PutAcl(AclKey(new, N("198.18.9.0/24")), DENY))
    assert put < next(i for i, op in enumerate(ops) if isinstance(op, PutVip))
    assert ops[-1] == DeleteAcl(AclKey(old, N("198.18.9.0/24")))
    assert set(apply_to_snapshot(snap, ops).acl) == {AclKey(new, N("198.18.9.0/24"))}


def test_interim_rules_never_let_a_source_both_sides_deny_through() -> None:
    """Every state a plan goes through, for sources both configurations deny."""
    before = {"allow": ["198.18.0.0/16"], "deny": ["198.18.5.0/24", "198.18.6.0/25"]}
    after = {"allow": ["198.18.0.0/16", "198.18.6.0/26"], "deny": ["198.18.6.0/24"]}
    snap = apply_to_snapshot(Snapshot(), plan(config(before), Snapshot()))
    ops = plan(config(after), snap)
    sources = [A(f"198.18.{c}.{d}") for c in (4, 5, 6, 7) for d in (1, 70, 130, 200)] + [
        A("10.0.0.1")
    ]

    def denied(s: Snapshot, src: ipaddress.IPv4Address) -> bool:
        lst = AclIndex(s.acl).verdict(G, src, bool(s.config.flags & abi.CFG_F_ACL_DENY))
        return lst in (DENY, DEFAULT)

    final = apply_to_snapshot(snap, ops)
    both = [s for s in sources if denied(snap, s) and denied(final, s)]
    assert both  # not vacuous
    for i in range(len(ops) + 1):
        mid = apply_to_snapshot(snap, ops[:i])
        assert not [s for s in both if not denied(mid, s)], ops[:i]


# --- the model -----------------------------------------------------------------------------


def test_acl_index_longest_prefix() -> None:
    idx = AclIndex(
        {
            AclKey(G, N("198.18.0.0/16")): DENY,
            AclKey(G, N("198.18.5.0/24")): ALLOW,
            AclKey(G, N("198.18.5.128/25")): DENY,
            AclKey(7, N("0.0.0.0/0")): ALLOW,
            AclKey(G, N("fd78:6470:6c62::/48")): ALLOW,
        }
    )
    assert idx.match(G, A("198.18.5.1")) is ALLOW
    assert idx.match(G, A("198.18.5.129")) is DENY
    assert idx.match(G, A("198.18.9.1")) is DENY
    assert idx.match(G, A("198.19.9.1")) is None
    assert idx.match(7, A("198.19.9.1")) is ALLOW  # scopes do not mix
    assert idx.match(G, A("fd78:6470:6c62:1::1")) is ALLOW
    assert idx.verdict(G, A("198.19.9.1"), True) is DEFAULT
    assert idx.verdict(G, A("198.19.9.1"), False) is None


def test_rate_key() -> None:
    assert rate_key(A("198.18.5.77"), 24, 64) == N("198.18.5.0/24")
    assert rate_key(A("fd78:6470:6c62:5::9"), 24, 64) == N("fd78:6470:6c62:5::/64")


VIP4 = Vip(A("198.18.100.1"), 80, abi.IPPROTO_TCP)


def state(**kw: Any) -> model.DataplaneState:
    base = model.DataplaneState(
        {VIP4: VipParams(3, table_size=1)},
        {1: BackendState(A("198.18.0.11"))},
        {3: LookupTable([1])},
        LbConfig(A("198.18.0.2"), None),  # type: ignore[arg-type]
    )
    return dataclasses.replace(base, **kw)


def syn(
    src: str = "198.18.5.1",
    dst: str = "198.18.100.1",
    proto: int = abi.IPPROTO_TCP,
    flags: int = 0x02,
) -> bytes:
    return frames.frame(model.Flow(A(src), A(dst), 40000, 80, proto), tcp_flags=flags)


def test_model_acl_steps() -> None:
    acl = {AclKey(G, N("198.18.5.0/24")): DENY, AclKey(3, N("198.18.6.0/24")): ALLOW}
    cfg = LbConfig(A("198.18.0.2"), None, flags=abi.CFG_F_ACL)  # type: ignore[arg-type]
    st = state(acl=acl, config=cfg)
    d = model.decide(st, syn())
    assert (d.outcome, d.drop, d.acl_hits, d.events) == (
        model.Outcome.DROP,
        abi.DropReason.ACL,
        ((G, DENY),),
        (),
    )
    # Not a VIP address: the global ACL does not look.
    assert model.decide(st, syn(dst="198.18.100.9")).events == (abi.Event.PASS_NOT_VIP,)
    # The VIP's allow list, once its flags say so.
    assert model.decide(st, syn("198.18.7.1")).outcome is model.Outcome.FORWARD
    vst = dataclasses.replace(st, vips={VIP4: VipParams(3, abi.VIP_F_ACL | abi.VIP_F_ACL_DENY, 1)})
    d = model.decide(vst, syn("198.18.7.1"))
    assert (d.drop, d.acl_hits) == (abi.DropReason.ACL, ((3, DEFAULT),))
    d = model.decide(vst, syn("198.18.6.1"))
    assert (d.outcome, d.acl_hits) == (model.Outcome.FORWARD, ((3, ALLOW),))


def test_model_rate_limit_and_budget() -> None:
    cfg = LbConfig(A("198.18.0.2"), None, rl_rate=10, rl_burst=5, rl_prefix4=24)  # type: ignore[arg-type]
    st = state(config=cfg, rate_limited=frozenset({N("198.18.5.0/24")}))
    assert model.decide(st, syn()).drop is abi.DropReason.RATE_LIMIT
    assert model.decide(st, syn("198.18.6.1")).outcome is model.Outcome.FORWARD
    # Not a new flow: a TCP ACK is not limited, nor a UDP flow the table knows.
    assert model.decide(st, syn(flags=0x10)).drop is None
    assert (
        model.decide(dataclasses.replace(st, config=LbConfig(A("198.18.0.2"), None)), syn()).drop
        is None
    )  # type: ignore[arg-type]
    d = model.decide(state(over_budget=True), syn())
    assert d.events == (abi.Event.CONN_MISS, abi.Event.CONN_FLOOD) and d.conn_insert is None
    nolimit = LbConfig(A("198.18.0.2"), None, flood_max=0)  # type: ignore[arg-type]
    d = model.decide(state(over_budget=True, config=nolimit), syn())
    assert d.events == (abi.Event.CONN_MISS, abi.Event.CONN_INSERT) and d.conn_insert is not None
