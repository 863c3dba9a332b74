"""The planner: desired configuration + what the maps hold -> map operations.

Sans-I/O: it reads no map and makes no syscall. The datapath layer takes a
:class:`Snapshot` of the maps, :func:`plan` returns the operations, and the datapath
applies them in the order given. Applying the plan to the snapshot yields the desired
state (``apply_to_snapshot`` does exactly that, and the unit tests use it).

Identities are kept stable so that a restarted daemon (or a reload) moves nothing it
does not have to: a VIP keeps its id, a backend (by address) keeps its id, and a table
is rewritten only when its contents change. Backend id 0 is never allocated: 0 means
"no backend" in a bucket.

Ordering makes every intermediate state safe for the data path: backends exist before a
table names them, a table exists before its VIP points at it, and removals go the other
way round. A VIP whose table size or kind changes moves to a fresh id, so its new size
and new table appear in one ``lb_vips`` update instead of two racing ones.

Beamer tables have a history: each plan moves a table one policy step (after its
minimum interval) from the table the maps hold, and a backend stays in ``lb_backends``
while any table names it, as a later hop serving the connections it still has. A
backend whose weight drops to 0 (removed, down, drained) is the exception: its buckets
move in the next plan, all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from xdplb.config import AclConfig, Config, HashFields, TableKindName, VipConfig
from xdplb.core import abi
from xdplb.core.acl import AclKey, ScopeRules, sorted_keys
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import ConfigError
from xdplb.core.mapops import (
    DeleteAcl,
    DeleteBackend,
    DeleteMembers,
    DeleteTable,
    DeleteVip,
    DeleteVipAddr,
    Op,
    PutAcl,
    PutBackend,
    PutMembers,
    PutTable,
    PutVip,
    PutVipAddr,
    SetConfig,
    SetVipFilter,
)
from xdplb.core.state import (
    DEFAULT_HZ,
    BackendState,
    LbConfig,
    LookupTable,
    Snapshot,
    Vip,
    VipAddrInfo,
    VipParams,
    filter_bits,
    vip_addr_infos,
)
from xdplb.tables import beamer, maglev


@dataclass(frozen=True)
class PutBeamerTable(PutTable):
    """A :class:`PutTable` of a Beamer table that also carries the table it was built
    from, for the caller's :class:`BeamerMemory`; the datapath sees a plain PutTable."""

    beamer_table: beamer.BeamerTable = field(compare=False)


def vip_key(vip: VipConfig) -> Vip:
    return Vip(vip.address, vip.port, vip.protocol.number)


def build_table(
    weights: dict[IPAddress, int], ids: dict[IPAddress, int], size: int
) -> LookupTable | None:
    """The Maglev table of one VIP as backend ids; None when no backend has a weight."""
    live = {str(a): w for a, w in weights.items() if w > 0}
    if not live:
        return None
    table = maglev.build(live, size)
    return LookupTable(table.map_ids({str(a): ids[a] for a in weights}))


def _lowest_free(used: Iterable[int], start: int, stop: int) -> Iterable[int]:
    taken = set(used)
    return (i for i in range(start, stop) if i not in taken)


def scope_rules(acl: AclConfig) -> ScopeRules:
    return ScopeRules(frozenset(acl.allow), frozenset(acl.deny))


def acl_flags(acl: AclConfig, has_rules: int, default_deny: int) -> int:
    """The flags that make the data path look a scope up (and deny what no rule matches)."""
    rules = scope_rules(acl)
    return (has_rules if rules.has_rules else 0) | (default_deny if rules.default_deny else 0)


def desired_config(cfg: Config, hz: int = DEFAULT_HZ) -> LbConfig:
    """``lb_config`` for ``cfg``; ``hz``: the kernel's HZ (session timeouts are jiffies)."""
    rl = cfg.flood.rate_limit
    flags = acl_flags(cfg.acl, abi.CFG_F_ACL, abi.CFG_F_ACL_DENY)
    if cfg.tunnel.icmp_too_big:
        flags |= abi.CFG_F_PTB
    if cfg.sync is not None and any(v.sync for v in cfg.vips):
        flags |= abi.CFG_F_EXPORT  # session sync reads lb_sess_export
    return LbConfig(
        cfg.tunnel.source_v4,
        cfg.tunnel.source_v6,
        cfg.tunnel.gue_port,
        cfg.hash_seed,
        conn_mask=cfg.limits.conn_mask,
        flood_max=cfg.flood.flood_max,
        flags=flags,
        rl_rate=rl.new_flows_per_second if rl is not None else 0,
        rl_burst=rl.bucket if rl is not None else 0,
        rl_prefix4=rl.prefix_v4 if rl is not None else 32,
        rl_prefix6=rl.prefix_v6 if rl is not None else 64,
        conn_timeouts=cfg.sessions.ticks(hz),
        vip_index_mask=cfg.limits.vip_index_mask,
        hz=hz,
    )


