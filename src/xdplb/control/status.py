"""The status of an instance (``GET /api/v1/status``, ``xdplb status [--json]``): its models
and their one builder, :func:`build`, from what the maps say (:class:`MapsView`) and, when
the daemon runs, what only it knows (:class:`DaemonView`). The daemon builds it in
``Runtime.status``; the CLI, when no daemon answers, from the pins (:func:`from_pins`).
Both give the same :class:`Status`: ``source`` says which, and the fields the pins cannot
know are None (their docstrings say so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from xdplb.config import HashFields, VipConfig
from xdplb.config import Protocol as L4Protocol
from xdplb.core import abi, limits
from xdplb.core.addresses import IPAddress

if TYPE_CHECKING:
    from xdplb.core.state import Snapshot
    from xdplb.datapath.lb import Counters, MapFill

Health = Literal["up", "down", "unchecked"]
"""``unchecked``: no health check configured (or read from the pins), the backend counts
as up."""
Admin = Literal["enabled", "draining", "drained"]
"""``draining``: out of the table for new connections, established ones still open (or
not known to be closed); ``drained``: the backend's agent reports none left."""
Source = Literal["daemon", "pins"]
"""``daemon``: its API answered; ``pins``: read from the pinned maps because no daemon
answered (what only a daemon knows is None)."""


def vip_name(address: IPAddress, port: int, protocol: str) -> str:
    """``198.18.100.1:80/tcp``, ``[fd78::1]:53/udp``: a VIP's name in status, metrics, logs."""
    addr = f"[{address}]" if address.version == 6 else str(address)
    return f"{addr}:{port}/{protocol}"


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class BackendStatus(_Out):
    address: str
    id: int | None
    """Backend id in the maps (None: not in the maps yet)."""
    weight: int | None
    """As configured (or changed through the API); None from the pins."""
    effective_weight: int | None
    """What the table is built from: 0 while down or drained, load feedback's otherwise;
    None from the pins (``table_share`` is what the table says)."""
    health: Health
    health_detail: str
    """Last check's outcome ("HTTP 503", "timeout after 1000 ms"); empty if unchecked."""
    health_changed_ago: float | None
    """Seconds since the health state last changed (None: never checked)."""
    admin: Admin
    """From the pins: ``enabled`` (the pins do not hold drains)."""
    established: int | None
    """Connections of this VIP the backend's agent reports open, in any state but
    TIME_WAIT (UDP: connected sockets); None: no agent, or from the pins."""
    inactive: int | None = None
    """Of ``established``, the TCP connections not in ESTABLISHED (ipvsadm's InActConn);
    None: no agent that counts them, a UDP VIP, or from the pins."""
    table_share: float
    """Fraction of the VIP's buckets whose first hop is this backend."""
    packets: int
    """Counters of the backend over all VIPs (the data path counts per backend)."""
    bytes: int
    new_flows: int
    second_hop_forwards: int | None
    """Packets the backend's host_tc passed on to a later hop (from its agent; None: no
    agent, or from the pins)."""


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
    all_down: bool | None
    """Every backend with a weight is down: the VIP keeps its last table rather than
    dropping its traffic. None from the pins."""
    health_checked: bool | None
    """Some backend of the VIP has a health check; None from the pins."""
    packets: int
    bytes: int
    new_flows: int
    backends: list[BackendStatus]
    """From the daemon: the configured backends; from the pins: those the table names."""


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


class ConnTableStatus(_Out):
    capacity: int
    used: int | None
    """Entries in use (from the daemon: estimated from a sample of the sets; from the
    pins: counted). None: the table has a layout this xdplb's Python does not read (a
    test build's, docs/operations.md "Upgrades")."""


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


class Attachment(_Out):
    """An interface the balancer runs on: at which hook, and why there."""

    name: str
    hook: str
    """xdp or tc."""
    why: str | None
    """``configured``, or what ``auto`` saw; None from the pins."""


class BgpSession(_Out):
    peer: str
    state: str
    """BIRD's state and info of the session (``up Established``, ``start Active`` ...);
    ``BIRD not answering`` when its control socket does not."""

    @property
    def established(self) -> bool:
        return self.state.endswith("Established")


