"""Prometheus metrics of the daemon.

Almost everything is read from :meth:`Controller.status` at scrape time by a custom
collector, so a scrape sees the same numbers as ``GET /api/v1/status`` and the daemon
keeps no second copy of its counters. Only what the status cannot hold is recorded as it
happens: the duration of each table rebuild (a histogram the daemon feeds with
:meth:`Metrics.observe_rebuild`).

Labels: ``vip="198.18.100.1:80/tcp"`` (``[v6]:port/proto``), ``backend="198.18.0.11"``;
ACL hits carry ``scope`` (``global`` or a VIP's name) and ``list``.
Counters of a backend are the data path's, over all VIPs, so they carry only
``backend``; its state and weights are per VIP and carry both. Enum-like states
(health, admin) are one series per state, 1 for the current one, the usual Prometheus
way to make ``sum by (state)`` work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from xdplb.control.interface import Controller
from xdplb.control.status import (
    Admin,
    BgpStatus,
    Health,
    SocketLbStatus,
    Status,
    StoreStatus,
    SyncStatus,
)

log = logging.getLogger("xdplb.daemon.metrics")

#: Seconds: a rebuild is a plan plus a batch map update, milliseconds for 65537 buckets.
REBUILD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

HEALTH_STATES: tuple[str, ...] = get_args(Health)
ADMIN_STATES: tuple[str, ...] = get_args(Admin)


class StatusCollector(Collector):
    """Every ``xdplb_*`` series that comes from :meth:`Controller.status`."""

    def __init__(self, ctl: Controller) -> None:
        self._ctl = ctl

    def describe(self) -> list[Metric]:
        # No describe-time families: registering must not call the controller.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from families(self._ctl.status())


def families(st: Status) -> Iterator[Metric]:
    """The metric families of one status (pure: tested without a registry)."""
    info = GaugeMetricFamily("xdplb_info", "The instance this daemon serves", labels=["instance"])
    info.add_metric([st.instance], 1)
    yield info
    yield GaugeMetricFamily("xdplb_uptime_seconds", "Seconds since the daemon started", st.uptime)
    yield GaugeMetricFamily(
        "xdplb_runtime_changes",
        "1 if the running configuration differs from the file (API changes not persisted)",
        None if st.runtime_changes is None else int(st.runtime_changes),
    )
    yield CounterMetricFamily(
        "xdplb_health_checks", "Health checks completed since the daemon started", st.health_checks
    )
    yield GaugeMetricFamily(
        "xdplb_conn_table_capacity", "Entries the connection table can hold", st.conn_table.capacity
    )
    yield GaugeMetricFamily(
        "xdplb_conn_table_used",
        "Entries of the connection table in use (estimated from a sample)",
        st.conn_table.used,
    )
    entries = GaugeMetricFamily(
        "xdplb_map_entries",
        "Entries in use in a BPF map (lb_conns: connections, estimated from a sample)",
        labels=["map"],
    )
    max_entries = GaugeMetricFamily(
        "xdplb_map_max_entries",
        "Entries a BPF map holds (its size, config limits; lb_conns: connections)",
        labels=["map"],
    )
    for m in st.maps:
        entries.add_metric([m.name], m.entries)
        max_entries.add_metric([m.name], m.max_entries)
    yield entries
    yield max_entries
    drops = CounterMetricFamily(
        "xdplb_drops", "Packets lb_xdp dropped, by named reason", labels=["reason"]
    )
    for reason, n in sorted(st.drops.items()):
        drops.add_metric([reason], n)
    yield drops
    events = CounterMetricFamily(
        "xdplb_events", "Outcomes lb_xdp counted other than drops, by name", labels=["event"]
    )
    for event, n in sorted(st.events.items()):
        events.add_metric([event], n)
    yield events
    acl = CounterMetricFamily(
        "xdplb_acl_hits",
        "Packets a source ACL matched, by scope (global or a VIP) and list "
        "(allow: let through; deny and default, no rule of an allow list: dropped)",
        labels=["scope", "list"],
    )
    for h in st.acl:
        for lst, n in (("allow", h.allow), ("deny", h.deny), ("default", h.default)):
            acl.add_metric([h.scope, lst], n)
    yield acl

    vip_l = ["vip"]
    v_packets = CounterMetricFamily("xdplb_vip_packets", "Packets to the VIP", labels=vip_l)
    v_bytes = CounterMetricFamily("xdplb_vip_bytes", "Bytes to the VIP", labels=vip_l)
    v_new = CounterMetricFamily(
        "xdplb_vip_new_flows", "New connections (flows) the VIP's table placed", labels=vip_l
    )
    v_down = GaugeMetricFamily(
        "xdplb_vip_all_down",
        "1 if every backend with a weight is down (the VIP keeps its last table)",
        labels=vip_l,
    )
    v_size = GaugeMetricFamily("xdplb_vip_table_size", "Buckets of the VIP's table", labels=vip_l)

    be_l = ["backend"]
    b_packets = CounterMetricFamily(
        "xdplb_backend_packets", "Packets sent to the backend (all VIPs)", labels=be_l
    )
    b_bytes = CounterMetricFamily(
        "xdplb_backend_bytes", "Bytes sent to the backend (all VIPs)", labels=be_l
    )
    b_new = CounterMetricFamily(
        "xdplb_backend_new_flows", "New connections placed on the backend (all VIPs)", labels=be_l
    )
    b_hop2 = CounterMetricFamily(
        "xdplb_backend_second_hop_forwards",
        "Packets the backend's host_tc passed on to a later hop (from its agent)",
        labels=be_l,
    )

    vb_l = ["vip", "backend"]
    up = GaugeMetricFamily(
        "xdplb_backend_up", "1 if the backend counts as up for the VIP (unchecked: 1)", labels=vb_l
    )
    health = GaugeMetricFamily(
        "xdplb_backend_health",
        "Health state of the backend for the VIP: 1 for the current state",
        labels=[*vb_l, "state"],
    )
    admin = GaugeMetricFamily(
        "xdplb_backend_admin",
        "Administrative state of the backend for the VIP: 1 for the current state",
        labels=[*vb_l, "state"],
    )
    weight = GaugeMetricFamily(
        "xdplb_backend_weight", "Weight as configured (or set through the API)", labels=vb_l
    )
    eff = GaugeMetricFamily(
        "xdplb_backend_effective_weight",
        "Weight the table is built from (0 while down or drained)",
        labels=vb_l,
    )
    share = GaugeMetricFamily(
        "xdplb_backend_table_share",
        "Fraction of the VIP's buckets whose first hop is the backend",
        labels=vb_l,
    )
    est = GaugeMetricFamily(
        "xdplb_backend_established_connections",
        "Connections of the VIP the backend's agent reports open (absent: no agent)",
        labels=vb_l,
    )

    seen: set[str] = set()
    for v in st.vips:
        v_packets.add_metric([v.name], v.packets)
        v_bytes.add_metric([v.name], v.bytes)
        v_new.add_metric([v.name], v.new_flows)
        if v.all_down is not None:
            v_down.add_metric([v.name], int(v.all_down))
        v_size.add_metric([v.name], v.table_size)
        for b in v.backends:
            if b.address not in seen:
                seen.add(b.address)
                b_packets.add_metric([b.address], b.packets)
                b_bytes.add_metric([b.address], b.bytes)
                b_new.add_metric([b.address], b.new_flows)
                if b.second_hop_forwards is not None:
                    b_hop2.add_metric([b.address], b.second_hop_forwards)
            labels = [v.name, b.address]
            up.add_metric(labels, int(b.health != "down"))
            for state in HEALTH_STATES:
                health.add_metric([*labels, state], int(b.health == state))
            for state in ADMIN_STATES:
                admin.add_metric([*labels, state], int(b.admin == state))
            if b.weight is not None and b.effective_weight is not None:
                weight.add_metric(labels, b.weight)
                eff.add_metric(labels, b.effective_weight)
            share.add_metric(labels, b.table_share)
            if b.established is not None:
                est.add_metric(labels, b.established)
    yield from (v_packets, v_bytes, v_new, v_down, v_size)
    yield from (b_packets, b_bytes, b_new, b_hop2)
    yield from (up, health, admin, weight, eff, share, est)
    if st.cluster is not None and st.cluster.bgp is not None:
        yield from bgp_families(st, st.cluster.bgp)
    if st.cluster is not None and st.cluster.store is not None:
        yield from store_families(st.cluster.store)
    if st.cluster is not None and st.cluster.sync is not None:
        yield from sync_families(st.cluster.sync)
    if st.socket_lb is not None:
        yield from socket_lb_families(st.socket_lb)


def bgp_families(st: Status, cl: BgpStatus) -> Iterator[Metric]:
    """With a bgp section: what the node announces, its sessions, its self-checks."""
    announced = GaugeMetricFamily(
        "xdplb_bgp_announced",
        "1 if the node announces the VIP address over BGP now",
        labels=["address"],
    )
    for addr in sorted({v.address for v in st.vips}):
        announced.add_metric([addr], int(addr in cl.announced))
    sessions = GaugeMetricFamily(
        "xdplb_bgp_session_established",
        "1 if the BGP session with the peer is established",
        labels=["peer"],
    )
    for s in cl.sessions:
        sessions.add_metric([s.peer], int(s.established))
    yield announced
    yield sessions
    yield GaugeMetricFamily(
        "xdplb_bgp_announcing",
        "1 while the node announces its VIPs (its self-check passes, it is not stopping)",
        int(not cl.withdrawn_because),
    )
    yield CounterMetricFamily(
        "xdplb_self_checks", "Self-checks run since the daemon started", cl.self_checks
    )
    yield CounterMetricFamily(
        "xdplb_self_check_failures", "Self-checks that failed", cl.self_check_failures
    )


def store_families(store: StoreStatus) -> Iterator[Metric]:
    """With a cluster section: the fleet's store as this node sees it."""
    yield GaugeMetricFamily(
        "xdplb_store_connected", "1 while the fleet's store (etcd) answers", int(store.connected)
    )
    if store.revision is not None:
        yield GaugeMetricFamily(
            "xdplb_store_revision",
            "The revision of the fleet's document this node serves",
            store.revision,
        )
    yield GaugeMetricFamily(
        "xdplb_fleet_nodes",
        "Nodes whose report is in the store (this one included)",
        len(store.nodes),
    )
    differ = GaugeMetricFamily(
        "xdplb_fleet_tables_differ",
        "VIPs whose table digest on the node differs from this node's",
        labels=["node"],
    )
    for n in store.nodes:
        differ.add_metric([n.node], len(n.tables_differ))
    yield differ


