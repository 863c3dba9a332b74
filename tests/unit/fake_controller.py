"""A :class:`~xdplb.control.interface.Controller` without a kernel, for the API, metrics and CLI
tests: it keeps a real :class:`Config` (replace_config stores it), drain states, and
builds a :class:`Status` from them with counters the test can set."""

from __future__ import annotations

import ipaddress
import threading
from dataclasses import dataclass, field

from xdplb.config import Config, parse_config
from xdplb.control.interface import ChangeResult, DrainStatus, ReloadRefused, VipRef
from xdplb.control.sessions import (
    Connection,
    ConnectionPage,
    ConnectionQuery,
    SessionCount,
    matches,
)
from xdplb.control.status import (
    AclHits,
    Admin,
    BackendStatus,
    ClusterStatus,
    ConnTableStatus,
    SocketLbStatus,
    Status,
    VipStatus,
)
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import ConfigError

CONFIG = {
    "instance": "fake",
    "tunnel": {"source_v4": "198.18.0.2", "source_v6": "fd78:6470:6c62::2"},
    "vips": [
        {
            "address": "198.18.100.1",
            "port": 80,
            "protocol": "tcp",
            "backends": [
                {"address": "198.18.0.11", "weight": 2},
                {"address": "198.18.0.12"},
                {"address": "198.18.0.13"},
            ],
        },
        {
            "address": "fd78:6470:6c62:100::1",
            "port": 53,
            "protocol": "udp",
            "encap": "ipip",
            "backends": [{"address": "fd78:6470:6c62::11"}],
        },
    ],
}


@dataclass
class Drain:
    admin: Admin = "draining"
    established: int | None = None
    done: bool | None = None


