"""Map operations: what the planner (:mod:`xdplb.control.planner`) returns and the
datapath layer (:meth:`xdplb.datapath.lb.LbDatapath.apply`) applies, in the order given.

Plain values, so that the kernel layer depends on this vocabulary and not on the planner.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from xdplb.core import abi
from xdplb.core.acl import AclKey
from xdplb.core.addresses import IPAddress
from xdplb.core.state import BackendState, LbConfig, LookupTable, Vip, VipAddrInfo, VipParams


@dataclass(frozen=True)
class SetConfig:
    config: LbConfig


@dataclass(frozen=True)
class PutBackend:
    backend_id: int
    backend: BackendState


@dataclass(frozen=True, eq=True)
class PutTable:
    """Fill a new inner map and swap it in at ``vip_id`` (never an in-place rewrite), in
    the outer map of ``kind``: ``lb_tables`` (Maglev) or ``lb_btables`` (Beamer)."""

    vip_id: int
    table: LookupTable
    kind: abi.TableKind


@dataclass(frozen=True)
class PutVipAddr:
    address: IPAddress
    info: VipAddrInfo


@dataclass(frozen=True)
class PutVip:
    vip: Vip
    params: VipParams


@dataclass(frozen=True)
class DeleteVip:
    vip: Vip


@dataclass(frozen=True)
class DeleteVipAddr:
    address: IPAddress


@dataclass(frozen=True)
class DeleteTable:
    """Remove ``vip_id``'s table from whichever outer map holds it (both are cleared: a
    snapshot does not say which, and a table no VIP names has no kind to ask)."""

    vip_id: int


@dataclass(frozen=True)
class PutAcl:
    """Add or change one source ACL rule (``lb_acl4`` / ``lb_acl6``)."""

    key: AclKey
    action: abi.AclList


@dataclass(frozen=True)
class DeleteAcl:
    key: AclKey


@dataclass(frozen=True)
class DeleteBackend:
    """Mark the slot inactive: no table or later hop names it any more; its TCP
    sessions still reach its address until the slot is given to another."""

    backend_id: int


@dataclass(frozen=True)
class PutMembers:
    """Replace a VIP's member states (``lb_members``) as a whole: backend id -> state,
    every id not named NONE."""

    vip_id: int
    states: Mapping[int, abi.MemberState]


@dataclass(frozen=True)
class DeleteMembers:
    vip_id: int


@dataclass(frozen=True)
class SetVipFilter:
    """``lb_vip_filter``: exactly these bits set (every VIP address's, and during a plan
    the old ones' too)."""

    bits: frozenset[int]


Op = (
    SetConfig
    | PutBackend
    | PutTable
    | PutVipAddr
    | PutVip
    | DeleteVip
    | DeleteVipAddr
    | DeleteTable
    | DeleteBackend
    | PutAcl
    | DeleteAcl
    | PutMembers
    | DeleteMembers
    | SetVipFilter
)