def desired_vip_addrs(cfg: Config) -> dict[IPAddress, VipAddrInfo]:
    """``lb_vip_addrs``: per VIP address its VIP count, the VIP its fragments go to per
    protocol (``fragments: true``, else the port-0 VIP, else the only one) and echo."""
    return vip_addr_infos(
        [vip_key(v) for v in cfg.vips],
        chosen=[vip_key(v) for v in cfg.vips if v.fragments],
        echo=[v.address for v in cfg.vips if v.icmp_echo],
    )


def check_capacity(cfg: Config, current: Snapshot) -> None:
    """ConfigError naming the ``limits`` field unless the plan from ``current`` to ``cfg``
    fits the maps at every step: called before anything is written.

    The configuration's own counts are checked when it is validated; this adds what a
    change needs on the way: new backend ids while the old ones are still active (and
    Beamer later hops, which stay until no table names them), fresh VIP ids for new
    VIPs and for VIPs whose table changes size or kind (the old id is freed at the end
    of the plan), and ``lb_vip_addrs`` entries for new addresses before old ones go.
    """
    lim = cfg.limits
    active = {b.addr for b in current.backends.values() if b.active}
    need = len(active | cfg.backend_addresses())
    if need > lim.backends - 1:
        raise ConfigError(
            "limits.backends",
            f"this change needs {need} backend slots at once ({len(active)} active now, "
            f"Beamer later hops included), at most {lim.backends - 1} fit",
        )
    used_ids = {s.vip_id for s in current.vips.values()} | set(current.tables)
    fresh = 0
    for vip in cfg.vips:
        old = current.vips.get(vip_key(vip))
        if (
            old is None
            or old.table_size != cfg.vip_table_size(vip)
            or old.table_kind != vip.table.abi
        ):
            fresh += 1
    if len(used_ids) + fresh > lim.vips:
        raise ConfigError(
            "limits.vips",
            f"this change needs {len(used_ids) + fresh} VIP ids at once ({len(used_ids)} in "
            f"use, {fresh} fresh for new VIPs and changed tables), the limit is {lim.vips}",
        )
    addrs = current.vip_addrs.keys() | {v.address for v in cfg.vips}
    if len(addrs) > lim.vips:
        raise ConfigError(
            "limits.vips",
            f"this change needs {len(addrs)} VIP addresses at once (old ones go last), "
            f"the limit is {lim.vips}",
        )


@dataclass(frozen=True)
class BeamerMemory:
    """What the control plane remembers of a Beamer table between plans: the maps hold
    its hops, not when each bucket last changed nor when the table did."""

    table: beamer.BeamerTable
    changed_at: float
    #: Taken from the fleet's store, not yet in the maps: the table to serve (and step
    #: on from), whatever the maps hold.
    adopted: bool = False


def _beamer_table(
    vip: VipConfig,
    weights: dict[int, int],
    size: int,
    current: LookupTable | None,
    memory: BeamerMemory | None,
    now: float,
    keep: Collection[int] = (),
    follow: bool = False,
) -> beamer.BeamerTable | None:
    """The VIP's next Beamer table, or None to keep ``current`` as it is. ``keep``: backend
    ids that may hold connections of the VIP (never pushed off a hop list). ``follow``:
    another node steps the table (the fleet's store): ``memory``'s table, adopted from
    it, is served as it is."""
    if memory is not None and memory.table.size == size:
        if memory.adopted or memory.table.to_lookup_table() == current:
            table, last = memory.table, memory.changed_at
            # Following, it is served as it is, unless it still sends new flows to a
            # backend without weight here (removed, down, drained): that one moves now,
            # without waiting for the node that steps.
            if follow and all(weights.get(i, 0) for i in table.counts()):
                return table
        elif current is None or len(current) != size:
            return beamer.build(weights, size)
        else:  # a restarted daemon: the hops are in the map, the buckets' ages are not
            table, last = beamer.from_lookup_table(current), None
    elif current is None or len(current) != size:
        return beamer.build(weights, size)
    else:
        table, last = beamer.from_lookup_table(current), None
    policy = beamer.Policy(min_interval=vip.beamer.min_interval, max_step=vip.beamer.max_step)
    if any(weights.get(i, 0) == 0 for i in table.counts()):
        # A first hop without weight (removed, down or drained) must take no new
        # connection from now on: its buckets move at once, whatever the pace of
        # weight changes. It stays their previous hop for the connections it has.
        policy = beamer.Policy(min_interval=0.0, max_step=1.0)
    stepped = beamer.Scheduler(policy).step(table, weights, now, last, keep)
    if stepped is None and memory is not None and memory.adopted:
        return table  # no step due: the adopted table as it is
    return stepped


