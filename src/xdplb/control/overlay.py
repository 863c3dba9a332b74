"""The weights the tables are built from: the configuration, less what health checks
and operators took out.

Pure: the daemon passes which backends are down (health checks) and which are drained
(``xdplb backend drain``), and gets back the configuration the planner builds tables
from. A backend out of a VIP's table keeps its place in the configuration, so it keeps
its backend id and stays a usable later hop for the connections it still has.

When every backend of a VIP that could take traffic is down, a table without any of
them would drop all of the VIP's traffic; a check that fails everywhere at once is
more likely a broken check (or a broken path from the LB) than a dead service. The VIP
then keeps the weights of its last table that had a live backend, and says so
(``all_down``), as IPVS's "quiescent" servers and Maglev's fail-open do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from xdplb.config import Config
from xdplb.core import abi
from xdplb.core.addresses import IPAddress

#: (VIP name as in VipConfig.name, backend address)
Member = tuple[str, IPAddress]
Weights = dict[IPAddress, int]


@dataclass(frozen=True)
class Overlay:
    down: frozenset[Member] = frozenset()
    """Failing their health checks."""
    drained: frozenset[Member] = frozenset()
    """Taken out by an operator (draining or drained)."""


@dataclass
class Effective:
    config: Config
    """``cfg`` with the weights the tables are built from."""
    all_down: set[str] = field(default_factory=set)
    """VIPs whose every backend is down: they keep their last live weights."""
    last_live: dict[str, Weights] = field(default_factory=dict)
    """Per VIP, the last weights that had a live backend: pass it back next time."""
    members: dict[str, dict[IPAddress, abi.MemberState]] = field(default_factory=dict)
    """Per VIP, the backends out of its table because they are down (``lb_members``
    DOWN: their UDP sessions move at once); the rest go by weight (planner)."""


def effective(
    cfg: Config, overlay: Overlay, last_live: Mapping[str, Mapping[IPAddress, int]]
) -> Effective:
    """The configuration to plan from, given who is down and who is drained."""
    out = Effective(cfg, last_live={k: dict(v) for k, v in last_live.items()})
    vips = []
    for vip in cfg.vips:
        serving = {
            b.address: b.weight
            for b in vip.backends
            if (vip.name, b.address) not in overlay.drained
        }
        live = {a: w for a, w in serving.items() if (vip.name, a) not in overlay.down}
        if any(live.values()) or not any(serving.values()):
            weights = live
            if any(live.values()):
                out.last_live[vip.name] = {a: w for a, w in live.items() if w}
        else:
            out.all_down.add(vip.name)
            kept = {
                a: w for a, w in out.last_live.get(vip.name, {}).items() if serving.get(a, 0) > 0
            }
            weights = kept if kept else serving
        backends = [
            b.model_copy(update={"weight": weights.get(b.address, 0)}) for b in vip.backends
        ]
        down = {
            b.address: abi.MemberState.DOWN
            for b in backends
            if b.weight == 0 and (vip.name, b.address) in overlay.down
        }
        if down:
            out.members[vip.name] = down
        vips.append(vip.model_copy(update={"backends": backends}))
    for name in list(out.last_live):
        if name not in {v.name for v in cfg.vips}:
            del out.last_live[name]
    out.config = cfg.model_copy(update={"vips": vips})
    return out
