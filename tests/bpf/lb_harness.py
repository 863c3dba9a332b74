"""The harness of the lb_xdp tests: the lab namespace, map configuration, counters.

conftest.py turns these into fixtures; test modules import the types from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import itertools
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import lb_fixtures as fx
import numpy as np

from xdplb.config import Config
from xdplb.control import planner
from xdplb.control.planner import MemberOverrides
from xdplb.core import abi, hashing, mapops
from xdplb.core.errors import BpfError
from xdplb.core.state import (
    DEFAULT_TIMEOUTS,
    LbConfig,
    LookupTable,
    Vip,
    VipParams,
    filter_bits,
    timeout_ticks,
    vip_addr_infos,
)
from xdplb.datapath import BPF_F_INNER_MAP, BpfObject, Map, MapType, TestRunResult, clock
from xdplb.datapath.conns import ConnTable, Entry
from xdplb.datapath.lb import MAP_NAMES, TABLE_MAPS, LbMaps
from xdplb.datapath.programs import Program
from xdplb.datapath.testrun import BPF_PROG_TYPE_SCHED_CLS, skb_ctx

#: A table as the harness installed it: first hops, later hops, kind.
_TableDef = tuple[tuple[int, ...], tuple[tuple[int, ...], ...], abi.TableKind]
serial = itertools.count()


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


@dataclasses.dataclass(frozen=True)
class LabNetns:
    name: str
    lb_ifindex: int
    lb_mac: str


def configure_lab(name: str) -> LabNetns:
    """Runs inside the namespace: every socket and /proc/sys file below is its own."""
    from pyroute2 import IPRoute
    from pyroute2.netlink.rtnl.ifaddrmsg import IFA_F_NODAD
    from pyroute2.netlink.rtnl.ndmsg import states

    for path in ("/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"):
        Path(path).write_text("1\n")
    with IPRoute() as ipr:
        ipr.link("add", ifname="lb0", kind="veth", peer="lb0p")
        (lb0,) = ipr.link_lookup(ifname="lb0")
        (lb0p,) = ipr.link_lookup(ifname="lb0p")
        for idx in (lb0p, lb0):
            ipr.link("set", index=idx, state="up")
        ipr.addr("add", index=lb0, address=str(fx.LB_SRC4), prefixlen=24)
        ipr.addr("add", index=lb0, address=str(fx.LB_SRC6), prefixlen=64, flags=IFA_F_NODAD)
        for be in fx.BACKENDS.values():
            if be.mac is not None:
                ipr.neigh(
                    "add",
                    dst=str(be.addr),
                    lladdr=be.mac,
                    ifindex=lb0,
                    state=states["permanent"],
                )
        (link,) = ipr.get_links(lb0)
        mac = link.get_attr("IFLA_ADDRESS")
    return LabNetns(name, lb0, mac)


def _sum_u64(m: Map, idx: int) -> int:
    return sum(struct.unpack("<Q", v)[0] for v in m.lookup_percpu(_u32(idx)))


#: XDP actions (linux/bpf.h), the verdicts every test compares.
XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = 1, 2, 3, 4
#: TC verdicts (linux/pkt_cls.h) as test_run's unsigned retval.
TC_ACT_UNSPEC, TC_ACT_SHOT, TC_ACT_REDIRECT = 0xFFFFFFFF, 2, 7


class FrameRefused(Exception):
    """BPF_PROG_TEST_RUN refuses this frame for an skb program (EINVAL): an IPv4 or IPv6
    EtherType with less than its fixed header behind it (:func:`skb_run_refuses`). The
    TC hook can still see such frames; a test run cannot make one. lb_xdp's runs of the
    same frames test the same parse (lib/lb_parse.h)."""


def skb_run_refuses(frame: bytes) -> bool:
    """The kernel's condition for :class:`FrameRefused`, so that a test skips exactly
    those frames and no others."""
    ethertype = int.from_bytes(frame[12:14], "big")
    fixed = {0x0800: 20, 0x86DD: 40}.get(ethertype)
    return fixed is not None and len(frame) - 14 < fixed


def lb_program(obj: BpfObject) -> Program:
    """The balancer's program of a loaded object: lb_tc in lb_tc's object, else lb_xdp."""
    return obj.programs["lb_tc"] if "lb_tc" in obj.programs else obj.program("lb_xdp")


def run_lb(obj: BpfObject, frame: bytes, ifindex: int) -> TestRunResult:
    """One frame through the object's balancer, coming in on ``ifindex``, its verdict as
    an XDP action whatever the hook: lb_tc's TC_ACT_UNSPEC is a pass, TC_ACT_SHOT a drop,
    and TC_ACT_REDIRECT a redirect or a TX: one to another device is counted REDIRECT (lib/fib.h),
    every other (a forward back out, an ICMP answer) is a TX. Any other TC verdict is
    returned as it is (and fails)."""
    prog = lb_program(obj)
    if prog.type != BPF_PROG_TYPE_SCHED_CLS:
        return prog.test_run(frame, ingress_ifindex=ifindex)
    events = obj.map("lb_events")
    redirects = _sum_u64(events, abi.Event.REDIRECT)
    try:
        r = prog.test_run(frame, ctx=skb_ctx(ifindex=ifindex, ingress_ifindex=ifindex))
    except BpfError as e:
        if e.errno == errno.EINVAL and skb_run_refuses(frame):
            raise FrameRefused(frame.hex()) from e
        raise
    if r.retval == TC_ACT_UNSPEC:
        action = XDP_PASS
    elif r.retval == TC_ACT_SHOT:
        action = XDP_DROP
    elif r.retval == TC_ACT_REDIRECT:
        action = XDP_REDIRECT if _sum_u64(events, abi.Event.REDIRECT) > redirects else XDP_TX
    else:
        action = 1000 + r.retval
    return dataclasses.replace(r, retval=action)


def _sum_stats(m: Map, idx: int) -> tuple[int, int, int]:
    rows = [struct.unpack("<QQQ", v) for v in m.lookup_percpu(_u32(idx))]
    return (sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows))


@dataclasses.dataclass(frozen=True)
class Counters:
    """Every counter the fixture configuration can move, summed over CPUs."""

    events: dict[int, int]
    drops: dict[int, int]
    vip_stats: dict[int, tuple[int, int, int]]
    be_stats: dict[int, tuple[int, int, int]]

    def __sub__(self, before: Counters) -> Counters:
        def d1(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
            return {k: a[k] - b[k] for k in a if a[k] != b[k]}

        def d3(
            a: dict[int, tuple[int, int, int]], b: dict[int, tuple[int, int, int]]
        ) -> dict[int, tuple[int, int, int]]:
            out = {}
            for k in a:
                diff = tuple(x - y for x, y in zip(a[k], b[k], strict=True))
                if any(diff):
                    out[k] = (diff[0], diff[1], diff[2])
            return out

        return Counters(
            d1(self.events, before.events),
            d1(self.drops, before.drops),
            d3(self.vip_stats, before.vip_stats),
            d3(self.be_stats, before.be_stats),
        )

    def named(self) -> dict[str, object]:
        """For assertion messages: enum names instead of indices."""
        return {
            "events": {abi.Event(k).name: v for k, v in self.events.items()},
            "drops": {abi.DropReason(k).name: v for k, v in self.drops.items()},
            "vip_stats": self.vip_stats,
            "be_stats": self.be_stats,
        }


class Lb:
    """lb_xdp loaded, configured with the fixture lab, run inside the lab namespace.

    The maps are written the way the daemon writes them where the program reads a
    derived form: VIPs through :class:`LbMaps` (``lb_vips``, then ``lb_vip_index``
    rebuilt from it), ``lb_vip_filter`` and ``lb_members`` with the planner's ops.
    """

    def __init__(self, obj: BpfObject, ns: LabNetns) -> None:
        self.obj = obj
        self.ns = ns
        self.env = fx.Env(lb_mac=ns.lb_mac)
        self.prog = lb_program(obj)
        #: The object's maps as the daemon handles them (never closed: the object owns
        #: the maps).
        self.maps = LbMaps({n: obj.map(n) for n in MAP_NAMES})
        #: The session table, mapped (``lb_conns``).
        self.conns: ConnTable = self.maps.conns
        #: vip id -> (first hops, later hops, kind) of the table installed now.
        self._tables: dict[int, _TableDef] = {}
        #: vip id -> the member states installed now.
        self._members: dict[int, dict[int, abi.MemberState]] = {}
        #: ``lb_config`` as last written.
        self.config = LbConfig(None, None)
        #: The planner wrote the maps (:meth:`plan`): the next reset rewrites them all.
        self._planned = False

    # -- configuration -------------------------------------------------------------------

    def reset(self) -> None:
        """Empty every map, then install the fixture configuration."""
        for name in ("lb_vips", "lb_vip_addrs"):
            m = self.obj.map(name)
            for key in list(m.keys()):
                m.delete(key)
        # No program runs on this table between cases: a wipe, not a generation.
        self.conns.wipe()
        if self._planned:
            # What the planner wrote is not what the caches say: start from empty maps.
            for name in (*TABLE_MAPS.values(), "lb_members"):
                m = self.obj.map(name)
                for key in list(m.keys()):
                    m.delete(key)
            self._tables.clear()
            self._members.clear()
            self._planned = False
        # Every lb_tables / lb_btables / lb_members write waits for an RCU grace period
        # (map-in-map): rewrite only the tables a test changed.
        wanted = {v.id for v in fx.VIPS.values() if v.backends}
        for vip_id in [i for i in self._tables if i not in wanted]:
            self.obj.map(TABLE_MAPS[self._tables.pop(vip_id)[2]]).delete(_u32(vip_id))
        for vip_id in [i for i in self._members if i not in wanted]:
            del self._members[vip_id]
            self.maps.apply([mapops.DeleteMembers(vip_id)])
        self.set_config()
        for be in fx.BACKENDS.values():
            self.set_backend(be.id, active=be.active)
        self.put_vips(fx.VIPS.values())
        self.set_vip_addrs()
        self.set_vip_filter({v.addr for v in fx.VIPS.values()})

    def set_vip_addrs(self, **kw: Any) -> None:
        """lb_vip_addrs as the planner makes it for the fixture VIPs (``vip_addr_infos``
        keywords: ``chosen``, ``echo``)."""
        vips = [Vip(v.addr, v.port, v.proto) for v in fx.VIPS.values()]
        for addr, info in vip_addr_infos(vips, **kw).items():
            self.obj.map("lb_vip_addrs").update(abi.Addr.make(addr).pack(), info.abi_value().pack())

    def set_vip_filter(self, addrs: Iterable[fx.IPAddress]) -> None:
        """``lb_vip_filter`` with exactly the bits of ``addrs`` (planner op SetVipFilter)."""
        self.maps.apply([mapops.SetVipFilter(filter_bits(addrs))])

    def set_config(
        self,
        *,
        src4: bool = True,
        src6: bool = True,
        seed: int = fx.SEED,
        flags: int = 0,
        **kw: Any,
    ) -> LbConfig:
        """``lb_config``: the fixture's addresses and seed, no insert budget, the default
        session timeouts at the kernel's HZ; ``kw``: other :class:`LbConfig` fields
        (``conn_gen``, ``conn_timeouts``, ``flood_max``, ...)."""
        hz = clock.hz()
        fields: dict[str, Any] = {
            "gue_port": fx.GUE_PORT,
            "seed": seed,
            "conn_mask": self.obj.map("lb_conns").max_entries - 1,
            "flood_max": 0,
            "flags": flags,
            "conn_timeouts": tuple(timeout_ticks(s, hz) for s in DEFAULT_TIMEOUTS),
            "hz": hz,
        }
        fields.update(kw)
        self.config = LbConfig(
            fx.LB_SRC4 if src4 else None,
            fx.LB_SRC6 if src6 else None,
            **fields,
        )
        self.maps.apply([mapops.SetConfig(self.config)])
        return self.config

    def update_config(self, **kw: Any) -> LbConfig:
        """``lb_config`` as it is, with ``kw`` (:class:`LbConfig` fields) changed."""
        self.config = dataclasses.replace(self.config, **kw)
        self.maps.apply([mapops.SetConfig(self.config)])
        return self.config

    def set_backend(self, be_id: int, *, active: bool = True, gen: int = 0) -> None:
        be = fx.BACKENDS[be_id]
        flags = abi.BACKEND_F_ACTIVE if active else 0
        self.obj.map("lb_backends").update(
            _u32(be_id), abi.Backend.make(be.addr, flags, gen).pack()
        )

    def put_vip(self, vip: fx.VipDef) -> None:
        self.put_vips([vip])

    def put_vips(self, vips: Iterable[fx.VipDef]) -> None:
        """``lb_vips`` entries (``lb_vip_index`` rebuilt once after them), each VIP's table
        and its members (every backend its table names ACTIVE)."""
        ops: list[mapops.Op] = []
        for vip in vips:
            params = VipParams(
                vip.id,
                vip.flags,
                fx.TABLE_SIZE if vip.backends else 0,
                vip.encap,
                vip.table_kind,
            )
            ops.append(mapops.PutVip(Vip(vip.addr, vip.port, vip.proto), params))
            if vip.backends is not None and self._tables.get(vip.id) != (
                vip.backends,
                vip.rest,
                vip.table_kind,
            ):
                self.set_table(vip.id, vip.backends, vip.rest, kind=vip.table_kind)
            elif vip.backends is not None:
                self.set_members(vip.id, _table_members(vip.backends, vip.rest))
        self.maps.apply(ops)

    def set_table(
        self,
        vip_id: int,
        first: Iterable[int],
        rest: Iterable[tuple[int, ...]] = (),
        *,
        kind: abi.TableKind = abi.TableKind.MAGLEV,
        members: dict[int, abi.MemberState] | None = None,
    ) -> None:
        """A fresh inner table (bucket i -> first[i % n], then rest[i % m]), swapped into
        the outer map of ``kind`` (a Maglev table has no later hops); then the VIP's
        members: ``members``, or every backend the table names ACTIVE."""
        first, rest = tuple(first), tuple(tuple(r) for r in rest)
        old = self._tables.get(vip_id)
        if old is not None and old[2] != kind:
            self.obj.map(TABLE_MAPS[old[2]]).delete(_u32(vip_id))
        self._tables[vip_id] = (first, rest, kind)
        hops = np.zeros((fx.TABLE_SIZE, abi.MAX_HOPS), dtype=np.uint32)
        hops[:, 0] = [first[i % len(first)] for i in range(fx.TABLE_SIZE)]
        for i in range(fx.TABLE_SIZE) if rest else ():
            later = rest[i % len(rest)]
            hops[i, 1 : 1 + len(later)] = later
        table = LookupTable.from_buckets(hops)
        beamer = kind is abi.TableKind.BEAMER
        with Map.create(
            MapType.ARRAY,
            4,
            ctypes.sizeof(abi.Bucket) if beamer else 4,
            fx.TABLE_SIZE,
            name=f"lbt_tbl_{vip_id}",
            flags=BPF_F_INNER_MAP,
        ) as inner:
            inner.update_array(table.contents(kind))
            self.obj.map(TABLE_MAPS[kind]).update(_u32(vip_id), _u32(inner.fd))
        self.set_members(vip_id, members if members is not None else _table_members(first, rest))

    def set_members(self, vip_id: int, states: dict[int, abi.MemberState]) -> None:
        """``lb_members[vip_id]`` (planner op PutMembers), if it is not that already."""
        if self._members.get(vip_id) == states:
            return
        self._members[vip_id] = dict(states)
        self.maps.apply([mapops.PutMembers(vip_id, states)])

    def set_member(self, vip_id: int, be_id: int, state: abi.MemberState) -> None:
        """One backend's state in a VIP, the others' as they are."""
        self.set_members(vip_id, {**self._members.get(vip_id, {}), be_id: state})

    def plan(
        self, cfg: Config, *, members: MemberOverrides | None = None, now: float = 0.0
    ) -> list[mapops.Op]:
        """What the daemon does with a configuration: the planner's ops from a snapshot
        of the maps, applied (the lab's backends keep their ids: the planner keeps an
        active address's slot). Returns the ops."""
        ops = planner.plan(cfg, self.maps.snapshot(), members=members, now=now, hz=clock.hz())
        self._planned = True
        self.maps.apply(ops)
        self.config = self.maps.snapshot().config
        return ops

    def flush(self) -> int:
        """Flush the session table as the daemon does (a new ``conn_gen``); returns the
        sessions of the old generation."""
        n = self.maps.flush_conns()
        self.config = self.maps.snapshot().config
        return n

    def table_bytes(self) -> bytes:
        """Every byte of lb_conns, as the program sees it (a mapping of our own)."""
        m = self.obj.map("lb_conns")
        with mmap.mmap(m.fd, m.max_entries * m.value_size, mmap.MAP_SHARED) as mm:
            return bytes(mm)

    # -- running and reading -------------------------------------------------------------

    def run(self, frame: bytes) -> TestRunResult:
        return run_lb(self.obj, frame, self.ns.lb_ifindex)

    def counters(self) -> Counters:
        ev, dr = self.obj.map("lb_events"), self.obj.map("lb_drops")
        vs, bs = self.obj.map("lb_vip_stats"), self.obj.map("lb_be_stats")
        return Counters(
            {e: _sum_u64(ev, e) for e in abi.Event},
            {d: _sum_u64(dr, d) for d in abi.DropReason},
            {v: _sum_stats(vs, v) for v in fx.VIP_BY_ID},
            {b: _sum_stats(bs, b) for b in fx.BACKENDS},
        )

    def conn(self, frame: bytes) -> Entry | None:
        """The session of a frame's flow as lb_xdp's lookup finds it (live or not)."""
        return self.conns.get(key_of(frame), self.config.seed)

    def set_of(self, frame: bytes) -> int:
        """The session-table set of a frame's flow."""
        return hashing.sess_hash(key_of(frame), self.config.seed) & self.conns.mask

    @contextlib.contextmanager
    def holding(self, set_index: int) -> Iterator[None]:
        """Hold a set's claim from user space while the block runs, as a writer in the
        middle of its write would: seq made odd, then even again (+2) afterwards.

        Test-only: plain stores through a mapping of our own, no compare-and-swap, so
        only while no program runs on the set concurrently (single-threaded test_run).
        Real writers claim with sessions.c's atomics (ConnTable.import_sessions)."""
        off = set_index * ctypes.sizeof(abi.ConnSet)
        m = self.obj.map("lb_conns")
        with mmap.mmap(m.fd, m.max_entries * m.value_size, mmap.MAP_SHARED) as mm:
            (seq,) = struct.unpack_from("<Q", mm, off)
            assert seq % 2 == 0, f"set {set_index} is held already (seq {seq})"
            struct.pack_into("<Q", mm, off, seq + 1)
            try:
                yield
            finally:
                struct.pack_into("<Q", mm, off, seq + 2)

    def seq(self, set_index: int) -> int:
        """A set's claim word (``xdplb_conn_meta.seq``), read through the map."""
        raw = self.obj.map("lb_conns").lookup(_u32(set_index))
        assert raw is not None
        return int(abi.ConnSet.from_buffer_copy(raw).meta.seq)


def key_of(frame: bytes) -> bytes:
    """The flow key (``struct xdplb_flow_key``) of a frame's inner packet."""
    src, dst, sport, dport, proto, _ = fx.flow_of(frame)
    return abi.FlowKey.make(src, dst, sport, dport, proto).pack()


def _table_members(
    first: Iterable[int], rest: Iterable[tuple[int, ...]] = ()
) -> dict[int, abi.MemberState]:
    """Every backend a table names, ACTIVE (the planner's members of a VIP whose backends
    all have a weight)."""
    ids = {*first, *(h for r in rest for h in r)}
    return {b: abi.MemberState.ACTIVE for b in sorted(ids) if b}