#: Member states whose UDP sessions are live (lb_select.h's lb_conn_lookup).
LIVE_MEMBERS = (abi.MemberState.ACTIVE, abi.MemberState.DRAINING)

#: VIP name -> backend address -> its state in the VIP; absent: by weight.
MemberOverrides = Mapping[str, Mapping[IPAddress, abi.MemberState]]


def member_states(
    vip: VipConfig, ids: Mapping[IPAddress, int], overrides: MemberOverrides
) -> dict[int, abi.MemberState]:
    """A VIP's ``lb_members``: each backend ACTIVE with a weight, else DRAINING (drained,
    or weight 0 in the configuration), unless ``overrides`` says otherwise (DOWN: its
    health check fails)."""
    given = overrides.get(vip.name, {})
    out = {}
    for b in vip.backends:
        default = abi.MemberState.ACTIVE if b.weight > 0 else abi.MemberState.DRAINING
        out[ids[b.address]] = given.get(b.address, default)
    return out


def _members_on_the_way(
    old: Mapping[int, abi.MemberState], new: Mapping[int, abi.MemberState]
) -> dict[int, abi.MemberState]:
    """The states a VIP holds while its table changes: every backend live in the old or
    the new states stays live until the table no longer sends to it."""
    out = dict(new)
    for bid, st in old.items():
        if st in LIVE_MEMBERS and out.get(bid) not in LIVE_MEMBERS:
            out[bid] = st
    return {b: st for b, st in out.items() if st is not abi.MemberState.NONE}


