"""The running instance: what it was told, what it observes, and what the maps hold.

:class:`Runtime` implements :class:`~xdplb.control.interface.Controller` for the daemon. It holds

- the running configuration (the file's, plus changes made through the API) and the
  file's own, to tell whether the two differ;
- operator state: drained backends, kept in ``/run/xdplb/<instance>.admin.json`` so a
  daemon restart does not bring a drained backend back;
- observed state: health (from :mod:`xdplb.health`), open connections and host_tc
  counters (from the agents), load feedback;

and turns them into map operations: configuration -> load feedback -> overlay (down and
drained backends out, :mod:`xdplb.control.overlay`) -> planner -> maps. It does no waiting and
owns no event loop: the daemon calls it from its loop.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path

import yaml

from xdplb.config import (
    Config,
    Protocol,
    TableKindName,
    VipConfig,
    XdpModeName,
    check_limits_unchanged,
    fleet_config,
    load_config,
)
from xdplb.control import beamer_share, planner
from xdplb.control.caller import caller
from xdplb.control.diff import diff, dropped
from xdplb.control.drain import ConnectionCounts, Count, PacketIdle, drain_done, udp_drain_done
from xdplb.control.interface import ChangeResult, DrainStatus, ReloadRefused, VipRef
from xdplb.control.overlay import Effective, Member, Overlay, effective
from xdplb.control.sessions import ConnectionPage, ConnectionQuery, SessionCount, counts, page
from xdplb.control.status import (
    Admin,
    BackendView,
    BgpStatus,
    ClusterStatus,
    Counts,
    DaemonView,
    Health,
    MapsView,
    SocketLbStatus,
    Status,
    StoreStatus,
    SyncStatus,
    Traffic,
    VipView,
    build,
)
from xdplb.control.vip_weights import WeightFeedback
from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress
from xdplb.core.errors import ConfigError, XdplbError
from xdplb.core.mapops import DeleteTable, PutTable
from xdplb.core.reports import LoadReport
from xdplb.core.state import Snapshot
from xdplb.datapath import XdpMode, clock, hooks, layout, rcu
from xdplb.datapath.hooks import Hook
from xdplb.datapath.lb import LbDatapath, MapFill, check_pins
from xdplb.datapath.upgrade import Upgrade, describe, new_maps_of
from xdplb.health import HealthMonitor
from xdplb.health.targets import HealthTargets
from xdplb.tables.beamer import BeamerTable

log = logging.getLogger("xdplb.control.runtime")


class Runtime:
    """One LB instance's state and the changes it accepts (see the module docstring)."""

    def __init__(self, config_path: Path, run_dir: Path) -> None:
        self.config_path = config_path
        #: The file as last loaded; with a store, the fleet's document goes over it.
        self.local_config: Config = load_config(config_path)  # ConfigError: refuse to start
        #: The desired configuration from its sources: the file, and the fleet's document
        #: (docs/cluster.md, "Fleet state") as last applied (:meth:`apply_fleet`).
        self.file_config: Config = self.local_config
        self.fleet_text: bytes | None = None
        self.running = self.file_config
        #: Why the last reload was refused; None once one applies.
        self.last_reload_error: str | None = None
        self.instance = self.running.instance
        self.admin_path = paths.under(run_dir, f"{self.instance}.admin.json")
        self.started = time.monotonic()
        obj = paths.bpf_object("lb_xdp")
        version = layout.object_version(obj)
        # Pinned maps of another size: refused here, naming the field, before loading.
        check_pins(self.instance, self.running.limits, version)
        #: Pins of another layout to migrate (docs/operations.md, "Upgrades"), checked
        #: before anything is loaded: UpgradeRefused says why and what to do.
        self.upgrade = Upgrade.prepare(self.instance, version)
        #: What the upgrade did, a line per pass (the status says it).
        self.upgrade_report: list[str] = []
        fresh = not (paths.layout_dir(self.instance, version) / layout.MARKER).exists()
        try:
            self.dp = LbDatapath(self.instance, obj, lim=self.running.limits)
        except BaseException:
            if self.upgrade is not None:
                self.upgrade.close()
            if fresh:  # this start's pins only: a previous run's are kept
                layout.remove_layout(self.instance, version)
            raise
        #: The kernel's HZ: the session clock's ticks per second (timeouts are in ticks).
        self.hz = clock.hz()
        #: Beamer tables as last built, by vip id (the maps hold hops, not history).
        self.memory: dict[int, planner.BeamerMemory] = {}
        #: Another node of the fleet steps the Beamer tables: serve the ones adopted from
        #: the store (:meth:`adopt_beamer`) as they are.
        self.beamer_follow = False
        #: Wall-clock time of each Beamer table's last change, by vip id (for the store),
        #: and each table as last encoded for it.
        self.beamer_at: dict[int, float] = {}
        self._beamer_encoded: dict[int, tuple[BeamerTable, bytes]] = {}
        self.feedback: WeightFeedback | None = None
        #: Some Beamer table still has steps to take (see planner.beamer_pending).
        self.beamer_pending = False
        #: lb_xdp's maps as the last apply left them (None before the first).
        self.applied: Snapshot | None = None
        #: Drained (or draining) members, with when the drain began (monotonic).
        self.drains: dict[Member, float] = self._load_admin()
        #: Members this node's own health checks see down.
        self.down: set[Member] = set()
        #: With a fleet store: the members the live nodes agree are down (a majority of
        #: their reports, xdplb.cluster.store.agreed_down), what tables are built from;
        #: None: this node's own view (no store, or the store is unreachable).
        self.agreed_down: frozenset[Member] | None = None
        self.last_live: dict[str, dict[IPAddress, int]] = {}
        self.all_down: set[str] = set()
        self.counts = ConnectionCounts()
        self.idle = PacketIdle()
        self.health = HealthMonitor(self._on_health)
        self.targets = HealthTargets(self.instance)
        #: Set by the daemon: called when something changed that needs a new plan.
        self.wake: Callable[[], None] = lambda: None
        #: Set by the daemon: called when this node's own checks change their verdict (the
        #: fleet's store hears of it at once).
        self.on_local_health: Callable[[], None] = lambda: None
        #: Set by the daemon: the node's BGP view (with a bgp section) and its view of
        #: the fleet's store (with a cluster section), for the status.
        self.bgp_view: Callable[[], BgpStatus | None] = lambda: None
        self.store_view: Callable[[], StoreStatus | None] = lambda: None
        self.sync_view: Callable[[], SyncStatus | None] = lambda: None
        #: Set by the daemon: sock_lb's view (with a socket_lb section), for the status.
        self.socket_lb_view: Callable[[], SocketLbStatus | None] = lambda: None
        #: Interface -> why it runs at its hook (xdplb status).
        self.hook_why: dict[str, str] = {}
        self.dirty = False
        self.rebuilds = 0
        self.last_rebuild_ms: float | None = None
        #: Called with the seconds each plan that changed the maps took (metrics).
        self.on_rebuild: Callable[[float], None] = lambda seconds: None
        #: Set by the daemon: called after every apply with what the tables were built
        #: from (weights less down and drained backends), so that socket-level
        #: balancing follows the XDP tier's tables and health.
        self.on_planned: Callable[[Effective], None] = lambda eff: None

    # -- applying ------------------------------------------------------------------------

    def start(self) -> int:
        """The daemon's first apply. With pins of another layout (an upgrade): the plan
        into the new maps, the sessions copied while the old program still forwards,
        the new program swapped into the links, an RCU grace period (no run of the old
        program is left), the sessions it recorded meanwhile copied, then the old pins
        removed. A failure before the swap removes the new pins again (if this start
        made them) and leaves the old program attached and forwarding."""
        up = self.upgrade
        if up is None:
            return self.apply()
        try:
            n = self.apply(attach=False)
            self._copy_sessions(up, "pass 1")
            carried = up.carry_counters(self.dp.maps)  # before the new program counts
            log.info("upgrade: %d event and drop counters carried over", carried)
        except BaseException:
            self._abandon_upgrade()
            raise
        self._attach(self.running)
        rcu.synchronize()
        self._copy_sessions(up, "pass 2")
        removed = up.remove_old()
        self.upgrade = None
        froms = ", ".join(paths.layout_name(v) for v in up.from_versions)
        log.info(
            "upgraded instance %s from layout %s to %s: %d old pins removed",
            self.instance,
            froms,
            paths.layout_name(self.dp.abi_version),
            removed,
            extra={"from": froms, "to": paths.layout_name(self.dp.abi_version)},
        )
        self.upgrade_report = describe(up.passes)
        return n

    def _copy_sessions(self, up: Upgrade, what: str) -> None:
        snap = self.dp.snapshot()
        backends = {i: (b.addr, b.active, b.gen) for i, b in snap.backends.items()}
        cfg = snap.config
        new = new_maps_of(backends, cfg.seed, cfg.conn_gen, cfg.conn_timeouts)
        up.copy(self.dp.conns, new, what)

    def _abandon_upgrade(self) -> None:
        """A start that failed before the swap: the old pins stay, the new ones go."""
        if self.upgrade is not None:
            self.upgrade.close()
            self.upgrade = None
        if self.dp.fresh:
            removed = self.dp.unpin()
            log.warning(
                "upgrade abandoned: %d new pins of %s removed; the old program keeps forwarding",
                removed,
                paths.layout_name(self.dp.abi_version),
            )

    def _attach(self, cfg: Config) -> None:
        mode = XdpMode.GENERIC if cfg.xdp_mode is XdpModeName.GENERIC else XdpMode.NATIVE
        for iface in cfg.interfaces:
            choice = hooks.choose(iface.name, iface.hook)
            self.hook_why[iface.name] = choice.why
            if self.dp.attach(iface.name, choice.hook, mode):
                how = f"xdp {cfg.xdp_mode}" if choice.hook is Hook.XDP else "tc ingress"
                log.info(
                    "attached %s to %s (%s; %s)", choice.hook.program, iface.name, how, choice.why
                )
        for ifname in self.dp.attached():
            if ifname not in cfg.ifnames:
                self.dp.detach(ifname)
                self.hook_why.pop(ifname, None)
                log.info("detached the balancer from %s", ifname)

    def apply(self, cfg: Config | None = None, *, attach: bool = True) -> int:
        """Make interfaces, maps and health checks match ``cfg`` (default: the running
        configuration); returns the number of map operations. ``attach=False``: the
        interfaces are left as they are (:meth:`start` swaps the program in later)."""
        cfg = cfg or self.running
        # Before anything changes: the maps' sizes are fixed, and what the change needs
        # on the way must fit them.
        check_limits_unchanged(self.running.limits, cfg.limits)
        # Nothing below writes lb_xdp's maps before the plan: one snapshot serves both.
        snap = self.dp.snapshot()
        planner.check_capacity(cfg, snap)
        for i, ifname in enumerate(cfg.ifnames):
            try:
                socket.if_nametoindex(ifname)
            except OSError:
                raise ConfigError(f"interfaces[{i}]", f"no interface {ifname!r} here") from None
        self.dirty = False
        if attach:
            self._attach(cfg)
        self._follow_feedback(cfg)
        self.health.set_targets(self.targets.update(cfg))
        members = {(v.name, b.address) for v in cfg.vips for b in v.backends}
        self.down &= members
        if self.agreed_down is not None:
            self.agreed_down &= members
        if self.drains.keys() - members:
            self.drains = {m: t for m, t in self.drains.items() if m in members}
            self._save_admin()
        weighted = self.feedback.effective(cfg) if self.feedback is not None else cfg
        eff = effective(weighted, Overlay(self._down(), frozenset(self.drains)), self.last_live)
        for name in eff.all_down - self.all_down:
            log.warning(
                "VIP %s: every backend is down, keeping its last table", name, extra={"vip": name}
            )
        self.last_live, self.all_down = eff.last_live, eff.all_down
        wanted = eff.config
        now = time.monotonic()
        ops = planner.plan(
            wanted,
            snap,
            now=now,
            memory=self.memory,
            members=eff.members,
            hz=self.hz,
            holding=self._holding(wanted, snap),
            follow=self.beamer_follow,
        )
        t0 = time.perf_counter()
        self.dp.apply(ops)
        for op in ops:
            if isinstance(op, planner.PutBeamerTable):
                self.memory[op.vip_id] = planner.BeamerMemory(op.beamer_table, now)
                self.beamer_at.setdefault(op.vip_id, time.time())
                if not self.beamer_follow:
                    self.beamer_at[op.vip_id] = time.time()
            elif isinstance(op, PutTable | DeleteTable):
                self.memory.pop(op.vip_id, None)
        if ops:
            took = time.perf_counter() - t0
            self.rebuilds += 1
            self.last_rebuild_ms = 1e3 * took
            self.on_rebuild(took)
            log.debug("applied %d map operations in %.1f ms", len(ops), 1e3 * took)
        self.applied = planner.apply_to_snapshot(snap, ops)
        self.beamer_pending = planner.beamer_pending(wanted, self.applied)
        self.running = cfg
        self.on_planned(eff)
        return len(ops)

    def _follow_feedback(self, cfg: Config) -> None:
        if cfg.load_feedback is None:
            self.feedback = None
            return
        if self.feedback is None:
            self.feedback = WeightFeedback(cfg.load_feedback)
        self.feedback.configure(cfg)

    def _on_health(self, key: Hashable, up: bool) -> None:
        member: Member = key  # type: ignore[assignment]
        state = self.health.state(key)
        detail = state.last_detail if state is not None else ""
        health = "up" if up else "down"
        log.log(
            logging.INFO if up else logging.WARNING,
            "VIP %s: backend %s is %s: %s",
            member[0],
            member[1],
            health,
            detail,
            extra={"vip": member[0], "backend": str(member[1]), "health": health, "reason": detail},
        )
        if up:
            self.down.discard(member)
        else:
            self.down.add(member)
        self.dirty = True
        self.wake()
        self.on_local_health()

    def beamer_tables(self) -> dict[str, bytes]:
        """The Beamer tables as built here, by VIP name, for the fleet's store
        (:mod:`xdplb.control.beamer_share`)."""
        snap = self.applied
        if snap is None:
            return {}
        addr_of = {i: b.addr for i, b in snap.backends.items()}
        out = {}
        for vip in self.running.vips:
            params = snap.vips.get(planner.vip_key(vip))
            if params is None or (mem := self.memory.get(params.vip_id)) is None:
                continue
            cached = self._beamer_encoded.get(params.vip_id)
            if cached is None or cached[0] is not mem.table:
                at = self.beamer_at.get(params.vip_id, 0.0)
                cached = (mem.table, beamer_share.encode(mem.table, addr_of, at))
                self._beamer_encoded[params.vip_id] = cached
            out[vip.name] = cached[1]
        return out

    def adopt_beamer(self, tables: Mapping[str, bytes], *, follow: bool) -> None:
        """The Beamer tables of the fleet's store, by VIP name: each becomes this node's
        memory of its VIP's table (the next plan serves it). ``follow``: another node
        steps them, so serve them as they are; else (this node steps them from now on)
        step on from them."""
        self.beamer_follow = follow
        snap = self.applied
        if snap is None:
            return
        # Active slots first: an address back after a removal has its old slot too.
        id_of: dict[IPAddress, int] = {}
        for i, b in sorted(snap.backends.items(), key=lambda ib: not ib[1].active):
            id_of.setdefault(b.addr, i)
        changed = False
        now = time.monotonic()
        for vip in self.running.vips:
            raw = tables.get(vip.name)
            params = snap.vips.get(planner.vip_key(vip))
            if raw is None or params is None or vip.table is not TableKindName.BEAMER:
                continue
            got = beamer_share.decode(raw, id_of)
            if got is None:
                continue
            table, at = got
            mem = self.memory.get(params.vip_id)
            if mem is None or mem.table != table:
                # Its age on this node's clock: the interval to the next step holds.
                self.memory[params.vip_id] = planner.BeamerMemory(
                    table, now - max(0.0, time.time() - at), adopted=True
                )
                self.beamer_at[params.vip_id] = at
                changed = True
        if changed:
            self.dirty = True
            self.wake()

    def _down(self) -> frozenset[Member]:
        return frozenset(self.down) if self.agreed_down is None else self.agreed_down

    def local_health(self) -> dict[str, dict[str, bool]]:
        """What this node's checks see: VIP name -> backend address -> up, for every
        member checked at least once (what it publishes to the fleet's store)."""
        out: dict[str, dict[str, bool]] = {}
        for vip in self.running.vips:
            for b in vip.backends:
                hs = self.health.state((vip.name, b.address))
                if hs is not None and hs.checked:
                    out.setdefault(vip.name, {})[str(b.address)] = hs.up
        return out

    def set_agreed_down(self, down: frozenset[Member] | None) -> None:
        """The fleet's agreed view of which members are down (None: back to this node's
        own); a change is planned at once."""
        if down == self.agreed_down:
            return
        before, after = self._down(), (frozenset(self.down) if down is None else down)
        self.agreed_down = down
        for vip, addr in sorted(after - before, key=str):
            log.warning("VIP %s: backend %s is down by the fleet's agreement", vip, addr)
        for vip, addr in sorted(before - after, key=str):
            log.info("VIP %s: backend %s is up by the fleet's agreement", vip, addr)
        if before != after:
            self.dirty = True
            self.wake()

    def on_reports(self, reports: Sequence[LoadReport], now: float) -> None:
        """Reports from the agents: open connections, and load for load feedback. Only
        configured backends' reports are kept (they are not authenticated)."""
        known = {str(a) for a in self.running.backend_addresses()}
        reports = [r for r in reports if r.backend in known]
        for r in reports:
            self.counts.observe(r, r.at)
        if self.feedback is not None and self.feedback.step(now, reports):
            self.dirty = True  # new weights from the backends' load

    def close(self) -> None:
        if self.upgrade is not None:  # never started: the old pins stay as they were
            self.upgrade.close()
        self.targets.close()
        self.dp.close()

    # -- the Controller ------------------------------------------------------------------

    def config(self) -> Config:
        return self.running

    def replace_config(self, cfg: Config, *, persist: bool) -> ChangeResult:
        if cfg.instance != self.instance:
            raise ConfigError(
                "instance", f"cannot change while running ({self.instance} -> {cfg.instance})"
            )
        old = self.running
        n = self.apply(cfg)
        if persist:
            self._write_file(cfg)
        self._log_changes(f"change by {caller()}" + (" (persisted)" if persist else ""), old, cfg)
        return self._result(n, persist)

    def reload(self, *, force: bool = False) -> ChangeResult:
        """Re-read the file and apply it. ConfigError if the file is refused,
        ReloadRefused if it would drop changes made through the API (unless ``force``):
        either way nothing changed, and :attr:`last_reload_error` says why."""
        who = caller()
        try:
            local = load_config(self.config_path)
            self._check_restartless(local)
            cfg = self._with_fleet(local)
            lost = dropped(self.file_config, self.running, cfg)
            if lost and not force:
                raise ReloadRefused(lost)
            old = self.running
            n = self.apply(cfg)  # a refused file changes nothing, file_config included
        except ReloadRefused as e:
            self.last_reload_error = str(e)
            log.warning("reload (%s): %s", who, e, extra={"who": who, "dropped": e.dropped})
            raise
        except ConfigError as e:
            self.last_reload_error = f"{self.config_path}: {e}"
            log.error(
                "reload (%s) refused, still serving the previous configuration: %s",
                who,
                self.last_reload_error,
                extra={"who": who, "field": e.field},
            )
            raise
        self.local_config, self.file_config = local, cfg
        self.last_reload_error = None
        for line in lost:
            log.warning("reload (%s, forced): %s", who, line, extra={"who": who})
        self._log_changes(f"reload ({who})", old, cfg)
        return self._result(n, False)

    def _check_restartless(self, cfg: Config) -> None:
        """ConfigError unless ``cfg`` keeps what only a restart can change."""
        if cfg.instance != self.instance:
            raise ConfigError(
                "instance", f"cannot change while running ({self.instance} -> {cfg.instance})"
            )
        if (cfg.bgp is None) != (self.running.bgp is None):
            # BIRD is started with the daemon's every capability, at start only.
            raise ConfigError("bgp", "adding or removing it needs a restart")
        if cfg.cluster != self.running.cluster:
            raise ConfigError("cluster", "changing the store needs a restart")
        if cfg.sync != self.running.sync:
            raise ConfigError("sync", "changing session sync needs a restart")
        old_sl, new_sl = self.running.socket_lb, cfg.socket_lb
        if (old_sl and old_sl.cgroup) != (new_sl and new_sl.cgroup):
            # Attached to its cgroup at start, with the daemon's every capability.
            raise ConfigError("socket_lb.cgroup", "adding, removing or moving it needs a restart")

    def _with_fleet(self, local: Config) -> Config:
        """``local`` with the fleet's document over it, when there is one."""
        if local.cluster is None or self.fleet_text is None:
            return local
        return fleet_config(local, self.fleet_text, f"{local.cluster.store} document")

    def apply_fleet(self, text: bytes, revision: int) -> str | None:
        """Serve the fleet's document ``text``, revision ``revision`` of the store, over the
        file: None once applied, else why it was refused (the running configuration keeps
        serving). Changes made through the API and not persisted are dropped: the store
        says what the fleet serves."""
        what = f"store revision {revision}"
        local = self.local_config
        try:
            assert local.cluster is not None
            cfg = fleet_config(local, text, f"{local.cluster.store} revision {revision}")
            old = self.running
            n = self.apply(cfg)
        except XdplbError as e:  # a bad document, or one the maps cannot take
            log.error("%s refused, still serving the previous configuration: %s", what, e)
            return str(e)
        for line in dropped(self.file_config, old, cfg):
            log.warning("%s: %s", what, line)
        self.file_config, self.fleet_text = cfg, text
        self._log_changes(what, old, cfg)
        log.info("%s applied: %d map operations", what, n)
        return None

    def _log_changes(self, what: str, old: Config, new: Config) -> None:
        """One line per change from ``old`` to ``new`` (or one saying there was none)."""
        who = caller()
        changes = diff(old, new)
        if not changes:
            log.info("%s: no change", what, extra={"who": who})
        for c in changes:
            fields = {"who": who, "change": str(c)}
            fields |= {k: v for k, v in (("vip", c.vip), ("backend", c.backend)) if v is not None}
            log.info("%s: %s", what, c, extra=fields)

    def _result(self, n: int, persisted: bool) -> ChangeResult:
        return ChangeResult(
            operations=n, persisted=persisted, runtime_changes=self.running != self.file_config
        )

    def _write_file(self, cfg: Config) -> None:
        doc = cfg.model_dump(mode="json", exclude_defaults=True)
        tmp = self.config_path.with_name(f".{self.config_path.name}.tmp")
        tmp.write_text(
            "# Written by xdplb (API change with persist=true); comments are not kept.\n"
            + yaml.safe_dump(doc, sort_keys=False)
        )
        tmp.replace(self.config_path)  # atomic: a reader never sees half a file
        self.file_config = cfg

    def config_file_mtime(self) -> float:
        try:
            return self.config_path.stat().st_mtime
        except OSError:
            return 0.0

    def _member(self, vip: VipRef, backend: IPAddress) -> Member:
        for v in self.running.vips:
            if v.name == vip.name:
                if any(b.address == backend for b in v.backends):
                    return (v.name, backend)
                raise KeyError(f"VIP {vip.name} has no backend {backend}")
        raise KeyError(f"no VIP {vip.name}")

    def drain(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        member = self._member(vip, backend)
        if member not in self.drains:
            self.drains[member] = time.monotonic()
            self._save_admin()
            self._log_admin(member, "draining")
            self.apply()
        return self.drain_status(vip, backend)

    def enable(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        member = self._member(vip, backend)
        if self.drains.pop(member, None) is not None:
            self._save_admin()
            self._log_admin(member, "enabled")
            self.apply()
        return self.drain_status(vip, backend)

    @staticmethod
    def _log_admin(member: Member, admin: str) -> None:
        who = caller()
        log.info(
            "VIP %s: backend %s %s (by %s)",
            member[0],
            member[1],
            admin,
            who,
            extra={"vip": member[0], "backend": str(member[1]), "admin": admin, "who": who},
        )

    def _established(self, vip: VipConfig | VipRef, backend: IPAddress) -> Count | None:
        """Open connections of ``vip`` on ``backend`` (UDP: connected sockets), as its
        agent last reported them; None when unknown."""
        if vip.protocol is not Protocol.TCP:
            return self.counts.udp_flows(backend, vip.address, vip.port)
        return self.counts.established(backend, vip.address, vip.port)

    def _drain_done(self, member: Member) -> tuple[bool | None, float | None]:
        """Whether ``member``'s drain is over, and (UDP) for how long within it no
        packet went to the backend (control.drain says when each is done)."""
        since = self.drains.get(member)
        vip = next(v for v in self.running.vips if v.name == member[0])
        if since is None:
            return None, None
        count = self._established(vip, member[1])
        if vip.protocol is Protocol.TCP:
            return drain_done(count, since), None
        now = time.monotonic()
        snap = self.applied or self.dp.snapshot()
        ids = [i for i, b in snap.backends.items() if b.addr == member[1]]
        packets = sum(self.dp.stats("lb_be_stats", i).packets for i in ids)
        idle_since = self.idle.observe(member[1], packets, now)
        done = udp_drain_done(count, since, idle_since, now, vip.udp_drain_idle)
        return done, now - max(idle_since, since)

    def drain_status(self, vip: VipRef, backend: IPAddress) -> DrainStatus:
        member = self._member(vip, backend)
        count = self._established(vip, backend)
        done, idle = self._drain_done(member)
        return DrainStatus(
            vip=vip.name,
            backend=str(backend),
            admin=self._admin(member, done),
            established=count.value if count is not None else None,
            done=done,
            idle=idle,
        )

    def _admin(self, member: Member, done: bool | None = None) -> Admin:
        if member not in self.drains:
            return "enabled"
        return "drained" if (done or self._drain_done(member)[0]) else "draining"

    def _load_admin(self) -> dict[Member, float]:
        try:
            doc = json.loads(self.admin_path.read_text())
            now = time.monotonic()
            # The drain clock restarts with the daemon: "done" needs a report after this.
            return {(v, ipaddress.ip_address(a)): now for v, a in doc.get("drained", [])}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError) as e:
            log.error("ignoring %s: %s", self.admin_path, e)
            return {}

    def _save_admin(self) -> None:
        doc = {"drained": sorted([v, str(a)] for v, a in self.drains)}
        self.admin_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.admin_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, self.admin_path)

    def connections(self, query: ConnectionQuery, *, cursor: int, limit: int) -> ConnectionPage:
        return page(self.dp.conns, self.dp.snapshot(), query, cursor=cursor, limit=limit)

    def session_counts(self) -> list[SessionCount]:
        return counts(self.dp.conns, self.dp.snapshot())

    # -- status --------------------------------------------------------------------------

    def status(self) -> Status:
        snap = self.dp.snapshot()
        counters = self.dp.counters(exact_conns=False, snap=snap)
        tunnel = self.targets.tunnel
        hc_targets = MapFill(
            "hc_targets",
            tunnel.maps["hc_targets"].count() if tunnel is not None else 0,
            self.running.limits.hc_targets,
        )
        maps = MapsView(
            instance=self.instance,
            snapshot=snap,
            counters=counters,
            conns_estimated=True,
            fill=[*self.dp.fill(snap, conns_used=counters.conns), hc_targets],
            attached=self.dp.attached(),
            conn_capacity=self.dp.conn_capacity,
        )
        return build(maps, self._daemon_view())

    def _holding(self, cfg: Config, snap: Snapshot) -> dict[str, set[IPAddress]]:
        """Per Beamer VIP, the backend addresses (every slot, a departed backend's too)
        that may hold its connections: their agent counts some, or no agent reports on
        them (docs/design.md, "Beamer": a hop that may hold connections of a bucket is
        never pushed off its list)."""
        addrs = {b.addr for b in snap.backends.values()}
        out: dict[str, set[IPAddress]] = {}
        for vip in cfg.vips:
            if vip.table is not TableKindName.BEAMER:
                continue
            count = (
                self.counts.established if vip.protocol is Protocol.TCP else self.counts.udp_flows
            )
            out[vip.name] = {
                a for a in addrs if (c := count(a, vip.address, vip.port)) is None or c.value > 0
            }
        return out

    def cluster(self) -> ClusterStatus | None:
        bgp, store, sync = self.bgp_view(), self.store_view(), self.sync_view()
        if bgp is None and store is None and sync is None:
            return None
        return ClusterStatus(bgp=bgp, store=store, sync=sync)

    def traffic(self) -> Traffic:
        """The VIPs' and backends' counters alone, for the rate history: a few lookups
        where :meth:`status` reads every map (tens of ms at default sizes)."""
        snap = self.applied or self.dp.snapshot()
        found = {(v.addr, v.port, v.proto): p.vip_id for v, p in snap.vips.items()}
        ids = {b.addr: i for i, b in snap.backends.items() if b.active}
        vips: dict[str, Counts] = {}
        backends: dict[str, Counts] = {}
        for vip in self.running.vips:
            vid = found.get((vip.address, vip.port, vip.protocol.number))
            s = self.dp.stats("lb_vip_stats", vid) if vid is not None else abi.Stats()
            vips[vip.name] = (s.packets, s.bytes, s.new_flows)
            for b in vip.backends:
                bid = ids.get(b.address)
                if str(b.address) not in backends:
                    s = self.dp.stats("lb_be_stats", bid) if bid else abi.Stats()
                    backends[str(b.address)] = (s.packets, s.bytes, s.new_flows)
        return Traffic(vips, backends)

    def _daemon_view(self) -> DaemonView:
        """What the status says that the maps do not: configuration, health, drains,
        agents' reports, weights."""
        weighted = self.feedback.effective(self.running) if self.feedback else self.running
        eff = effective(
            weighted, Overlay(self._down(), frozenset(self.drains)), self.last_live
        ).config
        now = time.monotonic()
        vips = []
        for vip, vip_w, vip_e in zip(self.running.vips, weighted.vips, eff.vips, strict=True):
            backends = []
            for b, bw, be in zip(vip.backends, vip_w.backends, vip_e.backends, strict=True):
                member = (vip.name, b.address)
                hs = self.health.state(member)
                health: Health = "unchecked" if hs is None else ("up" if hs.up else "down")
                count = self._established(vip, b.address)
                chain = self.counts.chain_events(b.address)
                backends.append(
                    BackendView(
                        address=b.address,
                        weight=bw.weight,
                        effective_weight=be.weight,
                        health=health,
                        health_detail=hs.last_detail if hs is not None else "",
                        health_changed_ago=now - hs.since
                        if hs is not None and hs.checked
                        else None,
                        admin=self._admin(member),
                        established=count.value if count is not None else None,
                        inactive=self.counts.inactive(b.address, vip.address, vip.port)
                        if vip.protocol is Protocol.TCP
                        else None,
                        second_hop_forwards=chain.get("forward") if chain is not None else None,
                    )
                )
            vips.append(
                VipView.configured(
                    vip,
                    table_size=self.running.vip_table_size(vip),
                    all_down=vip.name in self.all_down,
                    backends=backends,
                )
            )
        return DaemonView(
            config_path=str(self.config_path),
            runtime_changes=self.running != self.file_config,
            uptime=now - self.started,
            rebuilds=self.rebuilds,
            last_rebuild_ms=self.last_rebuild_ms,
            health_checks=self.health.checks_total,
            vips=vips,
            last_reload_error=self.last_reload_error,
            upgrade=self.upgrade_report,
            hook_why=dict(self.hook_why),
            cluster=self.cluster(),
            socket_lb=self.socket_lb_view(),
        )
