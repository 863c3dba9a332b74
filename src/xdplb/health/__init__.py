"""Health checking: which backends answer, checked from one asyncio loop.

- :mod:`xdplb.health.config`: the settings (pydantic; Nickel's format).
- :mod:`xdplb.health.checkers`: one check of one :class:`Target` (TCP, HTTP(S), UDP,
  command), its socket marked and bound before it connects.
- :mod:`xdplb.health.monitor`: :class:`HealthMonitor`, thousands of targets, rise/fall
  hysteresis, transitions reported through a callback.
"""

from xdplb.health.checkers import CheckResult, Target, run_check
from xdplb.health.config import (
    CheckerConfig,
    CommandCheck,
    HealthCheckConfig,
    HttpCheck,
    TcpCheck,
    UdpCheck,
)
from xdplb.health.monitor import HealthMonitor, HealthState

__all__ = [
    "CheckResult",
    "CheckerConfig",
    "CommandCheck",
    "HealthCheckConfig",
    "HealthMonitor",
    "HealthState",
    "HttpCheck",
    "Target",
    "TcpCheck",
    "UdpCheck",
    "run_check",
]
