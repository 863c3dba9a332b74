"""The daemon's socket-level balancing: sock_lb fed from the XDP tier's tables and health.

With a ``socket_lb`` section, the daemon loads sock_lb for its instance (maps and links
pinned under the instance's pin directory, so ``xdplb stop`` removes them with the
rest, and a daemon restart keeps clients balanced), attaches it to the cgroup, and
after every plan of the XDP tier hands it the same VIPs: each backend at its address
and the VIP's port, with the weight the XDP tier's table was built from (load
feedback applied, drained backends at 0) and up unless its health checks say down.
A backend that goes down leaves the tables and its connected UDP sockets are destroyed.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

from xdplb.config import Config, Protocol, TableKindName
from xdplb.control.overlay import Effective
from xdplb.control.status import SocketLbService, SocketLbStatus, vip_name
from xdplb.core.closing import Closing
from xdplb.core.errors import ConfigError, XdplbError
from xdplb.datapath.sock_lb import Endpoint, SockLb
from xdplb.sockets import socklb_plan
from xdplb.sockets.socklb_plan import Backend, Service

log = logging.getLogger("xdplb.daemon.socket_lb")

_PROTO = {Protocol.TCP: socket.IPPROTO_TCP, Protocol.UDP: socket.IPPROTO_UDP}
_PROTO_NAME = {n: p for p, n in _PROTO.items()}


def services(eff: Effective) -> list[Service]:
    """sock_lb's services for the tables ``eff`` describes (none without ``socket_lb``).

    One endpoint (address, port) has one health in sock_lb's maps, but two VIPs of one
    port (TCP and UDP) check their backends apart: an endpoint is down only when every
    VIP that names it sees it down; a VIP that alone sees it down gives it no weight,
    so its table leaves it out all the same."""
    cfg: Config = eff.config
    if cfg.socket_lb is None:
        return []
    vips = cfg.socket_lb.selected(cfg.vips)
    down: dict[Endpoint, bool] = {}
    for vip in vips:
        out = eff.members.get(vip.name, {})
        for b in vip.backends:
            ep = Endpoint(b.address, vip.port)
            down[ep] = down.get(ep, True) and b.address in out
    return [
        Service(
            address=vip.address,
            port=vip.port,
            proto=_PROTO[vip.protocol],
            backends=tuple(
                Backend(
                    Endpoint(b.address, vip.port),
                    weight=b.weight,
                    up=not down[Endpoint(b.address, vip.port)],
                )
                for b in vip.backends
            ),
            affinity_s=cfg.socket_lb.affinity_seconds,
            # A Beamer VIP's size need not be prime: sock_lb keeps Maglev for it.
            table_size=(
                cfg.vip_table_size(vip) if vip.table is TableKindName.MAGLEV else cfg.table_size
            ),
        )
        for vip in vips
    ]


class SocketBalancer(Closing):
    """sock_lb for the daemon's instance, attached to ``cgroup``."""

    def __init__(self, instance: str, cgroup: Path) -> None:
        if not (cgroup / "cgroup.procs").exists():
            raise ConfigError("socket_lb.cgroup", f"{cgroup} is not a cgroup v2 directory")
        self.cgroup = cgroup
        self.lb = SockLb(instance)
        #: The services of the latest plan, and of the latest one applied.
        self._wanted: list[Service] = []
        self._last: list[Service] | None = None

    def attach(self) -> None:
        """Attach to the cgroup (pinned links: they stay when the daemon exits; a new
        daemon swaps its programs into them)."""
        self.lb.attach(self.cgroup)
        log.info("socket_lb: attached to %s", self.cgroup)

    def on_planned(self, eff: Effective) -> None:
        """Follow the XDP tier's latest plan. A failure is logged, not raised: the XDP
        tier has applied its plan already, and the next plan tries again."""
        sl = eff.config.socket_lb
        if sl is not None and sl.cgroup != self.cgroup:
            log.warning(
                "socket_lb: stays on %s until a restart (asked: %s)", self.cgroup, sl.cgroup
            )
        wanted = self._wanted = services(eff)
        if wanted == self._last:
            return  # most plans change nothing here: the tables are not rebuilt for them
        try:
            result = socklb_plan.apply(self.lb, wanted)
        except XdplbError as e:
            self._last = None
            log.error("socket_lb: applying failed, the maps may be part-way: %s", e)
            return
        self._last = wanted
        names = result.plan.endpoints
        down = sorted(str(names[i]) for i in result.plan.went_down if i in names)
        if down or result.destroyed:
            log.warning(
                "socket_lb: backends down: %s; %d connected UDP sockets destroyed",
                ", ".join(down) or "-",
                len(result.destroyed),
            )

    def status(self) -> SocketLbStatus:
        """The services of the latest plan, each with its backends up and its table size
        as sock_lb's maps hold them, the hooks and the counters (``Status.socket_lb``)."""
        held = {(s.address, s.port, s.proto): s for s in self.lb.services()}
        out = []
        for svc in self._wanted:
            state = held.get(svc.key)
            proto = _PROTO_NAME[svc.proto]
            out.append(
                SocketLbService(
                    name=vip_name(svc.address, svc.port, proto),
                    address=str(svc.address),
                    port=svc.port,
                    protocol=str(proto),
                    backends=len(svc.backends),
                    backends_up=len(state.buckets) if state is not None else 0,
                    table_size=state.table_size if state is not None else None,
                )
            )
        return SocketLbStatus(
            cgroup=str(self.cgroup),
            attached=self.lb.attached(self.cgroup),
            services=out,
            events={e.name.lower(): n for e, n in self.lb.events().items()},
        )

    def close(self) -> None:
        self.lb.close()
