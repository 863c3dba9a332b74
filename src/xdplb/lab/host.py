"""host_tc on a lab backend: load, attach at TC ingress of eth0, configure."""

from __future__ import annotations

import dataclasses
import shutil
import socket
from pathlib import Path

from xdplb import abi, paths
from xdplb.datapath import BpfObject, Program, tc_attach, tc_detach
from xdplb.datapath.maps import Map
from xdplb.errors import LabError
from xdplb.lab.topology import IFNAME, Lab

_ZERO = (0).to_bytes(4, "little")
_ONE = (1).to_bytes(4, "little")


@dataclasses.dataclass
class HostAttachment:
    """host_tc loaded for one backend and attached to its eth0."""

    #: Node name (``b1`` ...).
    backend: str
    #: ifindex of eth0 inside the backend's namespace.
    ifindex: int
    #: Where host_config, host_addrs and host_events are pinned.
    pin_root: Path
    obj: BpfObject

    @property
    def prog(self) -> Program:
        return self.obj.program("host_tc")

    def map(self, name: str) -> Map:
        return self.obj.map(name)

    def events(self) -> dict[abi.HostEvent, int]:
        """host_events summed over CPUs."""
        events = self.obj.map("host_events")
        out: dict[abi.HostEvent, int] = {}
        for ev in abi.HostEvent:
            per_cpu = events.lookup_percpu(ev.value.to_bytes(4, "little"))
            out[ev] = sum(int.from_bytes(v[:8], "little") for v in per_cpu)
        return out


def configure_host(
    obj: BpfObject, addrs: list[abi.IPAddress], gue_port: int = abi.GUE_PORT
) -> None:
    """Fill host_config and host_addrs of a loaded host_tc object."""
    cfg = abi.HostConfig(gue_port=socket.htons(gue_port))
    obj.map("host_config").update(_ZERO, cfg.pack())
    for addr in addrs:
        obj.map("host_addrs").update(abi.Addr.make(addr).pack(), _ONE)


def attach_host(
    lab: Lab,
    backend_name: str,
    instance_pin_root: Path | None = None,
    gue_port: int = abi.GUE_PORT,
) -> HostAttachment:
    """Load build/host_tc.bpf.o for ``backend_name``, attach it direct-action at TC
    ingress of the backend's eth0, and fill host_config and host_addrs (the
    backend's IPv4 and IPv6 addresses).

    Maps are pinned under ``instance_pin_root`` (default
    ``/sys/fs/bpf/xdplb/<lab prefix>-<backend>``), which the lab removes at teardown.
    """
    if backend_name not in lab.backends:
        raise LabError(f"{backend_name!r} is not a backend of this lab: {lab.backends}")
    default_root = lab.pin_root(backend_name)
    root = Path(instance_pin_root) if instance_pin_root is not None else default_root
    if root != default_root:
        lab.on_teardown(lambda: _rmtree_quiet(root))
    obj = BpfObject.load(paths.bpf_object("host_tc"), pin_root=root)
    lab.on_teardown(obj.close)
    configure_host(obj, [lab.addr(backend_name, 4), lab.addr(backend_name, 6)], gue_port)
    with lab.enter(backend_name):
        ifindex = socket.if_nametoindex(IFNAME)
        tc_attach(obj.program("host_tc"), ifindex, ingress=True)

    def detach() -> None:
        # The namespace's deletion removes the filter anyway; detach first so that a
        # lab kept alive (demo) does not run a program whose object is closed.
        with lab.enter(backend_name):
            tc_detach(ifindex, ingress=True)

    lab.on_teardown(detach)
    att = HostAttachment(backend_name, ifindex, root, obj)
    lab.hosts[backend_name] = att
    return att


def _rmtree_quiet(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