def plan(
    cfg: Config,
    current: Snapshot,
    *,
    now: float = 0.0,
    memory: Mapping[int, BeamerMemory] | None = None,
    members: MemberOverrides | None = None,
    hz: int = DEFAULT_HZ,
    holding: Mapping[str, Collection[IPAddress]] | None = None,
    follow: bool = False,
) -> list[Op]:
    """The operations that turn ``current`` into the state ``cfg`` describes.

    ``now`` and ``memory`` matter to Beamer tables only: a Beamer table moves one policy
    step per plan, no sooner than its minimum interval after the last change recorded in
    ``memory`` (vip id -> what the previous plans built). Without a memory entry every
    bucket counts as equally old and the interval as elapsed. ``members``: backends
    whose state in a VIP is not what their weight says (DOWN, from health checks).
    ``hz``: the kernel's HZ (``xdplb.datapath.clock.hz``), the session clock's rate.
    ``holding``: VIP name -> the backend addresses that may still hold connections of
    that VIP; a Beamer step never pushes one of them off a bucket's hop list
    (:func:`beamer.adjust`'s ``keep``). ``follow``: Beamer tables are served as
    ``memory`` holds them (adopted from the node that steps them), not stepped here.
    """
    memory = memory or {}
    holding = holding or {}
    members = members or {}
    check_capacity(cfg, current)
    ops_put: list[Op] = []
    ops_del: list[Op] = []

    # The session generation is the maps' own: only a flush moves it; the probe key
    # too: only the self-check sets it (Runtime.probe_key).
    config = replace(
        desired_config(cfg, hz),
        conn_gen=current.config.conn_gen,
        probe_key=current.config.probe_key,
    )
    if config != current.config:
        ops_put.append(SetConfig(config))

    # The filter first holds the old addresses and the new (a VIP never misses its bit).
    new_bits = filter_bits({v.address for v in cfg.vips})
    if current.vip_filter | new_bits != current.vip_filter:
        ops_put.append(SetVipFilter(current.vip_filter | new_bits))

    # Backends: active ones keep their ids; an address back after a removal takes its
    # old slot if free (its TCP sessions still name it); others the lowest free id >= 1.
    wanted = cfg.backend_addresses()
    by_addr = {b.addr: i for i, b in current.backends.items() if b.active}
    ids: dict[IPAddress, int] = {a: i for a, i in by_addr.items() if a in wanted}
    retired = {b.addr: i for i, b in current.backends.items() if not b.active}
    for addr in wanted - ids.keys():
        if addr in retired:
            ids[addr] = retired[addr]
    # Never hand out an id that is active now, even one this plan frees: tables and
    # sessions still name it until the plan's deletions run. Slots never used go
    # before retired ones, whose TCP sessions still reach their old address.
    taken = [*by_addr.values(), *ids.values()]
    never_used = _lowest_free([*taken, *retired.values()], 1, cfg.limits.backends)
    free = itertools.chain(never_used, sorted(set(retired.values()) - set(taken)))
    for addr in sorted(wanted - ids.keys(), key=lambda a: (a.version, a)):
        ids[addr] = next(free)
    for addr, bid in sorted(ids.items(), key=lambda kv: kv[1]):
        old_slot = current.backends.get(bid)
        gen = 0
        if old_slot is not None:
            # Another address's slot: sessions recorded for that one must not follow.
            gen = old_slot.gen if old_slot.addr == addr else (old_slot.gen + 1) & 0xFF
        backend = BackendState(addr, True, gen)
        if old_slot != backend:
            ops_put.append(PutBackend(bid, backend))

    # VIPs and their tables.
    desired_keys = {vip_key(v) for v in cfg.vips}
    # A fresh id is one no current VIP or table uses, so nothing live is overwritten
    # before the deletions at the end of the plan.
    used_ids = {s.vip_id for s in current.vips.values()} | set(current.tables)
    fresh_ids = iter(_lowest_free(used_ids, 0, cfg.limits.vips))
    vip_puts: list[Op] = []
    members_after: list[Op] = []
    live_tables: dict[int, LookupTable] = {}
    live_members: set[int] = set()
    acl_entries = scope_rules(cfg.acl).entries(abi.ACL_GLOBAL)
    for vip in cfg.vips:
        key = vip_key(vip)
        size = cfg.vip_table_size(vip)
        kind = vip.table.abi
        old = current.vips.get(key)
        same = old is not None and old.table_size == size and old.table_kind == kind
        vip_id = old.vip_id if old is not None and same else next(fresh_ids)
        acl_entries.update(scope_rules(vip.acl).entries(vip_id))
        params = VipParams(
            vip_id=vip_id,
            flags=(abi.VIP_F_SRC_HASH if vip.hash is HashFields.SOURCE else 0)
            | acl_flags(vip.acl, abi.VIP_F_ACL, abi.VIP_F_ACL_DENY),
            table_size=size,
            encap=vip.encap.abi,
            table_kind=kind,
        )
        weights = {b.address: b.weight for b in vip.backends}
        cur = current.tables.get(vip_id)
        table: LookupTable | None
        if kind is abi.TableKind.BEAMER:
            by_id = {ids[a]: w for a, w in weights.items()}
            bt = None
            if any(by_id.values()):
                held = holding.get(vip.name, ())
                keep = [i for i, b in current.backends.items() if b.addr in held]
                bt = _beamer_table(vip, by_id, size, cur, memory.get(vip_id), now, keep, follow)
                table = bt.to_lookup_table() if bt is not None else cur
            else:
                table = None
            if bt is not None and table != cur:
                ops_put.append(PutBeamerTable(vip_id, bt.to_lookup_table(), kind, bt))
        else:
            table = build_table(weights, ids, size)
            if table is not None and cur != table:
                ops_put.append(PutTable(vip_id, table, kind))
        if table is not None:
            live_tables[vip_id] = table
        # Members: what becomes live before the table sends to it, what stops after.
        want = member_states(vip, ids, members)
        have = current.members.get(vip_id, {})
        on_the_way = _members_on_the_way(have, want)
        if on_the_way != have:
            ops_put.insert(_before_tables(ops_put), PutMembers(vip_id, on_the_way))
        if want != on_the_way:
            members_after.append(PutMembers(vip_id, want))
        live_members.add(vip_id)
        if old != params:
            vip_puts.append(PutVip(key, params))
    ops_put.extend(vip_puts)
    ops_put.extend(members_after)

    # A backend leaves only when no table names it: a Beamer later hop is a backend
    # that still serves the connections it had when its buckets moved away.
    named = set().union(*(t.hop_ids() for t in live_tables.values()))
    for bid, b in sorted(current.backends.items()):
        if b.active and bid not in ids.values() and bid not in named:
            ops_del.append(DeleteBackend(bid))

    # After the VIPs: an address's fragments never name a VIP not in lb_vips yet.
    addr_infos = desired_vip_addrs(cfg)
    for addr, info in addr_infos.items():
        if current.vip_addrs.get(addr) != info:
            ops_put.append(PutVipAddr(addr, info))

    for key in sorted(current.vips.keys() - desired_keys, key=_key_order):
        ops_del.insert(0, DeleteVip(key))
    for addr in sorted(current.vip_addrs.keys() - addr_infos.keys(), key=_addr_order):
        ops_del.insert(0, DeleteVipAddr(addr))
    for vip_id in sorted(current.tables.keys() - live_tables.keys()):
        ops_del.insert(0, DeleteTable(vip_id))
    for vip_id in sorted(current.members.keys() - live_members):
        ops_del.append(DeleteMembers(vip_id))
    # Deletions run VIPs first, then addresses, tables, members, backends.
    ops_del.sort(key=_del_rank)
    if current.vip_filter | new_bits != new_bits:
        ops_del.append(SetVipFilter(new_bits))
    acl_puts, acl_dels = plan_acl(acl_entries, current.acl)
    return acl_puts + ops_put + ops_del + acl_dels


