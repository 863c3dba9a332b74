"""What a backend's agent reports, as the daemon received it: the one vocabulary of the
agent's wire codec (:mod:`xdplb.agent`), the load-feedback law
(:mod:`xdplb.control.weight_law`) and the drain tracker (:mod:`xdplb.control.drain`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from xdplb.core.addresses import IPAddress


def finite(name: str, value: float) -> float:
    """``value`` as a float; ValueError naming ``name`` unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    return float(value)


ConnKey = tuple[IPAddress, int]
"""(local address, local port) of a backend's server-side connections: a VIP (or the
backend's own address) and a service port. IPv4-mapped addresses are kept as IPv4."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One backend's load, as the controller received it."""

    backend: str
    """Identity of the backend, the key of ``base_weights``."""
    cpu: float
    """Cpu utilisation over the agent's last interval, 0..1."""
    rps: float
    """Requests per second over that interval (new TCP connections, see xdplb.agent)."""
    at: float
    """When the report was received, on the clock given to :meth:`LoadController.update`.
    The agent measures right before it sends, so this is also (within the network's
    delay) when ``conns`` was true."""
    conns: Mapping[ConnKey, int] | None = field(default=None, hash=False)
    """Established server-side connections per (local address, port), non-zero entries
    only (see xdplb.agent.serverconns). None: the agent does not count them (an older agent),
    which is not the same as none open."""
    conns_truncated: bool = False
    """``conns`` holds only the largest entries: an address and port missing from it may
    still have connections."""
    chain: Mapping[str, int] | None = field(default=None, hash=False)
    """host_tc's event counters on the backend (lower-case :class:`xdplb.core.abi.HostEvent`
    names: ``forward`` counts second-hop forwards); None when host_tc is not pinned."""
    conns_inactive: Mapping[ConnKey, int] | None = field(default=None, hash=False)
    """Of ``conns``, the connections not ESTABLISHED; None: not counted (an older agent)."""
    udp: Mapping[ConnKey, int] | None = field(default=None, hash=False)
    """Connected UDP sockets per served (local address, port); None: not counted."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"backend: must be a non-empty string, got {self.backend!r}")
        if not 0.0 <= finite("cpu", self.cpu) <= 1.0:
            raise ValueError(f"cpu: must be within 0..1, got {self.cpu!r}")
        if finite("rps", self.rps) < 0.0:
            raise ValueError(f"rps: must be >= 0, got {self.rps!r}")
        finite("at", self.at)
        # Read-only copies: the report is frozen, a caller's dict is not.
        if self.conns is not None:
            object.__setattr__(self, "conns", MappingProxyType(dict(self.conns)))
        elif self.conns_truncated:
            raise ValueError("conns_truncated: set without conns")
        if self.chain is not None:
            object.__setattr__(self, "chain", MappingProxyType(dict(self.chain)))
        for name in ("conns_inactive", "udp"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, MappingProxyType(dict(value)))
