"""The model's answer: :class:`Decision`, what lb_xdp does with one frame up to
the FIB lookup, with its :class:`Outcome` and the program's :class:`XdpAction`; and
the decisions of the steps that end a frame's way early (a pass, a drop).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from xdplb.core import abi
from xdplb.core.state import ConnEntry, Vip, VipParams
from xdplb.model.state import Flow


class XdpAction(enum.IntEnum):
    """The program's return value (``enum xdp_action`` of the kernel UAPI)."""

    ABORTED = 0
    DROP = 1
    PASS = 2
    TX = 3
    REDIRECT = 4


class Outcome(enum.Enum):
    """What the model can decide without the kernel's FIB."""

    #: ``XDP_DROP``; :attr:`Decision.drop` says why.
    DROP = "drop"
    #: ``XDP_PASS`` of the frame untouched; :attr:`Decision.events` says why.
    PASS = "pass"
    #: Encapsulated to :attr:`Decision.backend_id`.  The program then returns
    #: ``XDP_TX`` / ``XDP_REDIRECT`` / ``XDP_PASS`` (no neighbour yet) or drops with
    #: reason ``FIB``, by ``bpf_fib_lookup`` (step 12), which the model cannot know.
    FORWARD = "forward"
    #: Answered in place and sent back out (``XDP_TX``): an echo reply (step 4c);
    #: :attr:`Decision.packet` is the whole frame, Ethernet header included.
    REPLY = "reply"


@dataclass(frozen=True)
class Decision:
    """What lb_xdp does with one frame, up to (not including) the FIB lookup."""

    outcome: Outcome
    #: Events counted in ``lb_events``, in order.  For FORWARD this stops before
    #: step 12's TX / REDIRECT / FIB_PASS, which depends on the FIB.
    events: tuple[abi.Event, ...] = ()
    #: The ``lb_drops`` index counted, for DROP.
    drop: abi.DropReason | None = None
    #: The parsed 5-tuple, from step 7 on.
    flow: Flow | None = None
    #: The VIP matched in step 6 and its value.
    vip: Vip | None = None
    vip_params: VipParams | None = None
    #: The flow hash used (stored one on a connection-table hit).
    flow_hash: int | None = None
    #: The table bucket, when the table was consulted.
    bucket: int | None = None
    #: The chosen backend (first hop = outer destination).
    backend_id: int | None = None
    #: Every hop written into the GUE hop list, first hop first.
    hops: tuple[int, ...] = ()
    #: ``0x8000 | (hash & 0x7fff)``: the GUE (outer UDP) source port.
    gue_sport: int | None = None
    #: FORWARD: the frame from the outer IP header to its end (outer IP [+ UDP + GUE] +
    #: the original IP packet + any trailing bytes the frame had).  The Ethernet header
    #: in front of it is the FIB's (step 12).
    packet: bytes | None = None
    #: The entry inserted into ``lb_conns`` (key, value), on a table lookup that chose
    #: a backend (also when a later step drops the packet).
    conn_insert: tuple[bytes, ConnEntry] | None = None
    #: The flow's session after a hit moved it on (key, value): ``last_seen`` refreshed
    #: to the state's clock and the TCP state advanced (a SYN's session becomes
    #: established, a FIN or RST closes it), as lb_sess_touch / lb_sess_set_state write
    #: them; None when a hit changes neither.
    conn_update: tuple[bytes, ConnEntry] | None = None
    #: Inner IP length, added to ``bytes`` of the VIP's and the backend's stats (step
    #: 10) whenever a backend was chosen; None when no stats move.
    stats_bytes: int | None = None
    #: The ACL hit counted (``lb_acl_hits``): (scope, list); the scope is a vip id or
    #: ``abi.ACL_GLOBAL``.  Several scopes may count (global allow, then the VIP's).
    acl_hits: tuple[tuple[int, abi.AclList], ...] = ()

    @property
    def new_flow(self) -> bool:
        """Whether ``new_flows`` of the VIP and backend stats moves: the flow was
        balanced by the table (recorded or not)."""
        return abi.Event.CONN_MISS in self.events

    def allows(self, action: int) -> bool:
        """Whether the program's return value is consistent with this decision.

        FORWARD admits every step-12 outcome (including a FIB drop); callers that
        know the FIB should check the exact action themselves.
        """
        if self.outcome is Outcome.DROP:
            return action == XdpAction.DROP
        if self.outcome is Outcome.PASS:
            return action == XdpAction.PASS
        if self.outcome is Outcome.REPLY:
            return action == XdpAction.TX
        return action in (XdpAction.TX, XdpAction.REDIRECT, XdpAction.PASS, XdpAction.DROP)

    def describe(self) -> str:
        """One line for test failures."""
        parts = [self.outcome.value]
        if self.drop is not None:
            parts.append(f"drop={self.drop.name}")
        if self.events:
            parts.append("events=" + ",".join(e.name for e in self.events))
        if self.flow is not None:
            f = self.flow
            parts.append(f"flow={f.src}:{f.sport}->{f.dst}:{f.dport}/{f.proto}")
        if self.backend_id is not None:
            parts.append(f"backend={self.backend_id} hops={list(self.hops)}")
        if self.flow_hash is not None:
            parts.append(f"hash={self.flow_hash:#010x}")
        return " ".join(parts)


def _pass(event: abi.Event) -> Decision:
    return Decision(Outcome.PASS, events=(event,))


def dropped(reason: abi.DropReason) -> Decision:
    """A drop that carries only its reason (no flow, VIP or events)."""
    return Decision(Outcome.DROP, drop=reason)


PASS_NOT_IP = _pass(abi.Event.PASS_NOT_IP)
PASS_MALFORMED = _pass(abi.Event.PASS_MALFORMED)
PASS_NOT_VIP = _pass(abi.Event.PASS_NOT_VIP)


def table_drop(
    drop: abi.DropReason,
    events: tuple[abi.Event, ...],
    flow: Flow,
    vip: Vip,
    params: VipParams,
    flow_hash: int | None,
    bucket: int | None,
    acl_hits: tuple[tuple[int, abi.AclList], ...],
) -> Decision:
    """A VIP packet the table could not place (no table, an empty or missing bucket, a
    backend slot not in use): dropped with what the steps up to the table saw."""
    return Decision(
        Outcome.DROP,
        events=events,
        drop=drop,
        flow=flow,
        vip=vip,
        vip_params=params,
        flow_hash=flow_hash,
        bucket=bucket,
        acl_hits=acl_hits,
    )
