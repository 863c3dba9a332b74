"""lb_xdp for one instance: its pinned maps, its XDP links, snapshots and plan application.

The maps are pinned by name under ``/sys/fs/bpf/xdplb/<instance>/abi-<N>`` (N: the
object's layout version, :mod:`xdplb.datapath.layout`) and the XDP links under
``/sys/fs/bpf/xdplb/<instance>/links``: a daemon that restarts finds them and keeps the
connection table; one of another layout migrates it (:mod:`xdplb.datapath.upgrade`);
either swaps its freshly loaded program into the existing links atomically.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import socket
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from xdplb.core import abi, limits, mapops, paths
from xdplb.core.acl import AclKey, hits_slot, rule_value
from xdplb.core.closing import Closing
from xdplb.core.errors import BpfError, XdplbError
from xdplb.core.state import (
    BackendState,
    LbConfig,
    LookupTable,
    Snapshot,
    Vip,
    VipAddrInfo,
    VipParams,
    filter_words,
    member_states,
    member_words,
    vip_index_slots,
)
from xdplb.datapath import layout, rcu
from xdplb.datapath.conns import SET_SIZE, ConnTable, check_mask
from xdplb.datapath.hooks import Hook
from xdplb.datapath.links import Link, XdpMode, attach_tcx, attach_xdp
from xdplb.datapath.maps import BPF_F_INNER_MAP, Map, MapType
from xdplb.datapath.objects import BpfObject, PinnedSizeError
from xdplb.datapath.programs import Program

MAP_NAMES = (
    "lb_vips",
    "lb_vip_addrs",
    "lb_backends",
    "lb_tables",
    "lb_btables",
    "lb_conns",
    "lb_config",
    "lb_vip_stats",
    "lb_be_stats",
    "lb_drops",
    "lb_events",
    "lb_acl4",
    "lb_acl6",
    "lb_acl_hits",
    "lb_rate",
    "lb_members",
    "lb_vip_filter",
    "lb_vip_index",
    "lb_vip_sel",
    "lb_sess_export",
)
_U32 = struct.Struct("<I")
#: The outer map of each table kind (docs/datapath.md): vip ids are unique across both.
TABLE_MAPS = {abi.TableKind.MAGLEV: "lb_tables", abi.TableKind.BEAMER: "lb_btables"}


#: Reads of a table that keeps being replaced under a reader before it gives up.
_TABLE_READ_TRIES = 5


def _u32(i: int) -> bytes:
    return _U32.pack(i)


@dataclass(frozen=True)
class Counters:
    """Every counter of lb_xdp, summed over CPUs."""

    drops: dict[abi.DropReason, int]
    events: dict[abi.Event, int]
    vips: dict[int, abi.Stats]  # vip id -> stats
    backends: dict[int, abi.Stats]  # backend id -> stats
    #: Entries in the connection table; None where its layout is not the one this
    #: Python reads (a test build of another layout, :attr:`LbMaps.conns_readable`).
    conns: int | None
    #: ACL hits: scope (vip id or ``abi.ACL_GLOBAL``) -> list -> packets, for the global
    #: scope and every VIP of the snapshot.
    acl_hits: dict[int, dict[abi.AclList, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class MapFill:
    """How full one map is: ``entries`` of ``max_entries`` (``lb_conns``: connections,
    sets x ways; ``estimated`` when counted from a sample)."""

    name: str
    entries: int
    max_entries: int
    estimated: bool = False


def pinned_sizes(pin_dir: Path) -> dict[str, int]:
    """max_entries of every map pinned directly under ``pin_dir`` whose name has a
    configured size (:data:`xdplb.core.limits.SIZED_MAPS`)."""
    out = {}
    for name in limits.SIZED_MAPS:
        path = pin_dir / name
        if path.exists():
            with Map.from_pinned(path) as m:
                out[name] = m.max_entries
    return out


def check_pins(instance: str, lim: limits.Limits, version: int | None = None) -> None:
    """ConfigError naming the ``limits`` field if a pinned map of ``instance`` (lb_xdp's
    or hc_tc's) of layout ``version`` (default: this xdplb's) has another size than
    ``lim`` gives it: checked before loading, since libbpf refuses to reuse such a pin.
    Another layout's maps are not reused, whatever their sizes (they are migrated)."""
    version = layout.current_version() if version is None else version
    root = paths.layout_dir(instance, version)
    wanted = limits.map_sizes(lim)
    for pin_dir in (root, root / "hc"):
        bad = limits.mismatches(pinned_sizes(pin_dir), wanted)
        if bad:
            raise bad[0].error(instance)


