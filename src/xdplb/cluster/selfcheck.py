"""The node's self-check (docs/cluster.md, "Announcing"): is this node's data plane
able to serve what it would announce? Run every ``bgp.self_check_interval``; any
failure withdraws every VIP.

Checked, each interface the configuration names: the balancer's link is attached there
and runs the loaded program (the link's own info: a link detached behind our back reads
ifindex 0), and the interface is up with a carrier. Then the maps answer a lookup, and
a probe packet to every VIP, run through each attached program, does what the tables
the control plane wrote say (:mod:`xdplb.cluster.probe`).
"""

from __future__ import annotations

import fcntl
import socket
import struct
from typing import TYPE_CHECKING

from xdplb.cluster.probe import probe_all
from xdplb.core import abi
from xdplb.core.errors import XdplbError
from xdplb.datapath.hooks import Hook
from xdplb.datapath.links import Link

if TYPE_CHECKING:
    from xdplb.control.runtime import Runtime

_ZERO = struct.pack("<I", 0)
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_IFF_UP, _IFF_RUNNING = 0x1, 0x40


def interface_flags(ifname: str) -> int:
    """The interface's flags (SIOCGIFFLAGS, in the calling thread's namespace); OSError."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", ifname.encode(), 0)
        return int(struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1])


def set_interface_down(ifname: str) -> None:
    """Clear the interface's IFF_UP (SIOCSIFFLAGS, CAP_NET_ADMIN); OSError."""
    flags = interface_flags(ifname)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", ifname.encode(), flags & ~_IFF_UP & 0xFFFF)
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, req)


def _attached(rt: Runtime, ifname: str, hook: Hook) -> str | None:
    try:
        ifindex = socket.if_nametoindex(ifname)
        flags = interface_flags(ifname)
    except OSError as e:
        return f"{ifname}: {e.strerror or e}"
    if not flags & _IFF_UP:
        return f"{ifname} is down"
    if not flags & _IFF_RUNNING:
        return f"{ifname} has no carrier"
    try:
        with Link.from_pinned(rt.dp.link_path(ifname, hook)) as link:
            where, prog = link.xdp_ifindex, link.prog_id
    except XdplbError as e:
        return f"{ifname}: no {hook} link ({e})"
    if where != ifindex:
        return f"{ifname}: the {hook} link was detached"
    if prog != rt.dp.hook_program(hook).id:
        return f"{ifname}: the {hook} link runs program {prog}, not ours"
    return None


def self_check(rt: Runtime) -> str | None:
    """None when the node can serve; else what is wrong, in one line."""
    attached = rt.dp.attached()
    for iface in rt.running.interfaces:
        hook = attached.get(iface.name)
        if hook is None:
            return f"{iface.name}: the balancer is not attached"
        if (why := _attached(rt, iface.name, hook)) is not None:
            return why
    try:
        raw = rt.dp["lb_config"].lookup(_ZERO)
        assert raw is not None  # an array's one entry
        key = abi.Config.from_buffer_copy(raw).probe_key or rt.dp.probe_key()
    except (OSError, XdplbError) as e:
        return f"maps unreachable: {e}"
    if rt.applied is None:
        return "no configuration applied yet"
    # One probe round per program: interfaces at the same hook run the same one.
    probed: set[Hook] = set()
    for iface in rt.running.interfaces:
        hook = attached[iface.name]
        if hook in probed:
            continue
        probed.add(hook)
        why = probe_all(rt.dp.hook_program(hook), hook, rt.applied, key, iface.name)
        if why is not None:
            return why
    return None