class BgpStatus(_Out):
    """What the node announces and why (docs/cluster.md, "Announcing")."""

    asn: int
    router_id: str
    announced: list[str]
    """The VIP addresses announced now."""
    withdrawn_because: str
    """Why nothing is announced (the self-check's failure, the daemon stopping); empty
    while announcing."""
    sessions: list[BgpSession]
    self_checks: int
    """Self-checks run since the daemon started."""
    self_check_failures: int
    """Of those, the ones that failed."""


class FleetNode(_Out):
    """Another node's (or this one's) report in the store."""

    node: str
    revision: int | None
    """The revision of the fleet's document it serves."""
    refused_revision: int | None
    refused_error: str
    age: float
    """Seconds since it published this report."""
    announced: list[str] = []
    """The VIP addresses it announces over BGP."""
    sessions: dict[str, str] = {}
    """Its BGP sessions: peer -> BIRD's state and info."""
    tables_differ: list[str]
    """VIPs whose table digest differs from this node's."""


class StoreStatus(_Out):
    """The node and the fleet's state in etcd (docs/cluster.md, "Fleet state")."""

    store: str
    node: str
    connected: bool
    error: str
    """Why the store cannot be reached (the node keeps serving meanwhile)."""
    revision: int | None
    """The revision of the fleet's document this node serves."""
    refused_revision: int | None
    """The last revision this node refused (the previous one kept serving)."""
    refused_error: str
    nodes: list[FleetNode]


class SyncPeerStatus(_Out):
    """This node's subscription to one peer's sessions (docs/sync.md)."""

    node: str
    address: str
    state: str
    """``connecting``, ``copying`` (its full copy under way), ``synced`` (copied, now
    following its new sessions), ``unreachable`` (never answered within
    ``sync.unreachable_after``: not waited for) or ``retrying`` (the last attempt failed:
    ``error`` says why)."""
    error: str
    """Why the last subscription ended (a refused message, a copy that timed out or did
    not match, the connection lost); empty if none did."""
    copies: int
    """Full copies taken from it whose count and digest matched."""
    copy_failures: int = 0
    """Full copies from it that did not match or did not end within
    ``sync.copy_timeout`` (each asked for again)."""
    last_copy_entries: int | None
    last_copy_ms: float | None
    """Milliseconds from the subscription to its matching END."""
    received: int
    """Entries received from it (copies included)."""
    imported: int
    """Of those, the ones written into this node's table."""


class SyncStatus(_Out):
    """Session sync (docs/sync.md): whether this node is synced, with whom, and what
    it sent, took and refused."""

    node: str
    listen: str
    ready: bool
    """Every peer that answered has given a full copy that matched: the node may
    announce."""
    waiting_for: str
    """Why not ready (empty when ready)."""
    peers: list[SyncPeerStatus]
    subscribers: list[str]
    """Peers that follow this node's sessions now."""
    sent: int
    """Entries of the stream (new, changed and refreshed sessions) queued to subscribers,
    once for each; full copies are not counted."""
    imported: dict[str, int]
    """Entries written into this node's table, by outcome: ``written`` (into a free way),
    ``replaced`` (the flow's own session), ``evicted`` (another live session lost its
    way: the table is too small for the cluster's sessions), ``present`` (the flow's
    session was kept: a NEW it had, a refresh older than its own)."""
    refused: dict[str, int]
    """Messages refused, by reason (docs/sync.md, "The wire"): never imported."""
    skipped: dict[str, int]
    """Entries received and not imported, by why: ``unknown_backend`` (a hop this node
    has no backend of), ``not_synced`` (a flow to no VIP of this node that syncs),
    ``busy`` (its set stayed held by writers)."""
    overflows: int
    """Subscribers dropped because they fell too far behind (they subscribe again, with a
    full copy)."""


class ClusterStatus(_Out):
    """The node's part in the cluster: BGP, the fleet's store, session sync (each None
    if not set)."""

    bgp: BgpStatus | None = None
    store: StoreStatus | None = None
    sync: SyncStatus | None = None


