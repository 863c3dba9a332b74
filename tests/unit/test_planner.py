"""The planner, without a kernel: plans reach the desired state, touch nothing else,
keep identities stable, and order operations so every intermediate state is safe."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from xdplb.config import Config, parse_config
from xdplb.control.planner import (
    LIVE_MEMBERS,
    BeamerMemory,
    apply_to_snapshot,
    beamer_pending,
    plan,
    vip_key,
)
from xdplb.core import abi, hashing
from xdplb.core.errors import ConfigError
from xdplb.core.mapops import (
    DeleteBackend,
    DeleteMembers,
    DeleteTable,
    DeleteVip,
    DeleteVipAddr,
    Op,
    PutBackend,
    PutMembers,
    PutTable,
    PutVip,
    PutVipAddr,
    SetConfig,
    SetVipFilter,
)
from xdplb.core.state import Snapshot, Vip, VipAddrInfo, fragment_vip

pytestmark = pytest.mark.unit

ip = ipaddress.ip_address


def config(vips: list[dict[str, Any]], **kw: Any) -> Config:
    doc: dict[str, Any] = {
        "tunnel": {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"},
        "table_size": 1009,
        "vips": vips,
    }
    doc.update(kw)
    return parse_config(doc)


def vip(addr: str, port: int, *backends: str | tuple[str, int], **kw: Any) -> dict[str, Any]:
    bes = [
        {"address": b} if isinstance(b, str) else {"address": b[0], "weight": b[1]}
        for b in backends
    ]
    return {"address": addr, "port": port, "backends": bes, **kw}


def converge(cfg: Config, snap: Snapshot) -> tuple[list[Op], Snapshot]:
    ops = plan(cfg, snap)
    after = apply_to_snapshot(snap, ops)
    assert plan(cfg, after) == [], "a second plan must be empty"
    return ops, after


def check_safe_order(snap: Snapshot, ops: list[Op]) -> None:
    """Replay ops one by one: every VIP's table exists and names only active backends,
    each of them live in the VIP's member states (its UDP sessions are never judged
    stale while the table still sends to it), and every VIP address keeps its
    lb_vip_filter bit."""
    cur = snap
    for op in ops:
        cur = apply_to_snapshot(cur, [op])
        for key, st in cur.vips.items():
            assert hashing.addr_filter_bit(key.addr.packed) in cur.vip_filter, (
                f"{key}: filter bit clear after {op}"
            )
            table = cur.tables.get(st.vip_id)
            if table is None:
                continue
            assert len(table) == st.table_size, f"{key}: size mismatch after {op}"
            members = cur.members.get(st.vip_id, {})
            for bid in table.counts():
                assert cur.backends[int(bid)].active, f"{key} names inactive {bid} after {op}"
                assert members.get(int(bid)) in LIVE_MEMBERS, (
                    f"{key}: {bid} in the table but {members.get(int(bid))} after {op}"
                )


def test_first_plan_builds_everything() -> None:
    cfg = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.12")])
    ops, snap = converge(cfg, Snapshot())
    kinds = [type(o) for o in ops]
    assert kinds == [
        SetConfig,
        SetVipFilter,
        PutBackend,
        PutBackend,
        PutMembers,
        PutTable,
        PutVip,
        PutVipAddr,
    ]
    put = next(o for o in ops if isinstance(o, PutTable))
    assert put.kind is abi.TableKind.MAGLEV, "a Maglev table goes to lb_tables"
    assert {b.addr for b in snap.backends.values()} == {ip("198.18.0.11"), ip("198.18.0.12")}
    assert 0 not in snap.backends, "backend id 0 means 'none' and is never allocated"
    st = snap.vips[Vip(ip("198.18.100.1"), 80, abi.IPPROTO_TCP)]
    assert st.table_size == 1009 and st.encap is abi.Encap.GUE and st.flags == 0
    table = snap.tables[st.vip_id]
    assert len(table) == 1009
    assert set(table.counts()) == set(snap.backends)
    assert table.rest is None, "Maglev tables have no later hops"
    assert snap.vip_addrs == {ip("198.18.100.1"): VipAddrInfo(1, frag_tcp=80)}


def test_identities_survive_replanning_and_restarts() -> None:
    cfg1 = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.12", "198.18.0.13")])
    _, snap1 = converge(cfg1, Snapshot())
    ids1 = {b.addr: i for i, b in snap1.backends.items()}
    # Remove one backend, add another: the survivors keep their ids and the VIP its id.
    cfg2 = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.13", "198.18.0.14")])
    ops, snap2 = converge(cfg2, snap1)
    check_safe_order(snap1, ops)
    active2 = {b.addr: i for i, b in snap2.backends.items() if b.active}
    assert active2[ip("198.18.0.11")] == ids1[ip("198.18.0.11")]
    assert active2[ip("198.18.0.13")] == ids1[ip("198.18.0.13")]
    assert not snap2.backends[ids1[ip("198.18.0.12")]].active
    assert DeleteBackend(ids1[ip("198.18.0.12")]) in ops
    assert [type(o) for o in ops].index(DeleteBackend) > [type(o) for o in ops].index(PutTable)
    key = Vip(ip("198.18.100.1"), 80, abi.IPPROTO_TCP)
    assert snap2.vips[key].vip_id == snap1.vips[key].vip_id


def test_unchanged_config_plans_nothing_and_weight_change_only_rewrites_table() -> None:
    cfg = config([vip("198.18.100.1", 80, "198.18.0.11", "198.18.0.12")])
    _, snap = converge(cfg, Snapshot())
    assert plan(cfg, snap) == []
    cfg2 = config([vip("198.18.100.1", 80, ("198.18.0.11", 3), "198.18.0.12")])
    ops, snap2 = converge(cfg2, snap)
    assert [type(o) for o in ops] == [PutTable]
    counts = snap2.tables[0].counts()
    assert counts[1] == pytest.approx(3 * counts[2], rel=0.02)


def test_table_size_change_moves_vip_to_a_fresh_id() -> None:
    cfg = config([vip("198.18.100.1", 80, "198.18.0.11")])
    _, snap = converge(cfg, Snapshot())
    cfg2 = config([vip("198.18.100.1", 80, "198.18.0.11", table_size=101)])
    ops, snap2 = converge(cfg2, snap)
    check_safe_order(snap, ops)
    key = Vip(ip("198.18.100.1"), 80, abi.IPPROTO_TCP)
    assert snap2.vips[key].vip_id != snap.vips[key].vip_id
    assert snap2.vips[key].table_size == 101
    assert DeleteTable(snap.vips[key].vip_id) in ops
    assert list(snap2.tables) == [snap2.vips[key].vip_id]


def test_removing_everything_deletes_in_safe_order() -> None:
    cfg = config(
        [
            vip("198.18.100.1", 80, "198.18.0.11"),
            vip("198.18.100.1", 53, "198.18.0.12", protocol="udp"),
        ]
    )
    _, snap = converge(cfg, Snapshot())
    assert snap.vip_addrs == {ip("198.18.100.1"): VipAddrInfo(2, frag_tcp=80, frag_udp=53)}
    ops, empty = converge(config([]), snap)
    check_safe_order(snap, ops)
    kinds = [type(o) for o in ops]
    assert kinds == [
        DeleteVip,
        DeleteVip,
        DeleteVipAddr,
        DeleteTable,
        DeleteTable,
        DeleteMembers,
        DeleteMembers,
        DeleteBackend,
        DeleteBackend,
        SetVipFilter,
    ]
    assert empty.vips == {} and empty.tables == {} and empty.vip_addrs == {}
    assert not any(b.active for b in empty.backends.values())


def test_zero_weights_leave_vip_without_table() -> None:
    cfg = config([vip("198.18.100.1", 80, ("198.18.0.11", 0))])
    _, snap = converge(cfg, Snapshot())
    assert snap.tables == {}
    assert len(snap.vips) == 1


def test_flags_encap_and_shared_backends() -> None:
    cfg = config(
        [
            vip(
                "198.18.100.1", 0, "198.18.0.11", "fd78:6470:6c62::11", hash="source", encap="ipip"
            ),
            vip("fd78:6470:6c62:100::1", 443, "198.18.0.11"),
        ]
    )
    _, snap = converge(cfg, Snapshot())
    st = snap.vips[vip_key(cfg.vips[0])]
    assert st.flags == abi.VIP_F_SRC_HASH and st.encap is abi.Encap.IPIP
    # One backend shared by two VIPs has one id.
    assert sum(1 for b in snap.backends.values() if b.addr == ip("198.18.0.11")) == 1
    assert snap.config.src6 == ip("fd78:6470:6c62::2")


def test_new_vip_never_reuses_an_id_still_live() -> None:
    cfg = config([vip("198.18.100.1", 80, "198.18.0.11"), vip("198.18.100.2", 80, "198.18.0.11")])
    _, snap = converge(cfg, Snapshot())
    # Replace VIP .1 by .3 in one step: .3 must not take .1's id while .1 still exists.
    cfg2 = config([vip("198.18.100.3", 80, "198.18.0.11"), vip("198.18.100.2", 80, "198.18.0.11")])
    ops, snap2 = converge(cfg2, snap)
    check_safe_order(snap, ops)
    old_id = snap.vips[Vip(ip("198.18.100.1"), 80, abi.IPPROTO_TCP)].vip_id
    assert snap2.vips[Vip(ip("198.18.100.3"), 80, abi.IPPROTO_TCP)].vip_id != old_id


def beamer_vip(*backends: str | tuple[str, int], **policy: float) -> dict[str, Any]:
    return vip("198.18.100.1", 80, *backends, table="beamer", table_size=4096, beamer=policy)


def test_beamer_tables_keep_the_old_first_hop_as_previous_hop() -> None:
    cfg = config([beamer_vip("198.18.0.11", "198.18.0.12", min_interval=10, max_step=1.0)])
    ops, snap = converge(cfg, Snapshot())
    key = vip_key(cfg.vips[0])
    assert snap.vips[key].table_kind is abi.TableKind.BEAMER
    table = snap.tables[snap.vips[key].vip_id]
    assert table.rest is None and len(table) == 4096
    put = next(o for o in ops if isinstance(o, PutTable))
    assert put.beamer_table is not None
    assert put.kind is abi.TableKind.BEAMER, "a Beamer table goes to lb_btables"
    memory = {put.vip_id: BeamerMemory(put.beamer_table, changed_at=100.0)}

    # Add a backend: its buckets come from the others, which become their previous hops.
    cfg2 = config(
        [beamer_vip("198.18.0.11", "198.18.0.12", "198.18.0.13", min_interval=10, max_step=1.0)]
    )
    early = plan(cfg2, snap, now=105.0, memory=memory)
    assert not [o for o in early if isinstance(o, PutTable)], "inside the minimum interval"
    ops2 = plan(cfg2, snap, now=110.0, memory=memory)
    new_be = [o for o in ops2 if isinstance(o, PutBackend)]
    assert len(new_be) == 1
    snap2 = apply_to_snapshot(snap, ops2)
    t2 = snap2.tables[snap.vips[key].vip_id]
    moved = t2.first != table.first
    assert t2.rest is not None and t2.rest.shape == (4096, abi.MAX_HOPS - 1)
    assert (t2.first[moved] == new_be[0].backend_id).all()
    assert (t2.rest[moved, 0] == table.first[moved]).all(), "old owner is the previous hop"
    assert not t2.rest[moved, 1:].any()
    assert not t2.rest[~moved].any()
    assert abs(moved.sum() - 4096 / 3) <= 1


def test_a_removed_backend_stays_while_it_is_a_previous_hop() -> None:
    three = ("198.18.0.11", "198.18.0.12", "198.18.0.13")
    cfg = config([beamer_vip(*three, min_interval=0, max_step=1.0)])
    _, snap = converge(cfg, Snapshot())
    gone = next(i for i, b in snap.backends.items() if b.addr == ip("198.18.0.13"))
    cfg2 = config([beamer_vip(*three[:2], min_interval=0, max_step=1.0)])
    ops, snap2 = converge(cfg2, snap)
    assert DeleteBackend(gone) not in ops
    assert snap2.backends[gone].active, "it still serves the connections it had"
    table = next(iter(snap2.tables.values()))
    assert gone not in table.counts() and table.rest is not None and gone in table.rest
    # Once no table names it (the VIP goes Maglev), it leaves.
    ops3, snap3 = converge(config([vip("198.18.100.1", 80, *three[:2])]), snap2)
    assert DeleteBackend(gone) in ops3 and not snap3.backends[gone].active


def test_beamer_pending_until_the_table_reaches_its_weights() -> None:
    two = ("198.18.0.11", "198.18.0.12")
    cfg = config([beamer_vip(*two, min_interval=0, max_step=0.1)])
    _, snap = converge(cfg, Snapshot())
    assert not beamer_pending(cfg, snap)
    cfg2 = config([beamer_vip(("198.18.0.11", 3), "198.18.0.12", min_interval=0, max_step=0.1)])
    steps = 0
    while beamer_pending(cfg2, snap) or steps == 0:
        snap = apply_to_snapshot(snap, plan(cfg2, snap, now=float(steps)))
        steps += 1
        assert steps < 20
    # From 1/2 to 3/4 of 4,096 buckets is 1,024 moves, 409 per step.
    assert steps == 3
    assert not beamer_pending(config([vip("198.18.100.1", 80, *two)]), snap)


def test_a_weightless_first_hop_leaves_its_beamer_buckets_at_once() -> None:
    """Down, drained or removed: its buckets move in the next plan, whatever the policy
    (min_interval, max_step), and it stays their previous hop."""
    three = ("198.18.0.11", "198.18.0.12", "198.18.0.13")
    slow = {"min_interval": 3600.0, "max_step": 0.01}
    cfg = config([beamer_vip(*three, **slow)])
    ops, snap = converge(cfg, Snapshot())
    put = next(o for o in ops if isinstance(o, PutTable))
    assert put.beamer_table is not None
    memory = {put.vip_id: BeamerMemory(put.beamer_table, changed_at=100.0)}
    out = next(i for i, b in snap.backends.items() if b.addr == ip("198.18.0.13"))
    cfg2 = config([beamer_vip("198.18.0.11", "198.18.0.12", ("198.18.0.13", 0), **slow)])
    ops2 = plan(cfg2, snap, now=101.0, memory=memory)  # well inside the minimum interval
    table = apply_to_snapshot(snap, ops2).tables[put.vip_id]
    assert out not in table.counts()
    assert table.rest is not None and (table.rest[put.beamer_table.first == out, 0] == out).all()
    # A weight change of live backends still waits for its interval.
    cfg3 = config([beamer_vip(("198.18.0.11", 3), "198.18.0.12", "198.18.0.13", **slow)])
    assert not [o for o in plan(cfg3, snap, now=101.0, memory=memory) if isinstance(o, PutTable)]


# --- lb_vip_addrs: which VIP gets an address's fragments, echo -------------------------


def addr_info(vips: list[dict[str, Any]], **kw: Any) -> VipAddrInfo:
    _, snap = converge(config(vips, **kw), Snapshot())
    (info,) = snap.vip_addrs.values()
    return info


def test_fragments_go_to_the_port_0_vip_of_their_protocol() -> None:
    info = addr_info(
        [
            vip("198.18.100.1", 80, "198.18.0.11"),
            vip("198.18.100.1", 0, "198.18.0.11"),
            vip("198.18.100.1", 443, "198.18.0.11"),
            vip("198.18.100.1", 53, "198.18.0.12", protocol="udp"),
        ]
    )
    assert info == VipAddrInfo(4, frag_tcp=0, frag_udp=53)


def test_several_vips_without_a_wildcard_leave_fragments_to_none() -> None:
    info = addr_info(
        [vip("198.18.100.1", 80, "198.18.0.11"), vip("198.18.100.1", 443, "198.18.0.11")]
    )
    assert info == VipAddrInfo(2, frag_tcp=None, frag_udp=None)
    assert info.abi_value().flags == 0


def test_the_fragments_option_chooses_among_several() -> None:
    info = addr_info(
        [
            vip("198.18.100.1", 80, "198.18.0.11"),
            vip("198.18.100.1", 0, "198.18.0.11"),
            vip("198.18.100.1", 443, "198.18.0.11", fragments=True),
        ]
    )
    assert info.frag_tcp == 443
    raw = info.abi_value()
    assert raw.flags == abi.VIP_ADDR_F_FRAG_TCP and raw.frag_port[0] == 443 >> 8 | (443 & 255) << 8
    assert VipAddrInfo.from_abi(raw) == info


def test_two_vips_asking_for_the_same_fragments_is_refused() -> None:
    with pytest.raises(ConfigError, match="both ask for the fragments"):
        config(
            [
                vip("198.18.100.1", 80, "198.18.0.11", fragments=True),
                vip("198.18.100.1", 443, "198.18.0.11", fragments=True),
            ]
        )


def test_icmp_echo_on_one_vip_applies_to_its_address() -> None:
    info = addr_info(
        [
            vip("198.18.100.1", 80, "198.18.0.11"),
            vip("198.18.100.1", 53, "198.18.0.11", protocol="udp", icmp_echo=True),
        ]
    )
    assert info.echo and info.abi_value().flags & abi.VIP_ADDR_F_ECHO


def test_changing_the_fragment_vip_rewrites_the_address() -> None:
    cfg = config([vip("198.18.100.1", 80, "198.18.0.11")])
    _, snap = converge(cfg, Snapshot())
    cfg2 = config([vip("198.18.100.1", 80, "198.18.0.11"), vip("198.18.100.1", 0, "198.18.0.11")])
    ops = plan(cfg2, snap)
    puts = [op for op in ops if isinstance(op, PutVipAddr)]
    assert puts == [PutVipAddr(ip("198.18.100.1"), VipAddrInfo(2, frag_tcp=0))]
    # The address names the new wildcard only after it is in lb_vips.
    assert ops.index(puts[0]) > max(i for i, op in enumerate(ops) if isinstance(op, PutVip))


def test_fragment_vip_rule() -> None:
    a = ip("198.18.100.1")
    v80, v0, v443 = Vip(a, 80, 6), Vip(a, 0, 6), Vip(a, 443, 6)
    assert fragment_vip([v80]) == v80
    assert fragment_vip([v80, v0, v443]) == v0
    assert fragment_vip([v80, v443]) is None
    assert fragment_vip([v80, v443], chosen=[v443]) == v443
    assert fragment_vip([]) is None


def test_icmp_too_big_sets_the_ptb_flag() -> None:
    cfg = config(
        [vip("198.18.100.1", 80, "198.18.0.11")],
        tunnel={"source_v4": "198.18.0.2", "icmp_too_big": True},
    )
    _, snap = converge(cfg, Snapshot())
    assert snap.config.flags & abi.CFG_F_PTB
