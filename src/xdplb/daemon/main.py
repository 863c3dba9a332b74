"""The LB daemon: load, attach, apply the configuration, keep applying it, and serve
its operators.

Lifecycle (docs/design.md §2):
- start: lb_xdp is loaded with its maps pinned per instance; existing pins are reused, so
  the connection table survives a restart, and existing XDP links are switched to the new
  program atomically;
- reload on SIGHUP, on ``POST /api/v1/reload`` or when the file changes: a configuration
  that fails validation changes nothing (the error names the field) and the running one
  keeps serving; so does one that would drop a change made through the API, unless
  forced (the log names each change it kept);
- SIGTERM/SIGINT: the daemon exits and leaves the programs attached (restart/upgrade);
- ``xdplb stop``: the daemon exits and the instance is detached and unpinned.

One asyncio loop runs everything: the HTTP API (uvicorn, :mod:`xdplb.daemon.api`), the health
checks (:mod:`xdplb.health`), the agents' reports, and the changes they cause, which
:class:`~xdplb.control.runtime.Runtime` plans and pushes to the maps between two awaits. A
backend's health changing wakes the loop at once, so a failure reaches the data path
as soon as its check says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import signal
import socket
import stat
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import uvicorn

from xdplb.agent.receiver import ReportReceiver
from xdplb.cluster.announce import Announcer, fence
from xdplb.cluster.bird import BirdError
from xdplb.cluster.selfcheck import self_check
from xdplb.cluster.store import FleetMember, NodeReport, table_digests
from xdplb.config import ApiConfig
from xdplb.config.load import api_token
from xdplb.control.caller import acting_for
from xdplb.control.interface import ReloadRefused
from xdplb.control.runtime import Runtime
from xdplb.core import paths
from xdplb.core.errors import ConfigError, XdplbError
from xdplb.daemon import privileges
from xdplb.daemon.api import create_app
from xdplb.daemon.history import History
from xdplb.daemon.logs import CallerMiddleware
from xdplb.daemon.metrics import Metrics
from xdplb.daemon.serving import server_options
from xdplb.daemon.socket_lb import SocketBalancer
from xdplb.datapath.conns import SessionExport
from xdplb.sync.convert import ViewCache
from xdplb.sync.node import SyncNode, SyncSource

log = logging.getLogger("xdplb.daemon.main")

#: How often the configuration file's mtime is looked at.
POLL_INTERVAL = 0.5
#: How often a Beamer table still short of its weights is planned again, so that it
#: reaches a far target in steps, each after its minimum interval.
REPLAN_INTERVAL = 1.0


def read_pid(instance: str) -> int | None:
    """The pid of the running daemon of ``instance``, or None."""
    try:
        pid = int(paths.pid_file(instance).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


def bind_api(api: ApiConfig, instance: str) -> socket.socket:
    """The API's listening socket: a unix socket only root can use, or TCP."""
    if not api.listen or api.listen.startswith("unix:"):
        path = Path(api.listen.removeprefix("unix:")) if api.listen else paths.api_socket(instance)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()  # a previous daemon's (read_pid said none is running)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
    else:
        host, _, port = api.listen.rpartition(":")
        host = host.strip("[]")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _version() -> str:
    try:
        return importlib.metadata.version("xdplb")
    except importlib.metadata.PackageNotFoundError:  # run from a tree that is not installed
        return "unknown"


def api_address(api: ApiConfig, instance: str) -> str:
    """Where the API listens, as the startup line says it."""
    if not api.listen or api.listen.startswith("unix:"):
        path = api.listen.removeprefix("unix:") if api.listen else paths.api_socket(instance)
        return f"unix:{path}"
    return f"http://{api.listen}"


def _socket_file(sock: socket.socket) -> tuple[Path, int] | None:
    """A unix listening socket's path and inode: what to remove at exit, if still ours."""
    if sock.family != socket.AF_UNIX:
        return None
    path = Path(sock.getsockname())
    return path, path.lstat().st_ino


def _remove_socket_file(bound: tuple[Path, int] | None) -> None:
    """Unlink the API socket's path, unless another daemon has bound it since."""
    with contextlib.suppress(FileNotFoundError):
        if bound is not None and bound[0].lstat().st_ino == bound[1]:
            bound[0].unlink()


