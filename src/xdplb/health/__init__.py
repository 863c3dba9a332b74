"""Health checking: which backends answer, checked from one asyncio loop.

Owns the checks and their hysteresis; the settings are :mod:`xdplb.config.health`.
May import: core, config, datapath (the tunnel that carries tunnelled checks).

- :mod:`xdplb.health.checkers`: one check of one :class:`Target` (TCP, HTTP(S), UDP,
  command), its socket marked and bound before it connects.
- :mod:`xdplb.health.monitor`: :class:`HealthMonitor`, thousands of targets, rise/fall
  hysteresis, transitions reported through a callback.
- :mod:`xdplb.health.targets`: the configuration's checks as targets, and the tunnel
  (:mod:`xdplb.datapath.hc`) that carries them to the backends as lb_xdp would.
"""

from xdplb.health.checkers import CheckResult, Target, run_check
from xdplb.health.monitor import HealthMonitor, HealthState

__all__ = ["CheckResult", "HealthMonitor", "HealthState", "Target", "run_check"]
