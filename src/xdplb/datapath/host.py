"""host_tc for one backend host: loaded with its maps pinned per instance, attached at TC
ingress, configured with the host's tunnel addresses.

A TC filter holds its program, and the program its maps, so the attachment outlives the
process that made it; attaching again swaps the program in place (the filter is
replaced) and reuses the pinned maps.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
from collections.abc import Iterable
from pathlib import Path

from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress
from xdplb.datapath.links import tc_attach, tc_detach
from xdplb.datapath.maps import Map
from xdplb.datapath.objects import BpfObject

_ZERO = struct.pack("<I", 0)
_ONE = struct.pack("<I", 1)
MAP_NAMES = ("host_config", "host_addrs", "host_events")
#: lo's ifindex, in every network namespace.
LOOPBACK_IFINDEX = 1


def host_events(maps: dict[str, Map]) -> dict[abi.HostEvent, int]:
    """host_events summed over CPUs."""
    events = maps["host_events"]
    return {
        ev: sum(struct.unpack("<Q", v[:8])[0] for v in events.lookup_percpu(struct.pack("<I", ev)))
        for ev in abi.HostEvent
    }


def events_from_pins(instance: str) -> dict[abi.HostEvent, int]:
    """The counters of a host instance that some other process attached."""
    path = paths.pin_root(instance) / "host_events"
    if not path.exists():
        raise FileNotFoundError(f"{path.parent}: no pinned host_events: is host_tc attached?")
    with Map.from_pinned(path) as m:
        return host_events({"host_events": m})


class HostDatapath:
    """host_tc loaded for an instance (pins under /sys/fs/bpf/xdplb/<instance>)."""

    def __init__(self, instance: str, obj_path: Path | None = None) -> None:
        self.instance = instance
        self.pin_root = paths.pin_root(instance)
        self.pin_root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.pin_root, 0o700)  # pins are root's business only
        self.obj = BpfObject.load(obj_path or paths.bpf_object("host_tc"), pin_root=self.pin_root)
        self.maps = {n: self.obj.map(n) for n in MAP_NAMES}

    def configure(self, addrs: Iterable[IPAddress], gue_port: int = abi.GUE_PORT) -> None:
        """The GUE port, and exactly ``addrs`` as the addresses tunnels may target."""
        cfg = abi.HostConfig(gue_port=socket.htons(gue_port))
        self.maps["host_config"].update(_ZERO, cfg.pack())
        table = self.maps["host_addrs"]
        wanted = {abi.Addr.make(a).pack() for a in addrs}
        for key in wanted:
            table.update(key, _ONE)
        for key in list(table.keys()):
            if key not in wanted:
                table.delete(key)

    def attach(self, ifindex: int) -> None:
        """Attach at TC ingress of ``ifindex`` and of lo (in the calling thread's
        namespace), replacing whatever host_tc ran there. On lo it decapsulates the
        datagrams of a GUE packet of UDP GSO, which it sends there for the kernel to
        segment (docs/datapath.md, "host_tc")."""
        prog = self.obj.program("host_tc")
        tc_attach(prog, ifindex, ingress=True)
        if ifindex != LOOPBACK_IFINDEX:
            tc_attach(prog, LOOPBACK_IFINDEX, ingress=True)

    def events(self) -> dict[abi.HostEvent, int]:
        return host_events(self.maps)

    def close(self) -> None:
        self.obj.close()


def detach_filters(ifindex: int) -> None:
    """Take host_tc off ``ifindex`` and off lo (in the calling thread's namespace)."""
    tc_detach(ifindex, ingress=True)
    if ifindex != LOOPBACK_IFINDEX:
        tc_detach(LOOPBACK_IFINDEX, ingress=True)


def detach(instance: str, ifindex: int) -> None:
    """Take host_tc off ``ifindex`` (and lo) and remove the instance's pins."""
    detach_filters(ifindex)
    shutil.rmtree(paths.pin_root(instance), ignore_errors=True)