def sync_families(sync: SyncStatus) -> Iterator[Metric]:
    """With a sync section: is the node synced, with whom, what it sent, took, refused."""
    yield GaugeMetricFamily(
        "xdplb_sync_ready",
        "1 once every peer that answered gave a full copy that matched (the node may announce)",
        int(sync.ready),
    )
    synced = GaugeMetricFamily(
        "xdplb_sync_peer_synced",
        "1 while this node follows the peer's sessions after a matching full copy",
        labels=["peer"],
    )
    copies = CounterMetricFamily(
        "xdplb_sync_copies", "Full copies taken from the peer that matched", labels=["peer"]
    )
    failures = CounterMetricFamily(
        "xdplb_sync_copy_failures",
        "Full copies from the peer that did not match or timed out (asked for again)",
        labels=["peer"],
    )
    received = CounterMetricFamily(
        "xdplb_sync_received_entries", "Entries received from the peer", labels=["peer"]
    )
    imported = CounterMetricFamily(
        "xdplb_sync_imported_entries",
        "Entries from the peer written into this node's session table",
        labels=["peer"],
    )
    for p in sync.peers:
        synced.add_metric([p.node], int(p.state == "synced"))
        copies.add_metric([p.node], p.copies)
        failures.add_metric([p.node], p.copy_failures)
        received.add_metric([p.node], p.received)
        imported.add_metric([p.node], p.imported)
    yield from (synced, copies, failures, received, imported)
    yield CounterMetricFamily(
        "xdplb_sync_sent_entries", "Entries sent to subscribers (once to each)", sync.sent
    )
    yield GaugeMetricFamily(
        "xdplb_sync_subscribers", "Peers that follow this node's sessions", len(sync.subscribers)
    )
    outcomes = CounterMetricFamily(
        "xdplb_sync_import_outcomes",
        "Entries from peers by what their import did (evicted: the table is too small)",
        labels=["outcome"],
    )
    for outcome, n in sorted(sync.imported.items()):
        outcomes.add_metric([outcome], n)
    yield outcomes
    refused = CounterMetricFamily(
        "xdplb_sync_refused_messages",
        "Messages refused (never imported), by reason",
        labels=["reason"],
    )
    for reason, n in sorted(sync.refused.items()):
        refused.add_metric([reason], n)
    yield refused
    skipped = CounterMetricFamily(
        "xdplb_sync_skipped_entries", "Entries received and not imported, by why", labels=["why"]
    )
    for why, n in sorted(sync.skipped.items()):
        skipped.add_metric([why], n)
    yield skipped
    yield CounterMetricFamily(
        "xdplb_sync_overflows",
        "Subscribers dropped for falling too far behind",
        sync.overflows,
    )