@dataclass
class FakeController:
    cfg: Config = field(default_factory=lambda: parse_config(CONFIG))
    file_cfg: Config | None = None
    drains: dict[tuple[str, str], Drain] = field(default_factory=dict)
    #: Counters per backend address (packets, bytes, new_flows).
    counters: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: Established connections the "agent" reports, per backend (None: no agent).
    established: dict[str, int | None] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=lambda: {"no_backend": 3, "bad_header": 0})
    events: dict[str, int] = field(default_factory=lambda: {"tx": 42})
    #: ACL hits per scope ("global" or a VIP name): (allow, deny, default).
    acl_hits: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: The session table's entries, in table order (a page's cursor is an index here).
    sessions: list[Connection] = field(default_factory=list)
    replaced: int = 0
    persisted: int = 0
    #: Set to make the next replace_config fail like a bug in the daemon.
    explode: bool = False
    #: What a reload without force would drop: it is refused, naming them.
    refuse_reload: list[str] = field(default_factory=list)
    #: The node's cluster view (None: no bgp section).
    cluster_view: ClusterStatus | None = None
    #: sock_lb's view (None: no socket_lb section).
    socket_lb_view: SocketLbStatus | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.file_cfg is None:
            self.file_cfg = self.cfg

    # The Controller protocol.

    def status(self) -> Status:
        vips = []
        for vi, v in enumerate(self.cfg.vips):
            total = sum(b.weight for b in v.backends if self._admin(v.name, b.address) == "enabled")
            bes = []
            for bi, b in enumerate(v.backends):
                admin = self._admin(v.name, b.address)
                eff = b.weight if admin == "enabled" else 0
                p, by, nf = self.counters.get(str(b.address), (0, 0, 0))
                bes.append(
                    BackendStatus(
                        address=str(b.address),
                        id=bi + 1,
                        weight=b.weight,
                        effective_weight=eff,
                        health="up",
                        health_detail="HTTP 200",
                        health_changed_ago=12.5,
                        admin=admin,
                        established=self.established.get(str(b.address)),
                        table_share=eff / total if total else 0.0,
                        packets=p,
                        bytes=by,
                        new_flows=nf,
                        second_hop_forwards=None,
                    )
                )
            vips.append(
                VipStatus(
                    name=v.name,
                    address=str(v.address),
                    port=v.port,
                    protocol=str(v.protocol),
                    encap=str(v.encap),
                    hash=str(v.hash),
                    table=str(v.table),
                    table_size=self.cfg.vip_table_size(v),
                    id=vi,
                    all_down=False,
                    health_checked=True,
                    packets=sum(b.packets for b in bes),
                    bytes=sum(b.bytes for b in bes),
                    new_flows=sum(b.new_flows for b in bes),
                    backends=bes,
                )
            )
        return Status(
            source="daemon",
            instance=self.cfg.instance,
            config_path="/etc/xdplb/fake.yaml",
            attached=["eth0"],
            runtime_changes=self.cfg != self.file_cfg,
            uptime=100.0,
            vips=vips,
            drops=dict(self.drops),
            events=dict(self.events),
            conn_table=ConnTableStatus(capacity=1024, used=17),
            rebuilds=self.replaced,
            last_rebuild_ms=1.5,
            health_checks=99,
            acl=[
                AclHits(scope=scope, allow=a, deny=d, default=n)
                for scope, (a, d, n) in self.acl_hits.items()
            ],
            cluster=self.cluster_view,
            socket_lb=self.socket_lb_view,
        )

    def cluster(self) -> ClusterStatus | None:
        return self.cluster_view

    def config(self) -> Config:
        return self.cfg

    def replace_config(self, cfg: Config, *, persist: bool) -> ChangeResult:
        if self.explode:
            raise RuntimeError("the fake exploded")
        if cfg.instance != self.cfg.instance:
            raise ConfigError("instance", "cannot change while running")
        ops = 0 if cfg == self.cfg else 1
        self.cfg = cfg
        self.replaced += 1
        if persist:
            self.file_cfg = cfg
            self.persisted += 1
        return ChangeResult(
            operations=ops, persisted=persist, runtime_changes=self.cfg != self.file_cfg
        )

    def reload(self, *, force: bool = False) -> ChangeResult:
        assert self.file_cfg is not None
        if self.refuse_reload and not force:
            raise ReloadRefused(list(self.refuse_reload))
        return self.replace_config(self.file_cfg, persist=False)

    def drain(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        self._check(vip, backend)
        # Draining a draining backend changes nothing (as Runtime.drain).
        self.drains.setdefault((vip.name, str(backend)), Drain())
        return self.drain_status(vip, backend)

    def enable(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        self._check(vip, backend)
        self.drains.pop((vip.name, str(backend)), None)
        return self.drain_status(vip, backend)

    def drain_status(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        self._check(vip, backend)
        d = self.drains.get((vip.name, str(backend)))
        return DrainStatus(
            vip=vip.name,
            backend=str(backend),
            admin=d.admin if d else "enabled",
            established=d.established if d else self.established.get(str(backend)),
            done=d.done if d else None,
        )

    def connections(self, query: ConnectionQuery, *, cursor: int, limit: int) -> ConnectionPage:
        out, i = [], cursor
        while i < len(self.sessions) and len(out) < limit:
            if matches(self.sessions[i], query):
                out.append(self.sessions[i])
            i += 1
        return ConnectionPage(
            connections=out,
            next=i if i < len(self.sessions) else None,
            scanned_sets=i - cursor,
            sets=len(self.sessions),
        )

    def session_counts(self) -> list[SessionCount]:
        seen: dict[tuple[str, str], int] = {}
        for c in self.sessions:
            if c.vip is not None and c.backend is not None:
                seen[c.vip, c.backend] = seen.get((c.vip, c.backend), 0) + 1
        return [SessionCount(vip=v, backend=b, entries=n) for (v, b), n in sorted(seen.items())]

    # For the tests.

    def reset(self) -> None:
        """Back to the initial configuration, nothing drained."""
        self.cfg = self.file_cfg = parse_config(CONFIG)
        self.drains.clear()
        self.explode = False
        self.refuse_reload = []

    def report(self, vip: str, backend: str, established: int) -> None:
        """What the backend's agent would say after a drain began."""
        with self.lock:
            d = self.drains[(vip, backend)]
            d.established = established
            d.done = established == 0
            d.admin = "drained" if d.done else "draining"

    def _admin(self, vip: str, backend: IPAddress) -> Admin:
        d = self.drains.get((vip, str(backend)))
        return d.admin if d else "enabled"

    def _check(self, vip: VipRef, backend: IPAddress) -> None:
        for v in self.cfg.vips:
            if v.key == (vip.address, vip.port, vip.protocol):
                if any(b.address == ipaddress.ip_address(backend) for b in v.backends):
                    return
                raise KeyError(f"no backend {backend} in VIP {vip.name}")
        raise KeyError(f"no VIP {vip.name}")
