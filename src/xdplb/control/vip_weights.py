"""The daemon's side of load-aware weights: agents' reports in, VIP weights out.

:mod:`xdplb.control.weight_law` is the control law (pure); :mod:`xdplb.agent` the wire format
and the receiving socket (the daemon's, shared with graceful drain). This module keeps
one controller per VIP that asked for it (``load_feedback: true``), feeds it the reports
of that VIP's backends (an agent's ``--name`` is its backend's address, as written in the
configuration), and gives the daemon the configuration with the controlled weights in
place of the configured ones.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from xdplb.config import BackendConfig, Config, LoadFeedbackConfig, TableKindName, VipConfig
from xdplb.control.weight_law import Bounds, FeedbackConfig, LoadController
from xdplb.core.reports import LoadReport

log = logging.getLogger("xdplb.control.vip_weights")

VipName = str


def _controller_config(lf: LoadFeedbackConfig, vip: VipConfig) -> FeedbackConfig:
    # Never faster than the VIP's table may change.
    table_interval = vip.beamer.min_interval if vip.table is TableKindName.BEAMER else 0.0
    return FeedbackConfig(
        bounds={
            str(addr): Bounds(b.min_weight, b.max_weight) for addr, b in lf.backend_bounds.items()
        },
        default_bounds=Bounds(lf.bounds.min_weight, lf.bounds.max_weight),
        gain=lf.gain,
        deadband=lf.deadband,
        min_interval=max(lf.min_interval, table_interval),
        settle=lf.settle,
        max_age=lf.max_age,
        total_weight=lf.total_weight,
    )


def _base(vip: VipConfig) -> dict[str, int]:
    return {str(b.address): b.weight for b in vip.backends}


class WeightFeedback:
    """Reports from the agents, a controller per VIP, and the weights they settled on."""

    def __init__(self, lf: LoadFeedbackConfig) -> None:
        self.settings = lf
        self.controllers: dict[VipName, LoadController] = {}
        self._inputs: dict[VipName, tuple[FeedbackConfig, dict[str, int]]] = {}

    def configure(self, cfg: Config) -> None:
        """Follow a new configuration; a VIP whose settings and base weights did not
        change keeps its controller (and what it learned)."""
        lf = cfg.load_feedback
        assert lf is not None
        self.settings = lf
        wanted = {vip.name: vip for vip in cfg.vips if vip.load_feedback and vip.backends}
        for name in list(self.controllers):
            if name not in wanted:
                del self.controllers[name], self._inputs[name]
        for name, vip in wanted.items():
            inputs = (_controller_config(lf, vip), _base(vip))
            if self._inputs.get(name) != inputs:
                self.controllers[name] = LoadController(*inputs)
                self._inputs[name] = inputs

    def step(self, now: float, reports: Sequence[LoadReport]) -> bool:
        """Take new reports; True when some VIP's weights changed."""
        changed = False
        for name, ctl in self.controllers.items():
            mine = self._inputs[name][1]
            for report in reports:
                if report.backend in mine:
                    ctl.observe(report)
            new = ctl.update(now)
            if new is not None:
                log.info("load feedback: %s weights -> %s", name, new)
                changed = True
        return changed

    def effective(self, cfg: Config) -> Config:
        """``cfg`` with each controlled VIP's weights as its controller has them."""
        vips = []
        for vip in cfg.vips:
            ctl = self.controllers.get(vip.name)
            if ctl is None:
                vips.append(vip)
                continue
            weights = ctl.weights
            backends = [
                BackendConfig(address=b.address, weight=weights.get(str(b.address), b.weight))
                for b in vip.backends
            ]
            vips.append(vip.model_copy(update={"backends": backends}))
        return cfg.model_copy(update={"vips": vips})