class LbMaps(Closing):
    """The maps of one lb_xdp instance, from a loaded object or from their pins."""

    def __init__(self, maps: dict[str, Map]) -> None:
        self.maps = maps
        #: Inner table map id -> its contents, for the tables this process wrote or
        #: has read: a snapshot then reads only the outer maps.
        self._tables: dict[int, LookupTable] = {}
        #: Likewise for lb_members' inner maps: map id -> the states written.
        self._members: dict[int, dict[int, abi.MemberState]] = {}
        self._conns: ConnTable | None = None

    @classmethod
    def from_pins(cls, pin_root: Path) -> LbMaps:
        """The maps pinned in ``pin_root``: a layout's directory
        (:func:`xdplb.datapath.layout.pins_dir` finds the one this xdplb reads)."""
        missing = [n for n in MAP_NAMES if not (pin_root / n).exists()]
        if missing:
            raise FileNotFoundError(f"{pin_root}: no pinned {', '.join(missing)}: is it running?")
        extra = [n for n in limits.SIZED_MAPS if n not in MAP_NAMES and (pin_root / n).exists()]
        return cls({n: Map.from_pinned(pin_root / n) for n in (*MAP_NAMES, *extra)})

    def __getitem__(self, name: str) -> Map:
        return self.maps[name]

    @property
    def conns_readable(self) -> bool:
        """``lb_conns`` has the layout :class:`ConnTable` reads (not a test build's)."""
        return self["lb_conns"].value_size == SET_SIZE

    @property
    def conn_capacity(self) -> int:
        """Sessions ``lb_conns`` holds: sets x ways."""
        return self["lb_conns"].max_entries * abi.CONN_WAYS

    @property
    def conns(self) -> ConnTable:
        """The session table (``lb_conns``), mapped into this process once; XdplbError
        where its layout is not the one this Python reads."""
        if not self.conns_readable:
            raise XdplbError(
                f"lb_conns has {self['lb_conns'].value_size}-byte sets, not the "
                f"{SET_SIZE} of layout {paths.layout_name(abi.ABI_VERSION)} this xdplb "
                "reads: its sessions cannot be listed here"
            )
        if self._conns is None:
            self._conns = ConnTable(self["lb_conns"])
        return self._conns

    def close(self) -> None:
        if self._conns is not None:
            self._conns.close()
            self._conns = None
        for m in self.maps.values():
            m.close()

    # -- reading -------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """What the maps hold now (the connection table aside), in the planner's terms."""
        snap = Snapshot()
        for k, v in self["lb_vips"].items():
            vip = Vip.from_abi(abi.VipKey.from_buffer_copy(k))
            snap.vips[vip] = VipParams.from_abi(abi.VipInfo.from_buffer_copy(v))
        raw = self["lb_backends"].lookup_array()
        size = ctypes.sizeof(abi.Backend)
        for bid in range(1, len(raw) // size):
            be = abi.Backend.from_buffer_copy(raw, bid * size)
            if be.family:  # a slot ever used
                snap.backends[bid] = BackendState.from_abi(be)
        live: set[int] = set()
        for kind, name in TABLE_MAPS.items():
            for k, v in list(self[name].items()):
                vip_id = _U32.unpack(k)[0]
                live.add(_U32.unpack(v)[0])
                table = self._table(kind, vip_id)
                if table is not None:
                    snap.tables[vip_id] = table
        # Forget tables no VIP holds any more (a map id is never reused while held).
        for map_id in self._tables.keys() - live:
            del self._tables[map_id]
        for k, v in self["lb_vip_addrs"].items():
            a = abi.Addr.from_buffer_copy(k)
            info = abi.VipAddrInfo.from_buffer_copy(v)
            snap.vip_addrs[abi.words_addr(a.addr, a.family)] = VipAddrInfo.from_abi(info)
        for name, version in (("lb_acl4", 4), ("lb_acl6", 6)):
            for k, v in self[name].items():
                action = abi.AclList(abi.AclRule.from_buffer_copy(v).action)
                snap.acl[AclKey.from_abi(k, version)] = action
        raw_cfg = self["lb_config"].lookup(_u32(0))
        if raw_cfg is not None:
            snap.config = LbConfig.from_abi(abi.Config.from_buffer_copy(raw_cfg))
        live_members: set[int] = set()
        for k, v in list(self["lb_members"].items()):
            vip_id, map_id = _U32.unpack(k)[0], _U32.unpack(v)[0]
            live_members.add(map_id)
            states = self._members.get(map_id)
            if states is None:
                # Not written by this process: read by id (CAP_SYS_ADMIN, as for tables).
                try:
                    with Map.from_id(map_id) as inner:
                        states = member_states(inner.lookup_array())
                except BpfError as e:
                    # ENOENT: replaced under us, the next one has it. EPERM: written by
                    # another process after we dropped CAP_SYS_ADMIN: unknown, so the
                    # next plan writes the VIP's members anew.
                    if e.errno not in (errno.ENOENT, errno.EPERM):
                        raise
                    continue
                self._members[map_id] = states
            snap.members[vip_id] = dict(states)
        for map_id in self._members.keys() - live_members:
            del self._members[map_id]
        words = np.frombuffer(self["lb_vip_filter"].lookup_array(), dtype="<u8")
        snap.vip_filter = frozenset(
            int(w) * 64 + b
            for w in np.nonzero(words)[0]
            for b in range(64)
            if int(words[w]) >> b & 1
        )
        return snap

    def table(self, vip_id: int) -> LookupTable | None:
        """A VIP's lookup table as it is in the maps (``lb_tables`` or ``lb_btables``),
        or None."""
        for kind in TABLE_MAPS:
            table = self._table(kind, vip_id)
            if table is not None:
                return table
        return None

    def _table(self, kind: abi.TableKind, vip_id: int) -> LookupTable | None:
        # A reader in another process (a CLI, a test) can find a table id whose map the
        # daemon has just replaced and freed: read the outer map again, then it names
        # the new one.
        for attempt in range(_TABLE_READ_TRIES):
            raw = self[TABLE_MAPS[kind]].lookup(_u32(vip_id))
            if raw is None:
                return None
            map_id = _U32.unpack(raw)[0]
            table = self._tables.get(map_id)
            if table is not None:
                return table
            # A table this process did not write: read it by id (CAP_SYS_ADMIN, so only
            # before the daemon drops its capabilities, xdplb.daemon.privileges).
            try:
                with Map.from_id(map_id) as inner:
                    table = LookupTable.from_contents(kind, inner.lookup_array())
            except BpfError as e:
                if e.errno == errno.EPERM:
                    # Put there by another process after we dropped CAP_SYS_ADMIN: not
                    # ours to read, so as good as absent (the next plan replaces it).
                    return None
                if e.errno != errno.ENOENT or attempt == _TABLE_READ_TRIES - 1:
                    raise
                continue
            self._tables[map_id] = table
            return table
        raise AssertionError("unreachable")

    def counters(self, *, exact_conns: bool = True, snap: Snapshot | None = None) -> Counters:
        """Every counter; the connection count is exact (reads the whole table) or
        estimated from a sample of its sets (``exact_conns=False``). ``snap``: a snapshot
        the caller has just taken (saves reading every table again)."""

        def u64(m: Map, idx: int) -> int:
            return sum(struct.unpack("<Q", raw)[0] for raw in m.lookup_percpu(_u32(idx)))

        snap = snap or self.snapshot()
        gen, tmo = snap.config.conn_gen, snap.config.conn_timeouts
        conns: int | None = None
        if not self.conns_readable:
            pass  # a test build's layout: the count is unavailable, the rest is not
        elif exact_conns:
            conns = self.conns.count(gen=gen, timeouts=tmo)
        else:
            conns = self.conns.estimate_count(gen=gen, timeouts=tmo)
        return Counters(
            drops={r: u64(self["lb_drops"], r) for r in abi.DropReason},
            events={e: u64(self["lb_events"], e) for e in abi.Event},
            vips={st.vip_id: self.stats("lb_vip_stats", st.vip_id) for st in snap.vips.values()},
            backends={i: self.stats("lb_be_stats", i) for i in sorted(snap.backends)},
            conns=conns,
            acl_hits=self.acl_hits([abi.ACL_GLOBAL, *(p.vip_id for p in snap.vips.values())]),
        )

    def stats(self, name: str, idx: int) -> abi.Stats:
        """Entry ``idx`` of the per-CPU stats array ``name`` (``lb_vip_stats``,
        ``lb_be_stats``), summed over CPUs."""
        out = abi.Stats()
        for raw in self[name].lookup_percpu(_u32(idx)):
            s = abi.Stats.from_buffer_copy(raw)
            out.packets += s.packets
            out.bytes += s.bytes
            out.new_flows += s.new_flows
        return out

    def acl_hits(self, scopes: Iterable[int]) -> dict[int, dict[abi.AclList, int]]:
        """ACL hits per scope (vip id or ``abi.ACL_GLOBAL``) and list, summed over CPUs."""
        hits = self["lb_acl_hits"]
        out: dict[int, dict[abi.AclList, int]] = {}
        for scope in scopes:
            slot = hits_slot(scope)
            out[scope] = {
                lst: sum(
                    struct.unpack("<Q", raw)[0]
                    for raw in hits.lookup_percpu(_u32(slot * len(abi.AclList) + lst))
                )
                for lst in abi.AclList
            }
        return out

    # -- writing -------------------------------------------------------------------------

    def apply(self, ops: Iterable[mapops.Op]) -> None:
        """Carry out a plan, in order. ``lb_vip_index`` follows ``lb_vips``: rebuilt once
        after each run of VIP operations, so lb_xdp sees each run whole."""
        dirty = False
        for op in ops:
            vip_op = isinstance(op, mapops.PutVip | mapops.DeleteVip)
            if dirty and not vip_op:
                self._rebuild_vip_index()
                dirty = False
            self._apply(op)
            dirty |= vip_op
        if dirty:
            self._rebuild_vip_index()

    def _rebuild_vip_index(self) -> None:
        """``lb_vip_index`` from ``lb_vips``: the table lb_xdp does not read (its last
        reader gone: an RCU grace period), written whole, then made the live one."""
        raw = self["lb_config"].lookup(_u32(0))
        assert raw is not None  # an array's one entry
        slots = abi.Config.from_buffer_copy(raw).vip_index_mask + 1
        index = self["lb_vip_index"]
        if 2 * slots > index.max_entries:
            raise ValueError(f"lb_vip_index holds {index.max_entries} slots, not 2 x {slots}")
        vips = {
            Vip.from_abi(abi.VipKey.from_buffer_copy(k)): VipParams.from_abi(
                abi.VipInfo.from_buffer_copy(v)
            )
            for k, v in self["lb_vips"].items()
        }
        table = vip_index_slots(vips, slots)
        sel = self["lb_vip_sel"]
        live = _U32.unpack(sel.lookup(_u32(0)) or _u32(0))[0] & 1
        spare = 1 - live
        rcu.synchronize()  # a reader of the spare table, from before the last flip, is done
        keys = np.arange(spare * slots, (spare + 1) * slots, dtype=np.uint32)
        index.update_batch(keys, table, slots)
        sel.update(_u32(0), _u32(spare))

    def _apply(self, op: mapops.Op) -> None:
        match op:
            case mapops.SetConfig(config):
                # A mask beyond the table would make lb_xdp miss every flow: refuse it.
                check_mask(config.conn_mask, self["lb_conns"].max_entries)
                self["lb_config"].update(_u32(0), config.abi_value().pack())
            case mapops.PutBackend(bid, backend):
                self["lb_backends"].update(_u32(bid), backend.abi_value().pack())
            case mapops.DeleteBackend(bid):
                raw = self["lb_backends"].lookup(_u32(bid))
                if raw is not None:
                    be = abi.Backend.from_buffer_copy(raw)
                    be.flags &= ~abi.BACKEND_F_ACTIVE
                    self["lb_backends"].update(_u32(bid), be.pack())
            case mapops.PutTable(vip_id, table, kind):
                # A new inner map, filled, then swapped in with one update: lb_xdp sees the
                # old table or the new one, never a half-written one.
                # BPF_F_INNER_MAP on both sides: the kernel compares flags with the template.
                beamer = kind is abi.TableKind.BEAMER
                with Map.create(
                    MapType.ARRAY,
                    4,
                    ctypes.sizeof(abi.Bucket) if beamer else 4,
                    len(table),
                    name=f"lb_{'b' if beamer else ''}tbl_{vip_id}",
                    flags=BPF_F_INNER_MAP,
                ) as inner:
                    inner.update_array(table.contents(kind))
                    self[TABLE_MAPS[kind]].update(_u32(vip_id), _u32(inner.fd))
                    self._tables[inner.id] = table
            case mapops.DeleteTable(vip_id):
                # Both maps: the op does not say which holds it (deleting a missing key is
                # a no-op), and a table no VIP names any more has no kind to go by.
                for name in TABLE_MAPS.values():
                    self[name].delete(_u32(vip_id))
            case mapops.PutVipAddr(addr, info):
                self["lb_vip_addrs"].update(abi.Addr.make(addr).pack(), info.abi_value().pack())
            case mapops.DeleteVipAddr(addr):
                self["lb_vip_addrs"].delete(abi.Addr.make(addr).pack())
            case mapops.PutVip(vip, params):
                self["lb_vips"].update(vip.abi_key().pack(), params.abi_value().pack())
            case mapops.DeleteVip(vip):
                self["lb_vips"].delete(vip.abi_key().pack())
            case mapops.PutAcl(key, action):
                self[key.map_name].update(key.abi_key().pack(), rule_value(action))
            case mapops.DeleteAcl(key):
                self[key.map_name].delete(key.abi_key().pack())
            case mapops.PutMembers(vip_id, states):
                # Like a table: a new inner map, filled, swapped in with one update.
                words = -(-self["lb_backends"].max_entries // abi.MEMBERS_PER_WORD)
                with Map.create(
                    MapType.ARRAY, 4, 8, words, name=f"lb_mem_{vip_id}", flags=BPF_F_INNER_MAP
                ) as inner:
                    inner.update_array(member_words(states, words))
                    self["lb_members"].update(_u32(vip_id), _u32(inner.fd))
                    self._members[inner.id] = dict(states)
            case mapops.DeleteMembers(vip_id):
                self["lb_members"].delete(_u32(vip_id))
            case mapops.SetVipFilter(bits):
                self["lb_vip_filter"].update_array(filter_words(bits))

    def fill(self, snap: Snapshot, conns_used: int | None = None) -> list[MapFill]:
        """Entries / max entries of every map sized by ``limits`` that this instance has.
        ``snap``: a fresh snapshot (VIPs, backends and tables are counted from it);
        ``conns_used``: the connection table's count if the caller has one (else
        estimated from a sample). An array always holds max_entries slots: its entries
        are the slots the ids in use occupy (backend ids, VIP ids, ACL scopes), never
        max_entries. Hash maps sized by traffic (ACLs, rate limit) are counted with a
        batch lookup or a key walk. lb_nexthops, not pinned, is reported from the pins
        too: its size is lb_backends'."""
        readable = self.conns_readable
        if not readable:
            used_conns = None
        elif conns_used is None:
            cfg = snap.config
            used_conns = self.conns.estimate_count(gen=cfg.conn_gen, timeouts=cfg.conn_timeouts)
        else:
            used_conns = conns_used
        vip_ids = {p.vip_id for p in snap.vips.values()} | set(snap.tables)
        in_map = {
            name: sum(1 for i in snap.tables if self[name].lookup(_u32(i)) is not None)
            for name in TABLE_MAPS.values()
        }
        active = sum(1 for b in snap.backends.values() if b.active)
        counted = {
            "lb_vips": len(snap.vips),
            "lb_vip_addrs": len(snap.vip_addrs),
            "lb_tables": in_map["lb_tables"],
            "lb_btables": in_map["lb_btables"],
            "lb_vip_stats": len(vip_ids),
            "lb_backends": active,
            "lb_be_stats": active,
            "lb_nexthops": active,
            # A slot per VIP id and the global one, a counter per list in each.
            "lb_acl_hits": (len(vip_ids) + 1) * len(abi.AclList),
            # Arrays too: a VIP's member states, a VIP's slot in the live index.
            "lb_members": len(snap.members),
            "lb_vip_index": len(snap.vips),
        }
        out = []
        for name in limits.SIZED_MAPS:
            size = self._max_entries(name)
            if size is None:
                continue
            if name == "lb_conns":
                if used_conns is not None:  # None: a layout this Python does not read
                    out.append(MapFill(name, used_conns, self.conn_capacity, conns_used is None))
            elif name in counted:
                out.append(MapFill(name, counted[name], size))
            else:
                out.append(MapFill(name, self[name].count(), size))
        return out

    def _max_entries(self, name: str) -> int | None:
        """max_entries of map ``name``; for one this process has not (lb_nexthops from
        the pins), that of a map sized alike from the same ``limits`` field; None if
        neither."""
        if (m := self.maps.get(name)) is not None:
            return m.max_entries
        want = limits.SIZED_MAPS[name]
        for other, sized in limits.SIZED_MAPS.items():
            if other in self.maps and sized == replace(want, name=other):
                return self.maps[other].max_entries
        return None

    def flush_conns(self) -> int:
        """Flush the session table (as if another LB node took over): a new ``conn_gen``
        in ``lb_config``, so every session is a miss from the next packet on. Nothing is
        written into the table itself. Returns how many sessions the old generation had
        (live or not)."""
        raw = self["lb_config"].lookup(_u32(0))
        assert raw is not None  # an array's one entry
        n = self.conns.count(gen=abi.Config.from_buffer_copy(raw).conn_gen)
        self.bump_generation()
        return n

    def _edit_config(self, edit: Callable[[abi.Config], None]) -> abi.Config:
        """``lb_config`` read, changed by ``edit``, written back; the new value."""
        raw = self["lb_config"].lookup(_u32(0))
        assert raw is not None  # an array's one entry
        cfg = abi.Config.from_buffer_copy(raw)
        edit(cfg)
        self["lb_config"].update(_u32(0), cfg.pack())
        return cfg

    def bump_generation(self) -> None:
        """``lb_config.conn_gen`` + 1, every other field as it is: the flush itself."""

        def bump(cfg: abi.Config) -> None:
            cfg.conn_gen = (cfg.conn_gen + 1) & 0xFFFF

        self._edit_config(bump)

    def probe_key(self) -> int:
        """``lb_config.probe_key``, set to a random nonzero value first if it is 0 (the
        self-check's probe carries it; plans keep it)."""

        def ensure(cfg: abi.Config) -> None:
            while not cfg.probe_key:
                cfg.probe_key = secrets.randbits(32)

        return int(self._edit_config(ensure).probe_key)


def tc_object(xdp_object: Path) -> Path:
    """The lb_tc object built from the same sources (so the same layout) as an lb_xdp
    object: ``lb_xdp*.bpf.o`` -> ``lb_tc*.bpf.o`` beside it."""
    path = xdp_object.with_name(xdp_object.name.replace("lb_xdp", "lb_tc", 1))
    if path == xdp_object or not path.exists():
        raise FileNotFoundError(f"{path} is missing: lb_tc must be built beside {xdp_object}")
    return path


def link_name(hook: Hook, ifname: str) -> str:
    """The pin of an interface's link under ``links/``: ``xdp_<if>`` or ``tc_<if>``."""
    return f"{hook}_{ifname}"


def pinned_links(pin_root: Path) -> dict[str, Hook]:
    """Interface -> hook, from the link pins under ``pin_root/links``."""
    out = {}
    for path in sorted((pin_root / paths.LINKS_DIR).glob("*_*")):
        hook, _, ifname = path.name.partition("_")
        if hook in {h.value for h in Hook}:
            out[ifname] = Hook(hook)
    return out


class LbDatapath(LbMaps):
    """The balancer loaded for an instance: lb_xdp (and lb_tc once an interface wants it),
    their shared maps and their links."""

    def __init__(
        self, instance: str, obj_path: Path | None = None, lim: limits.Limits | None = None
    ) -> None:
        """Load lb_xdp with its maps sized by ``lim`` (default: the sizes the object
        declares, which are the configuration's defaults). A pinned map of another size:
        ConfigError naming the ``limits`` field, nothing loaded."""
        self.instance = instance
        path = obj_path or paths.bpf_object("lb_xdp")
        #: The object's layout (``XDPLB_ABI_VERSION``): where its maps are pinned.
        self.abi_version = layout.object_version(path)
        #: The instance's pin directory (links/ and every layout's maps).
        self.pin_root = paths.pin_root(instance)
        #: This layout's maps: ``<pin_root>/abi-<N>``.
        self.pin_dir = paths.layout_dir(instance, self.abi_version)
        #: No map of this layout was pinned before this load (a first start or an
        #: upgrade): :meth:`unpin` may remove them again if the start fails.
        self.fresh = not (self.pin_dir / layout.MARKER).exists()
        self.pin_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.pin_root, 0o700)  # pins are root's business only
        self.pin_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.pin_dir, 0o700)
        self._obj_path = path
        self._lim = lim
        try:
            # The maps only: the program is verified when an interface runs it (the
            # verifier's pass is most of a start, and veth runs lb_tc instead).
            self.obj = self._load(path, programs=())
        except PinnedSizeError as e:
            name, pinned, wanted = e.mismatches[0]
            raise limits.PinnedSizeMismatch(name, pinned, wanted).error(instance) from None
        #: lb_xdp and lb_tc, each loaded on the first use: the same maps (by their pins).
        self._xdp_obj: BpfObject | None = None
        self._tc_obj: BpfObject | None = None
        # MAP_NAMES, plus whichever sized maps (ACLs, rate limit) this object has.
        names = [*MAP_NAMES, *(n for n in limits.SIZED_MAPS if n in self.obj.maps)]
        super().__init__({n: self.obj.map(n) for n in dict.fromkeys(names)})

    def link_path(self, ifname: str, hook: Hook = Hook.XDP) -> Path:
        return self.pin_root / paths.LINKS_DIR / link_name(hook, ifname)

    def _load(self, path: Path, programs: tuple[str, ...]) -> BpfObject:
        return BpfObject.load(
            path,
            pin_root=self.pin_dir,
            max_entries=limits.map_sizes(self._lim) if self._lim is not None else None,
            programs=programs,
        )

    @property
    def xdp_object(self) -> BpfObject:
        """lb_xdp's object with its program, loaded now if it is not yet. Its unpinned
        maps (per-CPU caches, a test build's checks) are the program's own; :attr:`obj`
        has copies of them that no program uses."""
        if self._xdp_obj is None:
            self._xdp_obj = self._load(self._obj_path, programs=("lb_xdp",))
        return self._xdp_obj

    @property
    def program(self) -> Program:
        """lb_xdp (loaded now if it is not yet)."""
        return self.xdp_object.program("lb_xdp")

    def hook_program(self, hook: Hook) -> Program:
        """lb_xdp or lb_tc, loaded now if it is not yet, its maps the pinned ones."""
        if hook is Hook.XDP:
            return self.program
        if self._tc_obj is None:
            self._tc_obj = self._load(tc_object(self._obj_path), programs=("lb_tc",))
        return self._tc_obj.program("lb_tc")

    def attach(self, ifname: str, hook: Hook = Hook.XDP, mode: XdpMode = XdpMode.NATIVE) -> bool:
        """Make ``ifname`` run the balancer at ``hook``; True if a new link was made.

        An existing pinned link is kept and switched to this program atomically
        (bpf_link_update): a restart or upgrade never leaves the interface without the
        balancer. An interface moving to the other hook gets its new link first, then
        loses the old one: the old hook's program, which runs first (XDP before TC),
        forwards until then."""
        prog = self.hook_program(hook)
        path = self.link_path(ifname, hook)
        if path.exists():
            with Link.from_pinned(path) as link:
                link.update_program(prog)
            return False
        ifindex = socket.if_nametoindex(ifname)
        link = attach_tcx(prog, ifindex) if hook is Hook.TC else attach_xdp(prog, ifindex, mode)
        with link:
            path.parent.mkdir(parents=True, exist_ok=True)
            link.pin(path)
        for other in Hook:
            if other is not hook:
                self.detach(ifname, other)
        return True

    def detach(self, ifname: str, hook: Hook | None = None) -> None:
        """Detach the balancer from ``ifname`` (at ``hook`` only, if given)."""
        for h in Hook if hook is None else (hook,):
            path = self.link_path(ifname, h)
            if path.exists():
                with Link.from_pinned(path) as link:
                    link.detach()
                path.unlink()

    def attached(self) -> dict[str, Hook]:
        """Interface -> the hook the balancer runs at there."""
        return pinned_links(self.pin_root)

    def unpin(self) -> int:
        """Remove this layout's pins (not the links): for a start that failed before
        attaching, when :attr:`fresh` says this load made them. Returns how many."""
        return layout.remove_layout(self.instance, self.abi_version)

    def close(self) -> None:
        super().close()
        for obj in (self._xdp_obj, self._tc_obj):
            if obj is not None:
                obj.close()
        self.obj.close()


