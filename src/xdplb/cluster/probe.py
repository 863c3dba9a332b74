"""The self-check's probe (docs/cluster.md, "Announcing"): a synthetic packet to each
VIP through the attached program itself, by BPF_PROG_TEST_RUN, compared with what the
model says the maps the control plane wrote should do with it.

The packet carries ``lb_config.probe_key`` (in XDP metadata for lb_xdp, in the skb's
mark for lb_tc), so the program takes steps 6 and 9 only: the VIP, its table, the
backend and the encapsulation, with nothing recorded (no session, no counter, no ACL,
no rate limit). Nothing is sent: a test run only reports its verdict and the packet as
it would leave.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from xdplb.control.status import vip_name
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import XdplbError
from xdplb.core.state import Snapshot, Vip
from xdplb.datapath.hooks import Hook
from xdplb.datapath.programs import Program
from xdplb.model import frames
from xdplb.model.predict import predict_backend
from xdplb.model.state import Flow, state_from_snapshot

#: The probe's source: documentation addresses (RFC 5737, RFC 3849), never a client's.
PROBE_SRC = {4: ipaddress.ip_address("192.0.2.1"), 6: ipaddress.ip_address("2001:db8::1")}
PROBE_SPORT = 40000
#: The port a wildcard (port 0) VIP is probed on.
WILDCARD_PORT = 80

#: The verdicts that let the frame go on: sent (TX, redirect) or handed to the kernel,
#: which routes what the program encapsulated when the next hop is not resolved yet.
_XDP_ON = (2, 3, 4)  # XDP_PASS, XDP_TX, XDP_REDIRECT
_TC_ON = (0, 7, 0xFFFFFFFF)  # TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_UNSPEC
_ETH_LEN = 14


@dataclass(frozen=True)
class Probe:
    """One VIP's probe: the packet and the backend address it must leave for (None: the
    maps say it is dropped, e.g. a VIP with no backend)."""

    vip: Vip
    frame: bytes
    expect: IPAddress | None


def probes(snap: Snapshot, vips: Iterable[Vip]) -> list[Probe]:
    """The probes of ``vips`` against ``snap``, the maps as the control plane wrote them."""
    state = state_from_snapshot(snap)
    out = []
    for vip in vips:
        flow = Flow(
            PROBE_SRC[vip.addr.version], vip.addr, PROBE_SPORT, vip.port or WILDCARD_PORT, vip.proto
        )
        be_id = predict_backend(state, flow)
        be = snap.backends.get(be_id) if be_id is not None else None
        out.append(Probe(vip, frames.frame(flow), be.addr if be is not None else None))
    return out


def outer_destination(frame: bytes) -> IPAddress | None:
    """The destination of a frame's (outer) IP header, or None if it has none."""
    if len(frame) < _ETH_LEN:
        return None
    (ethertype,) = struct.unpack_from("!H", frame, 12)
    if ethertype == 0x0800 and len(frame) >= _ETH_LEN + 20:
        return ipaddress.IPv4Address(frame[_ETH_LEN + 16 : _ETH_LEN + 20])
    if ethertype == 0x86DD and len(frame) >= _ETH_LEN + 40:
        return ipaddress.IPv6Address(frame[_ETH_LEN + 24 : _ETH_LEN + 40])
    return None


def run_probe(prog: Program, hook: Hook, probe: Probe, key: int, ifindex: int) -> str | None:
    """``probe`` through ``prog`` (the program attached at ``hook`` to ``ifindex``): None
    when it did what the maps say, else what it did instead. A frame that goes on must
    be encapsulated to the backend (a pass of the frame as it came is not a forward)."""
    from xdplb.datapath.testrun import skb_ctx

    try:
        if hook is Hook.TC:
            ctx = skb_ctx(mark=key, ifindex=ifindex, ingress_ifindex=ifindex)
            res = prog.test_run(probe.frame, ctx=ctx)
            forwarded = res.retval in _TC_ON
        else:
            meta = struct.pack("<I", key)
            res = prog.test_run(probe.frame, ingress_ifindex=ifindex, meta=meta)
            forwarded = res.retval in _XDP_ON
    except (OSError, XdplbError) as e:
        return f"probe of {_name(probe.vip)} did not run: {e}"
    got = outer_destination(res.data) if forwarded else None
    if got == probe.expect:
        return None
    want = f"to {probe.expect}" if probe.expect is not None else "dropped"
    did = f"to {got}" if got is not None else f"verdict {res.retval}"
    return f"probe of {_name(probe.vip)}: {did}, the tables say {want}"


def _name(vip: Vip) -> str:
    return vip_name(vip.addr, vip.port, {6: "tcp", 17: "udp"}.get(vip.proto, str(vip.proto)))


def probe_all(prog: Program, hook: Hook, snap: Snapshot, key: int, ifname: str) -> str | None:
    """Every VIP of ``snap`` probed through ``prog``; the first failure, or None."""
    ifindex = socket.if_nametoindex(ifname)
    for probe in probes(snap, snap.vips):
        if (why := run_probe(prog, hook, probe, key, ifindex)) is not None:
            return why
    return None
