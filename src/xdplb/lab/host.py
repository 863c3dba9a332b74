"""host_tc on a lab backend: load, attach at TC ingress of eth0, configure."""

from __future__ import annotations

import dataclasses
import socket

from xdplb.core import abi
from xdplb.core.errors import LabError
from xdplb.datapath.host import HostDatapath, detach_filters
from xdplb.lab.topology import IFNAME, Lab


@dataclasses.dataclass
class HostAttachment:
    """host_tc loaded for one backend and attached to its eth0."""

    #: Node name (``b1`` ...).
    backend: str
    #: ifindex of eth0 inside the backend's namespace.
    ifindex: int
    dp: HostDatapath

    def events(self) -> dict[abi.HostEvent, int]:
        """host_events summed over CPUs."""
        return self.dp.events()


def attach_host(lab: Lab, backend_name: str, gue_port: int = abi.GUE_PORT) -> HostAttachment:
    """What a backend host needs, done for a lab backend: host_tc loaded with its pins under
    ``/sys/fs/bpf/xdplb/<lab prefix>-<backend>`` (removed at teardown), configured with the
    backend's IPv4 and IPv6 addresses, attached at TC ingress of its eth0."""
    if backend_name not in lab.backends:
        raise LabError(f"{backend_name!r} is not a backend of this lab: {lab.backends}")
    lab.pin_root(backend_name)  # registered: the lab removes it at teardown
    dp = HostDatapath(f"{lab.prefix}-{backend_name}")
    lab.on_teardown(dp.close)
    dp.configure([lab.addr(backend_name, 4), lab.addr(backend_name, 6)], gue_port)
    with lab.enter(backend_name):
        ifindex = socket.if_nametoindex(IFNAME)
        dp.attach(ifindex)

    def detach() -> None:
        # The namespace's deletion removes the filter anyway; detach first so that a
        # lab kept alive (demo) does not run a program whose object is closed.
        with lab.enter(backend_name):
            detach_filters(ifindex)

    lab.on_teardown(detach)
    att = HostAttachment(backend_name, ifindex, dp)
    lab.hosts[backend_name] = att
    return att