def socket_lb_families(sl: SocketLbStatus) -> Iterator[Metric]:
    """With a socket_lb section: sock_lb's hooks, each VIP's backends in its tables, and
    its counters."""
    yield GaugeMetricFamily(
        "xdplb_socklb_attached",
        "1 if every sock_lb hook is attached to the socket_lb cgroup",
        int(sl.attached),
    )
    backends = GaugeMetricFamily(
        "xdplb_socklb_backends", "Backends of the VIP sock_lb balances", labels=["vip"]
    )
    up = GaugeMetricFamily(
        "xdplb_socklb_backends_up",
        "Backends that own buckets of the VIP's table in sock_lb's maps (up, with a weight)",
        labels=["vip"],
    )
    for s in sl.services:
        backends.add_metric([s.name], s.backends)
        up.add_metric([s.name], s.backends_up)
    yield from (backends, up)
    events = CounterMetricFamily(
        "xdplb_socklb_events",
        "Outcomes sock_lb counted, by name (connect, sendmsg: rewrites; no_backend: refused)",
        labels=["event"],
    )
    for event, n in sorted(sl.events.items()):
        events.add_metric([event], n)
    yield events


class Metrics:
    """The daemon's registry: the status collector plus what is recorded as it happens."""

    def __init__(self, ctl: Controller) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatusCollector(ctl))
        self.rebuild_seconds = Histogram(
            "xdplb_table_rebuild_seconds",
            "Seconds a plan that changed the maps took, from planning to the last update",
            buckets=REBUILD_BUCKETS,
            registry=self.registry,
        )
        self.rebuilds = Counter(
            "xdplb_table_rebuilds",
            "Plans that changed the maps since the daemon started",
            registry=self.registry,
        )

    def observe_rebuild(self, seconds: float) -> None:
        """Record one rebuild (the daemon calls this after each plan it applied)."""
        self.rebuild_seconds.observe(seconds)
        self.rebuilds.inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series (calls ``ctl.status()``)."""
        return generate_latest(self.registry)