class _ApiServer(uvicorn.Server):
    """uvicorn without its signal handlers: the daemon owns SIGTERM, SIGINT and SIGHUP."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Daemon:
    """One LB instance, driven by one configuration file and its API."""

    def __init__(self, config_path: Path) -> None:
        self.rt = Runtime(config_path, paths.run_dir())  # ConfigError: refuse to start
        self.metrics = Metrics(self.rt)
        self.rt.on_rebuild = self.metrics.observe_rebuild
        self.history = History()
        self._mtime = self.rt.config_file_mtime()
        self._receiver: ReportReceiver | None = None
        self._receiver_at: tuple[str, int] | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._reload = False
        #: The BGP speaker, with ``bgp`` configured (started by :meth:`serve`).
        self.announcer: Announcer | None = None
        #: Session sync, with ``sync`` configured (started by :meth:`serve`).
        self.sync: SyncNode | None = None
        #: Its key, read while the daemon may still read a root-only file.
        self._sync_key = self.rt.running.sync.secret() if self.rt.running.sync else b""
        #: Socket-level balancing, with ``socket_lb`` configured (started by :meth:`serve`).
        self.socket_lb: SocketBalancer | None = None

    def reload(self, why: str) -> bool:
        """Re-read the file; apply it if valid and it drops no change made through the
        API. False (and nothing changed; the runtime logged why) if not."""
        self._mtime = self.rt.config_file_mtime()
        with acting_for(why):
            try:
                old = self.rt.running.bgp
                self.rt.reload()
            except (ConfigError, ReloadRefused):
                return False
            except XdplbError as e:  # the kernel refused a map operation on the way
                self.rt.last_reload_error = f"applying {self.rt.config_path} failed: {e}"
                log.error(
                    "reload (%s): applying failed, still serving (the maps may be part-way "
                    "there; the next change plans from them): %s",
                    why,
                    e,
                )
                return False
        new, rid = self.rt.running.bgp, self.rt.running.bgp_router_id
        if self.announcer is not None and new is not None and rid is not None and new != old:
            try:
                self.announcer.reconfigure(new, rid)
            except BirdError as e:
                log.error("bgp: the new configuration did not reach BIRD: %s", e)
        return True

    def _follow_agents(self) -> None:
        """Open, move or close the socket agents report to, as the configuration says."""
        agents = self.rt.running.agents
        want = agents.address if agents is not None else None
        if want == self._receiver_at:
            return
        loop = asyncio.get_running_loop()
        if self._receiver is not None:
            loop.remove_reader(self._receiver.fileno())
            self._receiver.close()
            self._receiver, self._receiver_at = None, None
        if want is None:
            return
        try:
            self._receiver = ReportReceiver(want)
        except OSError as e:
            # The balancer serves on without reports; the log says why.
            log.error("agents' reports off: cannot listen on %s: %s", agents.listen, e)  # type: ignore[union-attr]
            return
        self._receiver_at = want
        loop.add_reader(self._receiver.fileno(), self._on_reports)
        log.info("agents' reports: listening on %s", agents.listen)  # type: ignore[union-attr]

    def _on_reports(self) -> None:
        if self._receiver is not None:
            self.rt.on_reports(self._receiver.poll(), time.monotonic())
            if self.rt.dirty:
                self._wake.set()

    def _request_stop(self) -> None:
        self._stop.set()
        self._wake.set()  # now, not at the next poll: a BGP node withdraws at once

    def _request_reload(self) -> None:
        self._reload = True
        self._wake.set()

    async def serve(self) -> None:
        """Serve until SIGTERM/SIGINT. Programs stay attached when this returns."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop)
        self.rt.wake = self._wake.set
        rt = self.rt
        token = api_token(rt.running.api)
        sock = bind_api(rt.running.api, rt.instance)
        sock_file = _socket_file(sock)
        try:
            if (sl := rt.running.socket_lb) is not None:
                # Loaded before the first plan, which fills its maps; attached after it.
                self.socket_lb = SocketBalancer(rt.instance, sl.cgroup)
                rt.on_planned = self.socket_lb.on_planned
                rt.socket_lb_view = self.socket_lb.status
            rt.start()  # an upgrade copies the session table here (docs/operations.md)
            if self.socket_lb is not None:
                self.socket_lb.attach()
            # BIRD binds port 179 and opens BFD sockets: started while we hold every
            # capability, as our child (it dies with us: docs/cluster.md).
            if rt.running.bgp is not None:
                self.announcer = Announcer(
                    rt.running.bgp,
                    rt.running.bgp_router_id,  # type: ignore[arg-type]
                    paths.run_dir() / f"{rt.instance}.bird",
                )
                self.announcer.start()
                rt.bgp_view = self.announcer.state
            if (sync := rt.running.sync) is not None:
                self.sync = SyncNode(
                    sync,
                    rt.running.sync_node,  # type: ignore[arg-type]
                    self._sync_key,
                    SyncSource(
                        rt.dp.conns,
                        SessionExport(rt.dp["lb_sess_export"]),
                        ViewCache(lambda: rt.applied, lambda: rt.running),
                    ),
                )
                if rt.running.cluster is not None and not sync.peers:
                    self.sync.wait_for_fleet()
                try:
                    await self.sync.start()
                except OSError as e:
                    raise ConfigError(
                        "sync.listen", f"cannot listen on {sync.listen}: {e.strerror or e}"
                    ) from None
                rt.sync_view = self.sync.status
        except BaseException:
            if self.sync is not None:
                await self.sync.close()
            if self.announcer is not None:
                self.announcer.close()
            if self.socket_lb is not None:
                self.socket_lb.close()
            sock.close()
            _remove_socket_file(sock_file)
            rt.close()
            raise
        self._follow_agents()
        paths.run_dir().mkdir(parents=True, exist_ok=True)
        # Loaded, attached, bound: what follows needs far less than root's every power.
        privileges.drop_capabilities()
        if stray := privileges.stray_threads():
            log.warning("threads %s kept capabilities the daemon dropped", stray)
        paths.pid_file(rt.instance).write_text(f"{os.getpid()}\n")
        app = CallerMiddleware(
            create_app(rt, token=token, metrics=self.metrics, history=self.history),
            token=token is not None,
        )
        server = _ApiServer(
            uvicorn.Config(
                app,
                log_level="warning",
                log_config=None,  # our handler and format (xdplb.daemon.logs), not uvicorn's
                access_log=False,
                lifespan="off",
                **server_options(rt.running.api),
            )
        )
        tasks = [
            asyncio.create_task(server.serve(sockets=[sock]), name="api"),
            asyncio.create_task(rt.health.run(), name="health"),
        ]
        if self.announcer is not None:
            tasks.append(asyncio.create_task(self._announce(self.announcer), name="bgp"))
        if self.sync is not None:
            tasks.append(asyncio.create_task(self.sync.run(), name="sync"))
        if (cluster := rt.running.cluster) is not None:
            fleet = FleetMember(
                cluster,
                cluster.node or rt.instance,
                rt.apply_fleet,
                self._report,
                agree=rt.set_agreed_down,
                tables=rt.beamer_tables,
                adopt=lambda tables, follow: rt.adopt_beamer(tables, follow=follow),
                on_nodes=self._fleet_nodes,
            )
            rt.store_view = fleet.status
            rt.on_local_health = fleet.poke
            tasks.append(asyncio.create_task(fleet.run(), name="store"))
        self._banner(token is not None)
        last_plan = time.monotonic()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_INTERVAL):
                        await self._wake.wait()
                self._wake.clear()
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if self._stop.is_set():
                    break
                now = time.monotonic()
                if self.history.due(now):
                    self.history.add(now, rt.traffic())  # the status page's sparklines
                self._follow_agents()  # the API may have changed agents.listen
                if self._reload or rt.config_file_mtime() != self._mtime:
                    self.reload("SIGHUP" if self._reload else "the file changed")
                    self._reload = False
                    self._follow_agents()
                elif rt.dirty or (rt.beamer_pending and now - last_plan >= REPLAN_INTERVAL):
                    rt.apply()
                else:
                    continue
                last_plan = now
        finally:
            if self.announcer is not None:
                await self._withdraw(self.announcer)
            server.should_exit = True
            for t in tasks[1:]:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._receiver is not None:
                self._receiver.close()
            _remove_socket_file(sock_file)
            if read_pid(rt.instance) == os.getpid():
                paths.pid_file(rt.instance).unlink(missing_ok=True)
            if self.socket_lb is not None:
                self.socket_lb.close()  # its links stay pinned, as lb_xdp's do
            rt.close()
            log.info("instance %s: daemon exits, programs stay attached", rt.instance)
            # Stopping already: one more SIGTERM or SIGINT while the interpreter winds
            # down changes nothing (the loop's handlers go with it; the default action
            # would end the exit with status -15).
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)

    async def _announce(self, announcer: Announcer) -> None:
        """Self-check every ``bgp.self_check_interval``; announce the VIPs while it
        passes (docs/cluster.md, "Announcing")."""
        rt = self.rt
        while True:
            bgp = rt.running.bgp
            assert bgp is not None
            try:
                failure = self_check(rt)
            except Exception as e:  # a bug of ours is a failed check, not a dead task
                log.exception("bgp: the self-check raised")
                failure = f"the self-check raised {e!r}"
            vips = {v.address for v in rt.running.vips}
            was_passing = announcer.passing
            # A node that has not its peers' sessions yet is not failing: it waits.
            waiting = self.sync.waiting_for() if self.sync is not None else None
            try:
                announcer.update(failure, vips, time.monotonic(), waiting=waiting)
            except BirdError as e:
                log.error("bgp: %s", e)
            # The fence: when a node that served starts failing (not one never healthy).
            if failure is not None and was_passing and bgp.uplink_down:
                fence(bgp.uplink_down, failure)
            await asyncio.sleep(bgp.self_check_interval)

    def _report(self) -> NodeReport:
        """What this node serves, for the fleet's store (FleetMember adds the rest)."""
        announcer = self.announcer
        sessions = {s.peer: s.state for s in announcer.sessions(2.0)} if announcer else {}
        sync = self.rt.running.sync
        return NodeReport(
            node="",
            revision=None,
            tables=table_digests(self.rt.running, self.rt.applied),
            announced=announcer.announced if announcer else [],
            health=self.rt.local_health(),
            sessions=sessions,
            sync_node=self.rt.running.sync_node or "",
            sync_address=sync.listen if sync else "",
        )

    def _fleet_nodes(self, nodes: Mapping[str, NodeReport]) -> None:
        """The fleet's live nodes: those that sync are this node's sync peers too."""
        if self.sync is not None:
            self.sync.set_fleet_peers(
                {r.sync_node: r.sync_address for r in nodes.values() if r.sync_address}
            )

    async def _withdraw(self, announcer: Announcer) -> None:
        """Withdraw every VIP, give the routers ``bgp.drain`` seconds to move the flows
        (the programs still serve them), then stop BIRD."""
        drain = self.rt.running.bgp.drain if self.rt.running.bgp else 0.0
        try:
            announcer.withdraw("the daemon is stopping")
            log.info("bgp: withdrew every VIP; %.1f s for the routers to move the flows", drain)
            await asyncio.sleep(drain)
        except BirdError as e:
            log.error("bgp: withdrawing: %s", e)
        finally:
            announcer.close()

    def _banner(self, token: bool) -> None:
        """The startup line: what runs, from which file, where to reach it, on what."""
        cfg = self.rt.running
        fields = {
            "version": _version(),
            "instance": cfg.instance,
            "config": str(self.rt.config_path),
            "api": api_address(cfg.api, cfg.instance) + (" (token)" if token else ""),
            "interfaces": cfg.ifnames,
            "hook": ",".join(f"{i.name}:{i.hook}" for i in cfg.interfaces) or "none",
            "vips": len(cfg.vips),
        }
        log.info(
            "xdplb %(version)s serving instance %(instance)s from %(config)s: API %(api)s, "
            "interfaces %(ifaces)s, hook %(hook)s, %(vips)d VIPs",
            {**fields, "ifaces": ",".join(cfg.ifnames) or "none"},
            extra=fields,
        )

    def run(self) -> None:
        asyncio.run(self.serve())
