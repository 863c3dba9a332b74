"""The planner's part in the session table: member states per VIP, backend slot
generations, the session generation and timeouts in lb_config, and the VIP filter."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from typing import Any

import pytest
from test_planner import check_safe_order, config, vip

from xdplb.config import parse_config
from xdplb.control.overlay import Overlay, effective
from xdplb.control.planner import apply_to_snapshot, plan, vip_key
from xdplb.core import abi, hashing
from xdplb.core.mapops import PutMembers, PutTable, SetVipFilter
from xdplb.core.state import Snapshot, timeout_ticks

pytestmark = pytest.mark.unit

ip = ipaddress.ip_address
S = abi.MemberState


def converge(cfg: Any, snap: Snapshot, **kw: Any) -> tuple[list[Any], Snapshot]:
    ops = plan(cfg, snap, **kw)
    check_safe_order(snap, ops)
    after = apply_to_snapshot(snap, ops)
    assert plan(cfg, after, **kw) == [], "a second plan must be empty"
    return ops, after


def members_by_addr(snap: Snapshot, cfg: Any, name: str) -> dict[str, S]:
    v = next(v for v in cfg.vips if v.name == name)
    vip_id = snap.vips[vip_key(v)].vip_id
    addr = {i: str(b.addr) for i, b in snap.backends.items()}
    return {addr[i]: st for i, st in snap.members.get(vip_id, {}).items()}


CASES = [
    # (description, backends, overlay down, overlay drained, expected states)
    ("weights > 0 are ACTIVE", [("198.18.0.11", 1), ("198.18.0.12", 2)], [], [],
     {"198.18.0.11": S.ACTIVE, "198.18.0.12": S.ACTIVE}),
    ("weight 0 in the configuration drains", [("198.18.0.11", 1), ("198.18.0.12", 0)], [], [],
     {"198.18.0.11": S.ACTIVE, "198.18.0.12": S.DRAINING}),
    ("an operator's drain drains", [("198.18.0.11", 1), ("198.18.0.12", 1)], [],
     ["198.18.0.12"], {"198.18.0.11": S.ACTIVE, "198.18.0.12": S.DRAINING}),
    ("a failed health check is DOWN", [("198.18.0.11", 1), ("198.18.0.12", 1)],
     ["198.18.0.12"], [], {"198.18.0.11": S.ACTIVE, "198.18.0.12": S.DOWN}),
]  # fmt: skip


@pytest.mark.parametrize(
    "backends,down,drained,want",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_member_states(
    backends: list[tuple[str, int]], down: list[str], drained: list[str], want: dict[str, S]
) -> None:
    cfg = config([vip("198.18.100.1", 53, *backends, protocol="udp")])
    name = cfg.vips[0].name
    eff = effective(
        cfg,
        Overlay(
            down=frozenset((name, ip(a)) for a in down),
            drained=frozenset((name, ip(a)) for a in drained),
        ),
        {},
    )
    _, snap = converge(eff.config, Snapshot(), members=eff.members)
    assert members_by_addr(snap, cfg, name) == want


def test_a_removed_backend_leaves_the_members_after_the_table() -> None:
    both = config([vip("198.18.100.1", 53, "198.18.0.11", "198.18.0.12", protocol="udp")])
    _, snap = converge(both, Snapshot())
    one = config([vip("198.18.100.1", 53, "198.18.0.11", protocol="udp")])
    ops, after = converge(one, snap)
    table_at = next(i for i, o in enumerate(ops) if isinstance(o, PutTable))
    members_at = [i for i, o in enumerate(ops) if isinstance(o, PutMembers)]
    assert members_at and all(i > table_at for i in members_at), (
        "the backend stays live for its UDP sessions until the table no longer sends to it"
    )
    assert members_by_addr(after, one, one.vips[0].name) == {"198.18.0.11": S.ACTIVE}


def test_a_new_backend_is_a_member_before_the_table_names_it() -> None:
    one = config([vip("198.18.100.1", 53, "198.18.0.11", protocol="udp")])
    _, snap = converge(one, Snapshot())
    both = config([vip("198.18.100.1", 53, "198.18.0.11", "198.18.0.12", protocol="udp")])
    ops, _ = converge(both, snap)
    table_at = next(i for i, o in enumerate(ops) if isinstance(o, PutTable))
    first_members = next(i for i, o in enumerate(ops) if isinstance(o, PutMembers))
    assert first_members < table_at


def test_a_slot_given_to_another_address_changes_generation() -> None:
    # One slot free at a time: limits.backends 3 is slots 1 and 2.
    lim = {"limits": {"backends": 3}}
    a = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.12")], **lim)
    _, snap = converge(a, Snapshot())
    ids = {str(b.addr): i for i, b in snap.backends.items()}
    gens = {str(b.addr): b.gen for b in snap.backends.values()}
    # .12 leaves: its slot is retired (inactive, address kept) for its TCP sessions.
    b = config([vip("198.18.100.1", 80, "198.18.0.11")], **lim)
    _, snap = converge(b, snap)
    retired = snap.backends[ids["198.18.0.12"]]
    assert not retired.active and str(retired.addr) == "198.18.0.12"
    # .13 needs a slot and only the retired one is left: it gets it, one generation on.
    c = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.13")], **lim)
    _, snap = converge(c, snap)
    slot = snap.backends[ids["198.18.0.12"]]
    assert str(slot.addr) == "198.18.0.13" and slot.gen == (gens["198.18.0.12"] + 1) & 0xFF


def test_a_returning_address_takes_its_retired_slot_back() -> None:
    a = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.12")])
    _, snap = converge(a, Snapshot())
    old = {str(b.addr): (i, b.gen) for i, b in snap.backends.items()}
    _, snap = converge(config([vip("198.18.100.1", 80, "198.18.0.11")]), snap)
    # Another address comes first: it must not take the retired slot while others are free.
    _, snap = converge(config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.14")]), snap)
    assert old["198.18.0.12"][0] not in {
        i for i, b in snap.backends.items() if str(b.addr) == "198.18.0.14"
    }
    _, snap = converge(a, snap)
    back = {str(b.addr): (i, b.gen) for i, b in snap.backends.items() if b.active}
    assert back["198.18.0.12"] == old["198.18.0.12"], "same slot, same gen: its sessions live"


def test_session_generation_survives_plans() -> None:
    cfg = config([vip("198.18.100.1", 80, "198.18.0.11")])
    _, snap = converge(cfg, Snapshot())
    snap.config = replace(snap.config, conn_gen=7)  # as after seven flushes
    cfg2 = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.12")], hash_seed=3)
    _, after = converge(cfg2, snap)
    assert after.config.conn_gen == 7 and after.config.seed == 3


@pytest.mark.parametrize("hz", [100, 250, 1000])
def test_timeouts_are_ticks_of_the_kernels_hz(hz: int) -> None:
    cfg = parse_config(
        {
            "tunnel": {"source_v4": "198.18.0.2"},
            "sessions": {"tcp_timeout": 30, "tcp_syn_timeout": 2, "tcp_fin_timeout": 5,
                         "udp_timeout": 0.5},
            "vips": [],
        }
    )  # fmt: skip
    _, snap = converge(cfg, Snapshot(), hz=hz)
    t = snap.config.conn_timeouts
    assert t[abi.SessState.TCP_EST] == 30 * hz
    assert t[abi.SessState.TCP_SYN] == 2 * hz
    assert t[abi.SessState.TCP_FIN] == 5 * hz
    assert t[abi.SessState.UDP] == timeout_ticks(0.5, hz) == hz // 2
    assert snap.config.hz == hz


def test_the_vip_filter_follows_the_vip_addresses() -> None:
    a = config([vip("198.18.100.1", 80, "198.18.0.11"), vip("198.18.100.2", 80, "198.18.0.11")])
    ops, snap = converge(a, Snapshot())
    bits = {hashing.addr_filter_bit(ip(x).packed) for x in ("198.18.100.1", "198.18.100.2")}
    assert snap.vip_filter == bits
    assert isinstance(ops[1], SetVipFilter), "bits are set before any VIP exists"
    b = config([vip("198.18.100.2", 80, "198.18.0.11")])
    ops, snap = converge(b, snap)
    assert snap.vip_filter == {hashing.addr_filter_bit(ip("198.18.100.2").packed)}
    assert isinstance(ops[-1], SetVipFilter), "a bit is cleared after its VIP is gone"
