"""The model's input: the 5-tuple :class:`Flow` and its key bytes, and
:class:`DataplaneState`, everything lb_xdp reads from its maps as plain values (the
map types themselves are :mod:`xdplb.core.state`'s); :func:`state_from_snapshot`
takes it from the real maps.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from xdplb.core import abi, hashing
from xdplb.core.acl import AclIndex, AclKey
from xdplb.core.addresses import IPAddress, IPNetwork
from xdplb.core.state import (
    BackendState,
    ConnEntry,
    LbConfig,
    LookupTable,
    Snapshot,
    Vip,
    VipAddrInfo,
    VipParams,
    vip_addr_infos,
)


@dataclass(frozen=True)
class Flow:
    """A 5-tuple as lb_xdp sees it; ports in host order."""

    src: IPAddress
    dst: IPAddress
    sport: int
    dport: int
    proto: int

    def __post_init__(self) -> None:
        if self.src.version != self.dst.version:
            raise ValueError(f"mixed families: {self.src} -> {self.dst}")

    def key(self) -> bytes:
        """The 40 bytes of ``struct xdplb_flow_key`` (the ``lb_conns`` key)."""
        return flow_key(self.src.packed, self.dst.packed, self.sport, self.dport, self.proto)

    def hash_key(self, src_only: bool = False) -> bytes:
        """The bytes that are hashed: the key, or with ``VIP_F_SRC_HASH`` the source only."""
        if src_only:
            return self.src.packed.ljust(hashing.FLOW_KEY_SIZE, b"\0")
        return self.key()


def flow_key(src: bytes, dst: bytes, sport: int, dport: int, proto: int) -> bytes:
    """``struct xdplb_flow_key`` from raw addresses (4 or 16 bytes), every other byte 0."""
    return src.ljust(16, b"\0") + dst.ljust(16, b"\0") + struct.pack("!HHB3x", sport, dport, proto)


def _addr_key(addr: IPAddress) -> tuple[int, bytes]:
    return (addr.version, addr.packed)


@dataclass(frozen=True)
class DataplaneState:
    """Everything lb_xdp reads from its maps, as plain values.

    ``conns`` is read, never written, by :func:`decide`: a decision reports the entry
    it would insert (:attr:`Decision.conn_insert`) and the caller applies it (see
    :func:`apply`), so one state can answer many "what if" questions.
    """

    #: ``lb_vips``.
    vips: Mapping[Vip, VipParams]
    #: ``lb_backends``: id -> slot; ids absent here are empty (all-zero) slots.
    backends: Mapping[int, BackendState]
    #: ``lb_tables`` and ``lb_btables`` (by the VIP's kind): vip id -> inner table; a VIP
    #: without one drops ``NO_TABLE``.
    tables: Mapping[int, LookupTable]
    #: ``lb_config[0]``.
    config: LbConfig
    #: ``lb_conns``: flow key bytes (:meth:`Flow.key`) -> entry.
    conns: Mapping[bytes, ConnEntry] = field(default_factory=dict)
    #: ``lb_vip_addrs``; None means what the control plane keeps it at for ``vips``
    #: without options (``state.vip_addr_infos``: fragments to the port-0 or only VIP,
    #: no echo).  A set of addresses means those addresses with the default infos of
    #: the VIPs on them.  Give it explicitly to model options or a map out of step.
    vip_addrs: Mapping[IPAddress, VipAddrInfo] | frozenset[IPAddress] | None = None
    #: ``lb_backends``' max_entries (``limits.backends``): an id at or beyond it has no
    #: slot, as ``bpf_map_lookup_elem`` on an array finds none.
    max_backends: int = abi.MAX_BACKENDS
    #: ``lb_acl4`` and ``lb_acl6``: every scope's rules (steps 5a, 6a).
    acl: Mapping[AclKey, abi.AclList] = field(default_factory=dict)
    #: Step 8a: the source prefixes (as ``acl.rate_key`` masks them) whose token bucket
    #: is empty now; the caller keeps the clock and the buckets.
    rate_limited: frozenset[IPNetwork] = frozenset()
    #: Step 9: this CPU's connection-table insert budget for the window is used up
    #: (matters only while ``config.flood_max`` is not 0).
    over_budget: bool = False
    #: ``lb_members``: vip id -> backend id -> its state in the VIP (absent: NONE).
    members: Mapping[int, Mapping[int, abi.MemberState]] = field(default_factory=dict)
    #: The session clock now (jiffies as a ``__u32``); None: no session is idle.
    now: int | None = None
    #: ``lb_vip_filter``: the bits set (``hashing.addr_filter_bit``); None: what the
    #: planner keeps it at, the bits of every VIP's address.
    vip_filter: frozenset[int] | None = None

    # Indexes by raw bytes, built once: decide() runs per packet, hundreds of
    # thousands of times in the tests.  cached_property writes to __dict__, which
    # a frozen dataclass allows.
    @cached_property
    def vip_index(self) -> dict[tuple[int, bytes, int, int], tuple[Vip, VipParams]]:
        """``lb_vips`` by (family, raw address, port, proto): exact entries only."""
        return {(*_addr_key(v.addr), v.port, v.proto): (v, p) for v, p in self.vips.items()}

    @cached_property
    def vip_filter_bits(self) -> frozenset[int]:
        """The bits of ``lb_vip_filter`` set: :attr:`vip_filter`, or its default."""
        if self.vip_filter is not None:
            return self.vip_filter
        return frozenset(hashing.addr_filter_bit(v.addr.packed) for v in self.vips)

    def maybe_vip_addr(self, addr: bytes) -> bool:
        """Step 2': the address's ``lb_vip_filter`` bit is set (raw 4 or 16 bytes); clear
        means no VIP has it."""
        return hashing.addr_filter_bit(addr) in self.vip_filter_bits

    @cached_property
    def acl_index(self) -> AclIndex:
        return AclIndex(self.acl)

    @cached_property
    def _vip_addr_index(self) -> dict[tuple[int, bytes], VipAddrInfo]:
        infos: Mapping[IPAddress, VipAddrInfo]
        if isinstance(self.vip_addrs, Mapping):
            infos = self.vip_addrs
        else:
            derived = vip_addr_infos(self.vips)
            addrs = derived.keys() if self.vip_addrs is None else self.vip_addrs
            infos = {a: derived.get(a, VipAddrInfo(0)) for a in addrs}
        return {_addr_key(a): info for a, info in infos.items()}

    def backend_usable(self, backend_id: int) -> bool:
        """A backend the program may send to: id ≠ 0, in range, slot active."""
        if backend_id == 0 or backend_id >= self.max_backends:
            return False
        slot = self.backends.get(backend_id)
        return slot is not None and slot.active

    def member_state(self, vip_id: int, backend_id: int) -> abi.MemberState:
        """``lb_members[vip_id]``'s state of a backend (NONE if it names none)."""
        return self.members.get(vip_id, {}).get(backend_id, abi.MemberState.NONE)

    def slot_holds(self, backend_id: int, be_gen: int) -> bool:
        """The slot a session names still holds the address it was recorded for: in
        range, ever used, of the same gen (active or not: a TCP session outlives its
        backend's leaving)."""
        if backend_id == 0 or backend_id >= self.max_backends:
            return False
        slot = self.backends.get(backend_id)
        return slot is not None and slot.gen == be_gen

    def find_vip(self, dst: IPAddress, dport: int, proto: int) -> tuple[Vip, VipParams] | None:
        """Step 6: the exact ``(dst, dport, proto)`` entry, else the port-0 wildcard."""
        return self.find_vip_raw(dst.version, dst.packed, dport, proto)

    def find_vip_raw(
        self, version: int, dst: bytes, dport: int, proto: int
    ) -> tuple[Vip, VipParams] | None:
        """:meth:`find_vip` of a raw address (4 or 16 bytes), as a packet carries it."""
        index = self.vip_index
        hit = index.get((version, dst, dport, proto))
        if hit is None:
            hit = index.get((version, dst, 0, proto))
        return hit

    def is_vip_addr(self, version: int, addr: bytes) -> bool:
        """``lb_vip_addrs`` membership (steps 4 and 5, where the port is unknown)."""
        return (version, addr) in self._vip_addr_index

    def vip_addr_info(self, version: int, addr: bytes) -> VipAddrInfo | None:
        """``lb_vip_addrs[addr]``, or None."""
        return self._vip_addr_index.get((version, addr))


def state_from_snapshot(
    snap: Snapshot, conns: Mapping[bytes, ConnEntry] | None = None
) -> DataplaneState:
    """The model's input from a snapshot of the real maps (``LbMaps.snapshot()``)."""
    return DataplaneState(
        snap.vips,
        snap.backends,
        snap.tables,
        snap.config,
        dict(conns or {}),
        dict(snap.vip_addrs),
        acl=dict(snap.acl),
        members={k: dict(v) for k, v in snap.members.items()},
        vip_filter=snap.vip_filter,
    )
