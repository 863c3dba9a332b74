"""From the configuration to health-check targets, and the tunnel that carries them.

A backend is checked per VIP, with the VIP's check (``vips[].health``) unless the
backend has its own (``vips[].backends[].health``); the monitor's key is the member
``(vip name, backend address)``, the same key :mod:`xdplb.control.overlay` takes down.

A check ``via: tunnel`` connects to the VIP itself with a firewall mark naming the
backend and the encapsulation: :class:`~xdplb.datapath.hc.HealthTunnel` routes marked
packets into its TC program, which encapsulates them to the backend exactly as lb_xdp
would. The backend's reply comes from the VIP straight back to the LB's tunnel source
address, so a backend whose decapsulation (or VIP, or route back) is broken fails its
check. A check ``via: direct`` connects to the backend's own address.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from xdplb.config import Config, HashFields, VipConfig
from xdplb.config.health import HealthCheckConfig
from xdplb.core.addresses import IPAddress
from xdplb.datapath.hc import HcTarget, HealthTunnel
from xdplb.health.checkers import Target


class HealthTargets:
    """Targets of one instance's configuration; owns the instance's health tunnel."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.tunnel: HealthTunnel | None = None
        self._tunnel_args: tuple[object, ...] | None = None
        #: How a backend is reached -> index of its mark; stable while configured, so a
        #: reload does not restart the checks of unchanged targets.
        self._index: dict[HcTarget, int] = {}

    def update(self, cfg: Config) -> list[Target]:
        """The targets ``cfg`` asks for; the tunnel is made to carry the tunnelled ones."""
        wanted: list[tuple[VipConfig, IPAddress, HealthCheckConfig, HcTarget | None]] = []
        targets: list[Target] = []
        for vip in cfg.vips:
            for b in vip.backends:
                check = b.health or vip.health
                if check is None:
                    continue
                tunnelled = check.via == "tunnel" and check.checker.kind != "command"
                reach = HcTarget(b.address, vip.encap.abi, vip.hash is HashFields.SOURCE)
                wanted.append((vip, b.address, check, reach if tunnelled else None))
        used = {how for *_, how in wanted if how is not None}
        self._index = {k: i for k, i in self._index.items() if k in used}
        free = (i for i in range(1, 0x10000) if i not in set(self._index.values()))
        for key in sorted(used - self._index.keys(), key=_order):
            self._index[key] = next(free)
        tunnel = self._tunnel(cfg) if used else None
        for vip, addr, check, how in wanted:
            port = check.checker.check_port or vip.port
            if how is not None:
                assert tunnel is not None
                source = cfg.tunnel.source_v4 if vip.address.version == 4 else cfg.tunnel.source_v6
                target = Target(
                    key=(vip.name, addr),
                    backend=addr,
                    address=vip.address,
                    port=port,
                    check=check,
                    mark=tunnel.mark_for(self._index[how]),
                    source=source,
                    vip=vip.name,
                )
            else:
                target = Target(
                    key=(vip.name, addr),
                    backend=addr,
                    address=addr,
                    port=port,
                    check=check,
                    vip=vip.name,
                )
            targets.append(target)
        if tunnel is not None:
            tunnel.set_targets({tunnel.mark_for(i): k for k, i in self._index.items()})
        elif self.tunnel is not None:
            self.tunnel.set_targets({})
        return targets

    def _tunnel(self, cfg: Config) -> HealthTunnel:
        args = (
            cfg.tunnel.source_v4,
            cfg.tunnel.source_v6,
            cfg.tunnel.gue_port,
            cfg.hash_seed,
            cfg.limits.hc_targets,
        )
        if self.tunnel is None or args != self._tunnel_args:
            if self.tunnel is not None:
                self.tunnel.close()
            v4, v6, port, seed, size = args
            # pyroute2's synchronous calls run an event loop of their own, which cannot
            # nest in the daemon's: set the device, rules and routes up from a thread.
            with ThreadPoolExecutor(1) as pool:
                self.tunnel = pool.submit(
                    HealthTunnel, self.instance, v4, v6, port, hash_seed=seed, max_targets=size
                ).result()
            self._tunnel_args = args
        return self.tunnel

    def close(self) -> None:
        if self.tunnel is not None:
            self.tunnel.close()
            self.tunnel = None


def _order(t: HcTarget) -> tuple[int, IPAddress, int, bool]:
    return (t.address.version, t.address, t.encap, t.src_hash)
