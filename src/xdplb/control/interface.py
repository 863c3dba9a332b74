"""What the running daemon offers its operators: the status it reports and the changes
it accepts. The HTTP API (:mod:`xdplb.daemon.api`), the metrics (:mod:`xdplb.daemon.metrics`), the
status page and the CLI all speak this vocabulary; the daemon implements
:class:`Controller`.

Every method runs on the daemon's event loop and returns quickly: a change is
validated, planned and pushed to the maps before the call returns, or it changes
nothing and raises :class:`~xdplb.core.errors.ConfigError` naming the field.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from xdplb.config import Config
from xdplb.config import Protocol as L4Protocol
from xdplb.core.addresses import IPAddress

Health = Literal["up", "down", "unchecked"]
"""``unchecked``: no health check configured, the backend counts as up."""
Admin = Literal["enabled", "draining", "drained"]
"""``draining``: out of the table for new connections, established ones still open (or
not known to be closed); ``drained``: the backend's agent reports none left."""


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class VipRef(_Out):
    """A VIP's identity, as it appears in API paths: /vips/{address}/{port}/{protocol}."""

    address: IPAddress
    port: int
    protocol: L4Protocol

    @property
    def name(self) -> str:
        addr = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{addr}:{self.port}/{self.protocol}"


class BackendStatus(_Out):
    address: str
    id: int | None
    """Backend id in the maps (None: not in the maps yet)."""
    weight: int
    """As configured (or changed through the API)."""
    effective_weight: int
    """What the table is built from: 0 while down or drained, load feedback's otherwise."""
    health: Health
    health_detail: str
    """Last check's outcome ("HTTP 503", "timeout after 1000 ms"); empty if unchecked."""
    health_changed_ago: float | None
    """Seconds since the health state last changed (None: never checked)."""
    admin: Admin
    established: int | None
    """Connections of this VIP the backend's agent reports open (None: no agent)."""
    table_share: float
    """Fraction of the VIP's buckets whose first hop is this backend."""
    packets: int
    """Counters of the backend over all VIPs (the data path counts per backend)."""
    bytes: int
    new_flows: int
    second_hop_forwards: int | None
    """Packets the backend's host_tc passed on to a later hop (from its agent)."""


class VipStatus(_Out):
    name: str
    address: str
    port: int
    protocol: str
    encap: str
    hash: str
    table: str
    table_size: int
    id: int | None
    all_down: bool
    """Every backend with a weight is down: the VIP keeps its last table rather than
    dropping its traffic."""
    health_checked: bool
    packets: int
    bytes: int
    new_flows: int
    backends: list[BackendStatus]


class AclHits(_Out):
    """Packets an ACL scope counted, by list."""

    scope: str
    """``global``, or a VIP's name (``198.18.100.1:80/tcp``)."""
    allow: int
    """Matched an allow rule (let through)."""
    deny: int
    """Matched a deny rule (dropped)."""
    default: int
    """Matched no rule while the scope has an allow list (dropped)."""


class AclView(_Out):
    """One scope's ACL (``GET /api/v1/acl``, ``GET .../vips/{vip}/acl``): its rules and
    how many packets each list matched."""

    allow: list[str]
    deny: list[str]
    hits: AclHits


class ConnTableStatus(_Out):
    capacity: int
    used: int
    """Entries in use (estimated from a sample of the sets)."""


class MapStatus(_Out):
    """How full one BPF map is (docs/operations.md, "Limits and memory")."""

    name: str
    """The map (``lb_vips``, ``lb_conns``, ``hc_targets``, ...)."""
    config_key: str
    """The configuration field that sizes it (``limits.conn_table``)."""
    entries: int
    """Entries in use (``lb_conns``: connections; arrays by id: ids in use)."""
    max_entries: int
    """What the map holds (``lb_conns``: connections, sets x 4 ways)."""
    estimated: bool = False
    """``entries`` comes from a sample (the connection table)."""


class Status(_Out):
    instance: str
    config_path: str
    attached: list[str]
    runtime_changes: bool
    """The running configuration differs from the file (API changes not persisted)."""
    uptime: float
    vips: list[VipStatus]
    drops: dict[str, int]
    events: dict[str, int]
    conn_table: ConnTableStatus
    maps: list[MapStatus] = []
    """Fill level of every map sized by ``limits``."""
    rebuilds: int
    """Plans that changed the maps since the daemon started."""
    last_rebuild_ms: float | None
    health_checks: int
    """Health checks completed since the daemon started."""
    acl: list[AclHits] = []
    """ACL hits of the global scope and of every VIP that has rules or hits."""


class ChangeResult(_Out):
    operations: int
    """Map operations the change took (0: the maps already matched)."""
    persisted: bool
    """Written back to the configuration file."""
    runtime_changes: bool


class DrainStatus(_Out):
    vip: str
    backend: str
    admin: Admin
    established: int | None
    """Open connections the agent last reported (None: no report since the drain began)."""
    done: bool | None
    """True once a report taken after the drain began says none are left; None: cannot
    tell (no agent reports for this backend)."""


class Controller(Protocol):
    """The daemon as the API sees it."""

    def status(self) -> Status: ...

    def config(self) -> Config:
        """The running configuration, API changes included."""
        ...

    def replace_config(self, cfg: Config, *, persist: bool) -> ChangeResult:
        """Make ``cfg`` the running configuration (atomically: it is applied whole or not
        at all); ``persist`` also writes it to the configuration file."""
        ...

    def reload(self) -> ChangeResult:
        """Re-read the configuration file (API changes not persisted are dropped)."""
        ...

    def drain(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        """No new connections to ``backend`` for ``vip``; established ones continue.
        KeyError: no such VIP or backend."""
        ...

    def enable(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        """Undo a drain. KeyError: no such VIP or backend."""
        ...

    def drain_status(self, vip: VipRef, backend: IPAddress) -> DrainStatus: ...