def _before_tables(ops: list[Op]) -> int:
    """Where a member put goes: before the first table put of the plan so far."""
    return next((i for i, op in enumerate(ops) if isinstance(op, PutTable)), len(ops))


def plan_acl(
    wanted: Mapping[AclKey, abi.AclList], current: Mapping[AclKey, abi.AclList]
) -> tuple[list[Op], list[Op]]:
    """The ACL rules' puts (first in a plan) and deletions (last).

    While a plan runs the tries hold the old rules and the new ones together, the new
    action where a prefix is in both. For any source the longest match among them is
    then a new rule (the new verdict) or an old rule longer than every new match (the
    old verdict): a source both configurations deny is never let through. Flags that
    turn a scope on (``SetConfig``, ``PutVip``) follow the puts; a VIP that moves to a
    fresh id finds its rules in place.
    """
    puts: list[Op] = [
        PutAcl(k, wanted[k]) for k in sorted_keys(wanted) if current.get(k) != wanted[k]
    ]
    dels: list[Op] = [DeleteAcl(k) for k in sorted_keys(current.keys() - wanted.keys())]
    return puts, dels


def beamer_pending(cfg: Config, snap: Snapshot) -> bool:
    """Whether some Beamer table in ``snap`` has not reached its weights yet, i.e. a later
    plan (after the table's minimum interval) still has steps to take."""
    ids = {b.addr: i for i, b in snap.backends.items() if b.active}
    for vip in cfg.vips:
        params = snap.vips.get(vip_key(vip))
        if vip.table is not TableKindName.BEAMER or params is None:
            continue
        table = snap.tables.get(params.vip_id)
        weights = {ids[b.address]: b.weight for b in vip.backends if b.address in ids}
        if table is not None and any(weights.values()):
            want = {i: n for i, n in beamer.targets(weights, len(table)).items() if n}
            if table.counts() != want:
                return True
    return False


def _addr_order(a: IPAddress) -> tuple[int, IPAddress]:
    return (a.version, a)


def _key_order(v: Vip) -> tuple[int, IPAddress, int, int]:
    return (v.addr.version, v.addr, v.port, v.proto)


def _del_rank(op: Op) -> int:
    order = (DeleteVip, DeleteVipAddr, DeleteTable, DeleteMembers, DeleteBackend, SetVipFilter)
    return next(i for i, t in enumerate(order) if isinstance(op, t))


def apply_to_snapshot(snap: Snapshot, ops: Iterable[Op]) -> Snapshot:
    """What the maps hold after ``ops``: the planner's semantics, for tests and dry runs."""
    out = Snapshot(
        vips=dict(snap.vips),
        backends=dict(snap.backends),
        tables=dict(snap.tables),
        vip_addrs=dict(snap.vip_addrs),
        config=snap.config,
        acl=dict(snap.acl),
        members={k: dict(v) for k, v in snap.members.items()},
        vip_filter=snap.vip_filter,
    )
    for op in ops:
        match op:
            case SetConfig(config):
                out.config = config
            case PutBackend(bid, backend):
                out.backends[bid] = backend
            case PutTable(vip_id, table):
                out.tables[vip_id] = table
            case PutVipAddr(addr, n):
                out.vip_addrs[addr] = n
            case PutVip(vip, params):
                out.vips[vip] = params
            case DeleteVip(vip):
                del out.vips[vip]
            case DeleteVipAddr(addr):
                del out.vip_addrs[addr]
            case DeleteTable(vip_id):
                del out.tables[vip_id]
            case DeleteBackend(bid):
                out.backends[bid] = replace(out.backends[bid], active=False)
            case PutAcl(key, action):
                out.acl[key] = action
            case DeleteAcl(key):
                del out.acl[key]
            case PutMembers(vip_id, states):
                out.members[vip_id] = dict(states)
            case DeleteMembers(vip_id):
                out.members.pop(vip_id, None)
            case SetVipFilter(bits):
                out.vip_filter = bits
    return out
