"""Steps 5a, 6a and 8a (bpf/lib/lb_acl.h): the source ACLs, global and per VIP,
and the per-source-prefix rate limit of new flows."""

from __future__ import annotations

from xdplb.core import abi
from xdplb.core.acl import rate_key
from xdplb.core.addresses import IPAddress
from xdplb.core.state import VipParams
from xdplb.model.decision import Decision, Outcome
from xdplb.model.parse import IPPROTO_TCP, Parsed
from xdplb.model.select import session
from xdplb.model.state import DataplaneState, Flow


def check_acl(
    state: DataplaneState,
    scope: int,
    src: IPAddress,
    p: Parsed,
    hits: tuple[tuple[int, abi.AclList], ...],
    params: VipParams | None = None,
) -> tuple[tuple[tuple[int, abi.AclList], ...], Decision | None]:
    """Steps 5a (``params`` None: the global scope, VIP addresses only) and 6a: the hits
    so far, and the drop when the scope denies the source.  A scope without rules (its
    flags clear) is not looked up at all."""
    if params is None:
        flags = state.config.flags
        on, deny = abi.CFG_F_ACL | abi.CFG_F_ACL_DENY, abi.CFG_F_ACL_DENY
        if not flags & on or not state.is_vip_addr(p.version, p.dst):
            return hits, None
    else:
        flags = params.flags
        on, deny = abi.VIP_F_ACL | abi.VIP_F_ACL_DENY, abi.VIP_F_ACL_DENY
        if not flags & on:
            return hits, None
    lst = state.acl_index.verdict(scope, src, bool(flags & deny))
    if lst is None:
        return hits, None
    hits = (*hits, (scope, lst))
    if lst is abi.AclList.ALLOW:
        return hits, None
    return hits, Decision(Outcome.DROP, drop=abi.DropReason.ACL, acl_hits=hits)


def rate_limited(
    state: DataplaneState, params: VipParams, key: bytes, flow: Flow, starts: bool
) -> tuple[abi.Event, ...] | None:
    """Step 8a: None when the packet goes on, else the events counted before its drop.
    Only a packet on its way to the table as a new flow (a TCP SYN, a UDP packet
    without a usable connection-table entry) draws from its prefix's bucket."""
    cfg = state.config
    if not cfg.rl_rate or not starts:
        return None
    events: tuple[abi.Event, ...] = ()
    if flow.proto != IPPROTO_TCP:
        events, conn, _ = session(state, params, key, flow.proto)
        if conn is not None:
            return None
    bucket = rate_key(flow.src, cfg.rl_prefix4, cfg.rl_prefix6)
    if cfg.rl_burst == 0 or bucket in state.rate_limited:
        return events
    return None
