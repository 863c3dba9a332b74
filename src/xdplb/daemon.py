"""The LB daemon: load, attach, apply the configuration, and keep applying it.

Lifecycle (DESIGN.md §2):
- start: lb_xdp is loaded with its maps pinned per instance; existing pins are reused, so
  the connection table survives a restart, and existing XDP links are switched to the new
  program atomically;
- reload on SIGHUP or when the file changes: a configuration that fails validation
  changes nothing (the error names the field) and the running one keeps serving;
- SIGTERM/SIGINT: the daemon exits and leaves the programs attached (restart/upgrade);
- ``xdplb stop``: the daemon exits and the instance is detached and unpinned.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType

from xdplb import planner
from xdplb.config import Config, XdpModeName, load_config
from xdplb.datapath import XdpMode
from xdplb.datapath.lb import LbDatapath
from xdplb.errors import ConfigError
from xdplb.feedback import WeightFeedback

log = logging.getLogger("xdplb.daemon")

RUN_DIR = Path(os.environ.get("XDPLB_RUN_DIR", "/run/xdplb"))
#: How often the configuration file's mtime is looked at.
POLL_INTERVAL = 0.5
#: How often a Beamer table still short of its weights is planned again, so that it
#: reaches a far target in steps, each after its minimum interval.
REPLAN_INTERVAL = 1.0


def pid_file(instance: str) -> Path:
    return RUN_DIR / f"{instance}.pid"


def read_pid(instance: str) -> int | None:
    """The pid of the running daemon of ``instance``, or None."""
    try:
        pid = int(pid_file(instance).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    return pid


class Daemon:
    """One LB instance, driven by one configuration file."""

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.config: Config = load_config(config_path)  # ConfigError: refuse to start
        self._mtime = self._file_mtime()
        self._reload = threading.Event()
        self._stop = threading.Event()
        self.dp = LbDatapath(self.config.instance)
        #: Beamer tables as last built, by vip id (the maps hold hops, not history).
        self.memory: dict[int, planner.BeamerMemory] = {}
        #: Load-aware weights, when the configuration asks for them.
        self.feedback: WeightFeedback | None = None
        #: Some Beamer table still has steps to take (see planner.beamer_pending).
        self.beamer_pending = False

    def _file_mtime(self) -> float:
        try:
            return self.config_path.stat().st_mtime
        except OSError:
            return 0.0

    def _follow_feedback(self, cfg: Config) -> None:
        """Start, reconfigure or stop load feedback as ``cfg`` says."""
        lf = cfg.load_feedback
        if lf is None:
            if self.feedback is not None:
                self.feedback.close()
                self.feedback = None
            return
        try:
            if self.feedback is None:
                self.feedback = WeightFeedback(lf)
            self.feedback.configure(cfg)
        except OSError as e:
            # The balancer serves on with the configured weights; the log says why.
            log.error("load feedback off: cannot listen on %s: %s", lf.listen, e)
            if self.feedback is not None:
                self.feedback.close()
            self.feedback = None

    def apply(self, cfg: Config) -> int:
        """Make interfaces and maps match ``cfg``; returns the number of map operations."""
        mode = XdpMode.GENERIC if cfg.xdp_mode is XdpModeName.GENERIC else XdpMode.NATIVE
        for ifname in cfg.interfaces:
            if self.dp.attach(ifname, mode):
                log.info("attached lb_xdp to %s (%s)", ifname, cfg.xdp_mode)
        for ifname in self.dp.attached():
            if ifname not in cfg.interfaces:
                self.dp.detach(ifname)
                log.info("detached lb_xdp from %s", ifname)
        self._follow_feedback(cfg)
        wanted = self.feedback.effective(cfg) if self.feedback is not None else cfg
        now = time.monotonic()
        snap = self.dp.snapshot()
        ops = planner.plan(wanted, snap, now=now, memory=self.memory)
        t0 = time.perf_counter()
        self.dp.apply(ops)
        for op in ops:
            if isinstance(op, planner.PutTable) and op.beamer_table is not None:
                self.memory[op.vip_id] = planner.BeamerMemory(op.beamer_table, now)
            elif isinstance(op, planner.PutTable | planner.DeleteTable):
                self.memory.pop(op.vip_id, None)
        if ops:
            log.info(
                "applied %d map operations in %.1f ms", len(ops), 1e3 * (time.perf_counter() - t0)
            )
        self.beamer_pending = planner.beamer_pending(wanted, planner.apply_to_snapshot(snap, ops))
        self.config = cfg
        return len(ops)

    def reload(self) -> bool:
        """Re-read the file; apply it if valid. False (and nothing changed) if not."""
        self._mtime = self._file_mtime()
        try:
            cfg = load_config(self.config_path)
        except ConfigError as e:
            log.error("configuration refused, still serving the previous one: %s", e)
            return False
        if cfg.instance != self.config.instance:
            log.error(
                "configuration refused: instance cannot change while running (%s -> %s)",
                self.config.instance,
                cfg.instance,
            )
            return False
        self.apply(cfg)
        return True

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self._reload.set()
        else:
            self._stop.set()

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT. Programs stay attached when this returns."""
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self.apply(self.config)
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        pid_file(self.config.instance).write_text(f"{os.getpid()}\n")
        log.info("instance %s serving %d VIPs", self.config.instance, len(self.config.vips))
        last_plan = time.monotonic()
        try:
            while not self._stop.is_set():
                self._reload.wait(POLL_INTERVAL)
                if self._stop.is_set():
                    break
                if self._reload.is_set() or self._file_mtime() != self._mtime:
                    self._reload.clear()
                    self.reload()
                    last_plan = time.monotonic()
                elif self.feedback is not None and self.feedback.step(time.monotonic()):
                    self.apply(self.config)  # new weights from the backends' load
                    last_plan = time.monotonic()
                elif self.beamer_pending and time.monotonic() - last_plan >= REPLAN_INTERVAL:
                    self.apply(self.config)
                    last_plan = time.monotonic()
        finally:
            pid = pid_file(self.config.instance)
            if read_pid(self.config.instance) == os.getpid():
                pid.unlink(missing_ok=True)
            if self.feedback is not None:
                self.feedback.close()
            self.dp.close()
            log.info("instance %s: daemon exits, programs stay attached", self.config.instance)