class SocketLbService(_Out):
    """A VIP sock_lb balances at the socket: how many of its backends its table holds."""

    name: str
    """The VIP's name (``10.96.0.10:80/tcp``)."""
    address: str
    port: int
    protocol: str
    backends: int
    """Backends of the VIP (each at the VIP's port)."""
    backends_up: int
    """Of those, the ones that own buckets of its table in sock_lb's maps now: up, with a
    weight, not drained (all of the last live ones while every backend is down)."""
    table_size: int | None
    """Buckets of its table in sock_lb's maps; None: not in the maps (applying failed)."""


class SocketLbStatus(_Out):
    """Socket-level balancing of the daemon's VIPs (docs/sock_lb.md), as its maps say."""

    cgroup: str
    attached: bool
    """Every hook is attached to ``cgroup`` (its link pinned)."""
    services: list[SocketLbService]
    """The VIPs ``socket_lb`` selects, in the configuration's order."""
    events: dict[str, int]
    """``socklb_events``, summed over CPUs (docs/sock_lb.md, "Counters")."""


class Status(_Out):
    source: Source
    instance: str
    config_path: str | None
    """None from the pins."""
    attached: list[str]
    hooks: list[Attachment] = []
    """The hook of each of ``attached``."""
    runtime_changes: bool | None
    """The running configuration differs from the file (API changes not persisted);
    None from the pins."""
    uptime: float | None
    """Seconds since the daemon started; None from the pins."""
    vips: list[VipStatus]
    """From the daemon: the configured VIPs, in order; from the pins: the VIPs the maps
    hold, by id."""
    drops: dict[str, int]
    events: dict[str, int]
    conn_table: ConnTableStatus
    maps: list[MapStatus] = []
    """Fill level of every map sized by ``limits`` (``hc_targets``: from the pins only if
    the health tunnel is pinned)."""
    rebuilds: int | None
    """Plans that changed the maps since the daemon started; None from the pins."""
    last_rebuild_ms: float | None
    """None: no rebuild since the daemon started, or from the pins."""
    health_checks: int | None
    """Health checks completed since the daemon started; None from the pins."""
    acl: list[AclHits] = []
    """ACL hits of the global scope and of every VIP that has rules or hits."""
    last_reload_error: str | None = None
    """Why the last reload was refused (what it would have dropped, or the file's error);
    None once one applies."""
    upgrade: list[str] = []
    """What the daemon's start copied from the pins of another layout, a line per pass
    (docs/operations.md, "Upgrades"); empty if it found none."""
    cluster: ClusterStatus | None = None
    """With a ``bgp``, ``cluster`` or ``sync`` section: the node's announcements, BGP
    sessions and self-checks, its place in the fleet's store, and session sync."""
    socket_lb: SocketLbStatus | None = None
    """With a ``socket_lb`` section: sock_lb's cgroup, hooks, services and counters; None
    from the pins."""


# -- the builder's inputs ----------------------------------------------------------------


@dataclass(frozen=True)
class MapsView:
    """What the maps of an instance say, read once."""

    instance: str
    snapshot: Snapshot
    counters: Counters
    #: ``counters.conns`` comes from a sample of the connection table's sets.
    conns_estimated: bool
    #: Fill of every sized map, ``hc_targets`` included where known.
    fill: Sequence[MapFill]
    #: Interfaces the balancer is attached to (its pinned links) -> hook.
    attached: Mapping[str, str]
    #: Connections the connection table holds.
    conn_capacity: int


@dataclass(frozen=True)
class BackendView:
    """One backend of a VIP as the daemon knows it; the defaults are what the pins tell."""

    address: IPAddress
    weight: int | None = None
    effective_weight: int | None = None
    health: Health = "unchecked"
    health_detail: str = ""
    health_changed_ago: float | None = None
    admin: Admin = "enabled"
    established: int | None = None
    inactive: int | None = None
    second_hop_forwards: int | None = None


@dataclass(frozen=True)
class VipView:
    """One VIP as the daemon's configuration has it (:meth:`configured`), or as the maps
    do (the pins: :func:`_pinned_vips`)."""

    address: IPAddress
    port: int
    protocol: L4Protocol
    encap: str
    hash: str
    table: str
    table_size: int
    backends: Sequence[BackendView]
    #: The scope has ACL rules (configured, or in the maps).
    acl_rules: bool
    all_down: bool | None = None
    health_checked: bool | None = None

    @classmethod
    def configured(
        cls, vip: VipConfig, table_size: int, all_down: bool, backends: Sequence[BackendView]
    ) -> VipView:
        return cls(
            address=vip.address,
            port=vip.port,
            protocol=vip.protocol,
            encap=str(vip.encap),
            hash=str(vip.hash),
            table=str(vip.table),
            table_size=table_size,
            backends=backends,
            acl_rules=not vip.acl.empty,
            all_down=all_down,
            health_checked=any(b.health for b in vip.backends) or vip.health is not None,
        )