#: statfs(2) ``f_type`` of bpffs (linux/magic.h).
BPF_FS_MAGIC = 0xCAFE4A11


def fs_magic(path: Path) -> int:
    """statfs(2) ``f_type`` of the file system holding ``path``; OSError."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type is its first word
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], sys.byteorder) & 0xFFFFFFFF


def checked_pin_root(instance: str) -> Path:
    """The pin directory of ``instance``, once it is sure its pins are the kernel's: the
    pin root (or its nearest existing parent) is on bpffs, and the directory is a real
    directory directly under it. XdplbError saying which is not."""
    root = paths.pin_root(instance)
    near = root
    while not near.exists() and near != near.parent:
        near = near.parent
    magic = fs_magic(near)
    if magic != BPF_FS_MAGIC:
        raise XdplbError(
            f"bpffs is not mounted at {near} (its file system is {magic:#x}, not bpffs "
            f"{BPF_FS_MAGIC:#x}; inside `ip netns exec`?): the pins of {instance} are not "
            "visible here"
        )
    for p in (root, root / "links"):
        if p.is_symlink():
            raise XdplbError(f"{p} is a symbolic link, not a directory of pins")
    if root.exists() and root.resolve().parent != paths.BPFFS_ROOT.resolve():
        raise XdplbError(f"{root} is not directly under {paths.BPFFS_ROOT}")
    return root


@dataclass(frozen=True)
class Destroyed:
    """What :func:`destroy` did: the interfaces it detached the balancer from (name, hook,
    link id, program id), how many pins it removed, and what it could not (paths left)."""

    detached: tuple[tuple[str, Hook, int, int], ...]
    pins: int
    left: tuple[str, ...]


def destroy(instance: str) -> Destroyed:
    """Detach every link of an instance and remove all of its pins (maps included).
    XdplbError before anything is done if :func:`checked_pin_root` refuses; BpfError if a
    link does not detach (its pin and the rest are then kept)."""
    root = checked_pin_root(instance)
    if not root.is_dir():
        return Destroyed((), 0, ())
    detached = []
    for ifname, hook in pinned_links(root).items():
        path = root / paths.LINKS_DIR / link_name(hook, ifname)
        with Link.from_pinned(path) as link:
            link_id, prog_id = link.id, link.prog_id
            link.detach()
            if link.xdp_ifindex != 0:
                raise XdplbError(f"link {link_id} on {ifname} is still attached after detach")
        detached.append((ifname, hook, link_id, prog_id))
    pins = [p for p in root.rglob("*") if not p.is_dir()]
    shutil.rmtree(root, ignore_errors=True)
    left = [str(p) for p in (root, *pins) if p.exists()]
    return Destroyed(tuple(detached), len(pins), tuple(left))
