"""Which hook runs the balancer on an interface: lb_xdp at XDP, or lb_tc at TC ingress.

XDP is the right hook on a physical NIC: it runs before the kernel builds an skb. On veth
and other virtual devices it is the wrong one: a veth frame already is an skb, XDP copies
it out (losing the "checksum still to be completed" state of a CHECKSUM_PARTIAL packet,
which the backend then counts as a checksum error) and cannot take a 64 KB GSO packet at
all; lb_tc works on the skb itself and keeps both (docs/operations.md, "Which hook").

``auto`` picks XDP for a device on a bus (a NIC, virtio-net included: the driver reports
a bus address) and TC for every device without one (veth, bridge, vxlan, macvlan, tun,
loopback, ...).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import socket
import struct
from dataclasses import dataclass


class Hook(enum.StrEnum):
    """Where the balancer runs: the link name prefix of its pin, too (``links/<hook>_<if>``)."""

    XDP = "xdp"
    TC = "tc"

    @property
    def program(self) -> str:
        return "lb_xdp" if self is Hook.XDP else "lb_tc"


@dataclass(frozen=True)
class HookChoice:
    """The hook for one interface, and why (shown by ``xdplb status``)."""

    ifname: str
    hook: Hook
    why: str


#: SIOCETHTOOL and ETHTOOL_GDRVINFO (linux/sockios.h, linux/ethtool.h).
_SIOCETHTOOL, _ETHTOOL_GDRVINFO = 0x8946, 0x3
#: struct ethtool_drvinfo: cmd, then driver[32], version[32], fw_version[32],
#: bus_info[32], ... (196 bytes in all).
_DRVINFO_SIZE, _DRIVER, _BUS_INFO = 196, 4, 100


def driver_info(ifname: str) -> tuple[str, str]:
    """The interface's driver and bus address (``""`` for a virtual device), from the
    ethtool ioctl in this network namespace. OSError if there is no such interface;
    a device that answers no ethtool request (loopback) is ``("", "")``."""
    buf = ctypes.create_string_buffer(_DRVINFO_SIZE)
    struct.pack_into("<I", buf, 0, _ETHTOOL_GDRVINFO)
    ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(buf))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            fcntl.ioctl(s.fileno(), _SIOCETHTOOL, ifreq)
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:
                raise
            return "", ""

    def text(off: int) -> str:
        return buf.raw[off : off + 32].split(b"\0", 1)[0].decode(errors="replace")

    return text(_DRIVER), text(_BUS_INFO)


def choose(ifname: str, wanted: str) -> HookChoice:
    """The hook ``wanted`` (``xdp``, ``tc`` or ``auto``) means for ``ifname``."""
    if wanted != "auto":
        return HookChoice(ifname, Hook(wanted), "configured")
    driver, bus = driver_info(ifname)
    if bus:
        return HookChoice(ifname, Hook.XDP, f"auto: a NIC ({driver} at {bus})")
    return HookChoice(
        ifname,
        Hook.TC,
        f"auto: {driver or ifname} is a virtual device (XDP there would lose GSO "
        "and checksum offload)",
    )