@dataclass(frozen=True)
class DaemonView:
    """What only the running daemon knows."""

    config_path: str
    runtime_changes: bool
    uptime: float
    rebuilds: int
    last_rebuild_ms: float | None
    health_checks: int
    vips: Sequence[VipView]
    last_reload_error: str | None = None
    upgrade: Sequence[str] = ()
    #: Interface -> why its hook (configured, or what ``auto`` saw).
    hook_why: Mapping[str, str] = field(default_factory=dict)
    cluster: ClusterStatus | None = None
    socket_lb: SocketLbStatus | None = None


# -- the builder -------------------------------------------------------------------------


#: packets, bytes, new flows so far.
Counts = tuple[int, int, int]


@dataclass(frozen=True)
class Traffic:
    """The counters of every VIP (by name) and backend (by address) alone: what the
    daemon samples for its rate history. A backend of several VIPs has one set."""

    vips: dict[str, Counts]
    backends: dict[str, Counts]

    @classmethod
    def of(cls, st: Status) -> Traffic:
        vips = {v.name: (v.packets, v.bytes, v.new_flows) for v in st.vips}
        backends: dict[str, Counts] = {}
        for v in st.vips:
            for b in v.backends:
                backends.setdefault(b.address, (b.packets, b.bytes, b.new_flows))
        return cls(vips, backends)


def build(maps: MapsView, daemon: DaemonView | None = None) -> Status:
    """The status of the instance whose maps ``maps`` read; ``daemon`` None: no daemon
    answered (``source: pins``, the VIPs and backends those the maps hold)."""
    snap, counters = maps.snapshot, maps.counters
    found = {(v.addr, v.port, v.proto): p for v, p in snap.vips.items()}
    ids = {b.addr: i for i, b in snap.backends.items() if b.active}
    vips = []
    acl = [_acl_hits("global", counters.acl_hits.get(abi.ACL_GLOBAL, {}))]
    for view in daemon.vips if daemon is not None else _pinned_vips(snap):
        name = vip_name(view.address, view.port, view.protocol)
        params = found.get((view.address, view.port, view.protocol.number))
        hits = counters.acl_hits.get(params.vip_id, {}) if params is not None else {}
        if view.acl_rules or any(hits.values()):
            acl.append(_acl_hits(name, hits))
        table = snap.tables.get(params.vip_id) if params is not None else None
        share = table.counts() if table is not None else {}
        size = len(table) if table is not None else 1
        backends = []
        for b in view.backends:
            bid = ids.get(b.address)
            bstats = counters.backends.get(bid, abi.Stats()) if bid else abi.Stats()
            known = {k: v for k, v in asdict(b).items() if k != "address"}
            backends.append(
                BackendStatus(
                    address=str(b.address),
                    id=bid,
                    table_share=share.get(bid, 0) / size if bid else 0.0,
                    packets=bstats.packets,
                    bytes=bstats.bytes,
                    new_flows=bstats.new_flows,
                    **known,
                )
            )
        stats = counters.vips.get(params.vip_id, abi.Stats()) if params else abi.Stats()
        vips.append(
            VipStatus(
                name=name,
                address=str(view.address),
                port=view.port,
                protocol=str(view.protocol),
                encap=view.encap,
                hash=view.hash,
                table=view.table,
                table_size=view.table_size,
                id=params.vip_id if params is not None else None,
                all_down=view.all_down,
                health_checked=view.health_checked,
                packets=stats.packets,
                bytes=stats.bytes,
                new_flows=stats.new_flows,
                backends=backends,
            )
        )
    return Status(
        source="daemon" if daemon is not None else "pins",
        instance=maps.instance,
        config_path=daemon.config_path if daemon is not None else None,
        attached=sorted(maps.attached),
        hooks=[
            Attachment(
                name=n,
                hook=h,
                why=daemon.hook_why.get(n) if daemon is not None else None,
            )
            for n, h in sorted(maps.attached.items())
        ],
        runtime_changes=daemon.runtime_changes if daemon is not None else None,
        uptime=daemon.uptime if daemon is not None else None,
        vips=vips,
        drops={r.name.lower(): n for r, n in counters.drops.items()},
        events={e.name.lower(): n for e, n in counters.events.items()},
        conn_table=ConnTableStatus(capacity=maps.conn_capacity, used=counters.conns),
        maps=[
            MapStatus(
                name=f.name,
                config_key=limits.config_key(f.name),
                entries=f.entries,
                max_entries=f.max_entries,
                estimated=f.estimated or (f.name == "lb_conns" and maps.conns_estimated),
            )
            for f in maps.fill
        ],
        rebuilds=daemon.rebuilds if daemon is not None else None,
        last_rebuild_ms=daemon.last_rebuild_ms if daemon is not None else None,
        health_checks=daemon.health_checks if daemon is not None else None,
        acl=acl,
        last_reload_error=daemon.last_reload_error if daemon is not None else None,
        upgrade=list(daemon.upgrade) if daemon is not None else [],
        cluster=daemon.cluster if daemon is not None else None,
        socket_lb=daemon.socket_lb if daemon is not None else None,
    )


