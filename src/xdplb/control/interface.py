"""What the running daemon offers its operators: the changes it accepts, its drains and
ACLs, and its status (:mod:`xdplb.control.status`). The HTTP API (:mod:`xdplb.daemon.api`),
the metrics (:mod:`xdplb.daemon.metrics`), the status page and the CLI all speak this
vocabulary; the daemon implements :class:`Controller`.

Every method runs on the daemon's event loop and returns quickly: a change is
validated, planned and pushed to the maps before the call returns, or it changes
nothing and raises :class:`~xdplb.core.errors.ConfigError` naming the field.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict

from xdplb.config import Config
from xdplb.config import Protocol as L4Protocol
from xdplb.control.sessions import ConnectionPage, ConnectionQuery, SessionCount
from xdplb.control.status import AclHits, Admin, ClusterStatus, Status, vip_name
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import XdplbError


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class VipRef(_Out):
    """A VIP's identity, as it appears in API paths: /vips/{address}/{port}/{protocol}."""

    address: IPAddress
    port: int
    protocol: L4Protocol

    @property
    def name(self) -> str:
        return vip_name(self.address, self.port, self.protocol)


class AclView(_Out):
    """One scope's ACL (``GET /api/v1/acl``, ``GET .../vips/{vip}/acl``): its rules and
    how many packets each list matched."""

    allow: list[str]
    deny: list[str]
    hits: AclHits


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
    """True once a report taken after the drain began says none are left (UDP: and no
    packet went to the backend for the VIP's ``udp_drain_idle``); None: cannot tell (no
    agent reports for this backend)."""
    idle: float | None = None
    """UDP: seconds lb_xdp has forwarded no packet to the backend within the drain (as
    sampled by the daemon); None for TCP, or not draining."""


class ReloadRefused(XdplbError):
    """A reload would drop changes made through the API (not persisted); nothing changed.
    ``dropped``: one line per change it would drop (:func:`xdplb.control.diff.dropped`)."""

    def __init__(self, dropped: list[str]) -> None:
        self.dropped = dropped
        super().__init__(
            "reload refused, the running configuration is kept: "
            + "; ".join(dropped)
            + " (force it to apply the file anyway, or persist the changes)"
        )


class Controller(Protocol):
    """The daemon as the API sees it."""

    def status(self) -> Status: ...

    def cluster(self) -> ClusterStatus | None:
        """The node's announcements, BGP sessions and self-checks; None without a
        ``bgp`` section."""
        ...

    def config(self) -> Config:
        """The running configuration, API changes included."""
        ...

    def replace_config(self, cfg: Config, *, persist: bool) -> ChangeResult:
        """Make ``cfg`` the running configuration (atomically: it is applied whole or not
        at all); ``persist`` also writes it to the configuration file."""
        ...

    def reload(self, *, force: bool = False) -> ChangeResult:
        """Re-read the configuration file and apply it. ReloadRefused (nothing changed) if
        that would drop changes made through the API and not persisted, unless ``force``;
        ConfigError if the file is refused."""
        ...

    def drain(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        """No new connections to ``backend`` for ``vip``; established ones continue.
        KeyError: no such VIP or backend."""
        ...

    def enable(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        """Undo a drain. KeyError: no such VIP or backend."""
        ...

    def drain_status(self, vip: VipRef, backend: IPAddress) -> DrainStatus: ...

    def connections(self, query: ConnectionQuery, *, cursor: int, limit: int) -> ConnectionPage:
        """A page of the session table (:func:`xdplb.control.sessions.page`)."""
        ...

    def session_counts(self) -> list[SessionCount]:
        """Session-table entries per (VIP, backend), from a walk of the whole table."""
        ...