def _acl_hits(scope: str, hits: dict[abi.AclList, int]) -> AclHits:
    return AclHits(
        scope=scope,
        allow=hits.get(abi.AclList.ALLOW, 0),
        deny=hits.get(abi.AclList.DENY, 0),
        default=hits.get(abi.AclList.DEFAULT, 0),
    )


def _pinned_vips(snap: Snapshot) -> list[VipView]:
    """The VIPs the maps hold, by id, each with the backends its table names."""
    out = []
    for vip, p in sorted(snap.vips.items(), key=lambda kv: kv[1].vip_id):
        table = snap.tables.get(p.vip_id)
        hops = sorted(table.hop_ids()) if table is not None else []
        source_hash = p.flags & abi.VIP_F_SRC_HASH
        out.append(
            VipView(
                address=vip.addr,
                port=vip.port,
                protocol=L4Protocol.TCP if vip.proto == abi.IPPROTO_TCP else L4Protocol.UDP,
                encap=p.encap.name.lower(),
                hash=str(HashFields.SOURCE if source_hash else HashFields.FIVE_TUPLE),
                table=p.table_kind.name.lower(),
                table_size=p.table_size,
                backends=[
                    BackendView(b.addr)
                    for b in (snap.backends.get(i) for i in hops)
                    if b is not None and b.active
                ],
                acl_rules=any(k.scope == p.vip_id for k in snap.acl),
            )
        )
    return out


def from_pins(instance: str) -> Status:
    """What the pinned maps of ``instance`` say, read by a process other than its daemon
    (the CLI's ``status --offline``). FileNotFoundError: nothing pinned; XdplbError: the
    pins are not visible here (datapath.lb.checked_pin_root), or are of another layout
    than this xdplb reads (datapath.layout.LayoutMismatch)."""
    # bpf only here: the models are imported by the API's client, which makes no syscalls.
    from xdplb.datapath import Map, layout
    from xdplb.datapath.hc import pin_dir
    from xdplb.datapath.lb import LbMaps, MapFill, checked_pin_root, pinned_links

    root = checked_pin_root(instance)
    with LbMaps.from_pins(layout.pins_dir(instance)) as maps:
        snap = maps.snapshot()
        counters = maps.counters(snap=snap)
        fill = maps.fill(snap, conns_used=counters.conns)
        capacity = maps.conn_capacity
    hc_targets = pin_dir(instance) / "hc_targets"
    if hc_targets.exists():
        with Map.from_pinned(hc_targets) as m:
            fill.append(MapFill("hc_targets", m.count(), m.max_entries))
    attached = {n: str(h) for n, h in pinned_links(root).items()}
    return build(
        MapsView(
            instance=instance,
            snapshot=snap,
            counters=counters,
            conns_estimated=False,
            fill=fill,
            attached=attached,
            conn_capacity=capacity,
        )
    )
