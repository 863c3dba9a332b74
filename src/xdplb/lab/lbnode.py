"""The lab's LB node: the real ``xdplb run`` daemon in the LB namespace.

The daemon is started as its own process inside the namespace (only the network
namespace changes, so bpffs stays visible), with a configuration file written here.
Tests and the demo reload it, restart it, and read its pinned maps.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from xdplb.config import Config, HookName, parse_config
from xdplb.control import planner
from xdplb.core import paths
from xdplb.core.errors import LabError
from xdplb.core.paths import api_socket
from xdplb.datapath import layout
from xdplb.datapath.lb import LbMaps, destroy, pinned_links
from xdplb.datapath.links import tcx_programs
from xdplb.lab.topology import Lab
from xdplb.lab.wait import wait_for


class LbNode:
    """``xdplb run`` in a lab namespace (``lb``, or a backend when co-located), driven
    through its config file."""

    def __init__(
        self,
        lab: Lab,
        workdir: Path,
        vips: list[dict[str, Any]],
        *,
        node: str = "lb",
        **extra: Any,
    ) -> None:
        self.lab = lab
        self.node = node
        # lb, lb2 ...: LB nodes; a backend's balancer (co-located): b1lb ...
        role = node if node in lab.lbs else f"{node}lb"
        self.instance = f"{lab.prefix}-{role}"
        self.config_path = workdir / f"{self.instance}.yaml"
        self.log_path = workdir / f"{self.instance}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        #: Another lb_xdp object for the next :meth:`start` (``XDPLB_LB_OBJECT``: a test
        #: build of another layout); None: the build's. Reads of the pins follow it.
        self.lb_object: Path | None = None
        # The lab removes our pins at teardown, whatever happens.
        lab.pin_root(role)
        lab.on_teardown(self.destroy)
        self.doc: dict[str, Any] = {}
        #: Detaches the xdp_pass that an ``xdp`` hook needs on our bridge port (None: none).
        self._peer_xdp: Callable[[], None] | None = None
        self.write(vips, **extra)

    def write(self, vips: list[dict[str, Any]], **extra: Any) -> Config:
        """Write a new configuration file (validated first); returns it."""
        doc: dict[str, Any] = {
            "instance": self.instance,
            "interfaces": ["eth0"],
            "table_size": 65537,
            "tunnel": {
                "source_v4": str(self.lab.addr(self.node, 4)),
                "source_v6": str(self.lab.addr(self.node, 6)),
            },
            "vips": vips,
        }
        doc.update(extra)
        cfg = parse_config(doc)
        self._follow_hooks(cfg)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc))
        tmp.replace(self.config_path)  # atomic: the daemon never reads half a file
        self.doc = doc
        return cfg

    @property
    def config(self) -> Config:
        return parse_config(self.doc)

    def start(self, timeout: float = 30.0, *, wait: bool = True, args: Sequence[str] = ()) -> None:
        """Start the daemon (``xdplb run`` with ``args`` too) and wait until the maps hold
        this configuration (``wait``: not when load feedback rewrites the weights: the
        caller knows what to wait for)."""
        self.launch(args)
        self._wait_serving(timeout)
        if wait:
            self.wait_applied(timeout)

    def launch(self, args: Sequence[str] = ()) -> None:
        """Start the daemon and return at once (:func:`start_nodes` waits for several)."""
        if self.proc is not None and self.proc.poll() is None:
            raise LabError("the LB daemon is already running")
        log = self.log_path.open("ab")
        env = self.env()
        self.proc = self.lab.popen(
            self.node,
            [sys.executable, "-m", "xdplb.cli.app", "run", "-c", str(self.config_path), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()

    def env(self) -> dict[str, str]:
        """The environment of the daemon and of :meth:`cli`: ``XDPLB_LB_OBJECT`` as
        :attr:`lb_object` says."""
        env = dict(os.environ)
        env.pop(paths.LB_OBJECT_ENV, None)
        if self.lb_object is not None:
            env[paths.LB_OBJECT_ENV] = str(self.lb_object)
        return env

    def _wait_serving(self, timeout: float) -> None:
        """Until the daemon has written its pid file: its signal handlers are in place
        (a SIGHUP before would kill it) and it has applied its configuration once."""
        from xdplb.daemon.main import read_pid

        proc = self.proc
        assert proc is not None

        def pid() -> int | None:
            if proc.poll() is not None:
                raise LabError(f"the LB daemon exited: {self.log_tail()}")
            return read_pid(self.instance)

        wait_for(
            pid,
            f"the LB daemon (pid {proc.pid}) writing its pid file",
            until=lambda p: p == proc.pid,
            timeout=timeout,
            detail=self.log_tail,
        )

    def stop_daemon(self, timeout: float = 10.0) -> None:
        """SIGTERM the daemon: it exits and leaves lb_xdp attached (a restart/upgrade)."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise LabError("the LB daemon ignored SIGTERM") from None
        self.proc = None
        if rc != 0:
            raise LabError(f"the LB daemon exited with {rc}: {self.log_tail()}")

    def reload(self, vips: list[dict[str, Any]], timeout: float = 10.0, **extra: Any) -> None:
        """Write a new configuration, SIGHUP the daemon, wait until it is applied."""
        self.write(vips, **extra)
        if self.proc is None:
            raise LabError("the LB daemon is not running")
        self.proc.send_signal(signal.SIGHUP)
        self.wait_applied(timeout)

    def wait_applied(self, timeout: float) -> None:
        """Until a plan against the pinned maps is empty: the daemon applied our config."""
        cfg = self.config

        def pending() -> tuple[int, bool] | None:
            """Steps of the plan still to do and whether lb_xdp is attached (None: no
            pins yet)."""
            if self.proc is not None and self.proc.poll() is not None:
                raise LabError(f"the LB daemon exited: {self.log_tail()}")
            try:
                maps = LbMaps.from_pins(self.pins_dir())
            except FileNotFoundError:
                return None
            try:
                return len(planner.plan(cfg, maps.snapshot())), self._attached()
            finally:
                maps.close()

        wait_for(
            pending,
            "the LB daemon applying its configuration (plan steps left, attached)",
            until=lambda p: p == (0, True),
            timeout=timeout,
            interval=0.05,
            detail=self.log_tail,
        )

    def _attached(self) -> bool:
        return "eth0" in pinned_links(paths.pin_root(self.instance))

    @property
    def link_pin(self) -> Path:
        """The pin of eth0's link, at the hook the daemon chose (``tc_eth0`` on the lab's
        veth; ``xdp_eth0`` with ``hook: xdp``)."""
        hook = pinned_links(paths.pin_root(self.instance)).get("eth0", "tc")
        return paths.pin_root(self.instance) / paths.LINKS_DIR / f"{hook}_eth0"

    def kernel_prog(self) -> int | None:
        """Id of the balancer's program the kernel runs on eth0, as the kernel says (XDP
        from the link's attributes, else the first tcx ingress program); None: none."""
        out = subprocess.run(
            ["ip", "-n", self.lab.ns(self.node), "-j", "link", "show", "dev", "eth0"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        xdp = json.loads(out)[0].get("xdp")
        if xdp is not None:
            return int(xdp["prog"]["id"])
        with self.lab.enter(self.node):
            progs = tcx_programs(socket.if_nametoindex("eth0"))
        return progs[0] if progs else None

    @property
    def abi_version(self) -> int:
        """The layout of the daemon's lb_xdp object (:attr:`lb_object` or the build's)."""
        if self.lb_object is not None:
            return layout.object_version(self.lb_object)
        return layout.current_version()

    def pins_dir(self) -> Path:
        """Where the daemon's lb_xdp maps are pinned (its layout's directory)."""
        return paths.layout_dir(self.instance, self.abi_version)

    @property
    def api_socket(self) -> Path:
        """The daemon's API socket (unix sockets are not per network namespace)."""
        return api_socket(self.instance)

    def api(self, timeout: float = 10.0) -> httpx.Client:
        """A client of the daemon's API (the caller closes it)."""
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=str(self.api_socket)),
            base_url="http://xdplb",
            timeout=timeout,
        )

    def cli(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """``xdplb ARGS -i <instance>`` as an operator would run it."""
        return subprocess.run(
            [sys.executable, "-m", "xdplb.cli.app", *args, "-i", self.instance],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=self.env(),
        )

    def maps(self) -> LbMaps:
        """The daemon's pinned maps (the caller closes them)."""
        return LbMaps.from_pins(self.pins_dir())

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _follow_hooks(self, cfg: Config) -> None:
        """lb_xdp on a lab veth transmits with XDP_TX, which the bridge port delivers only
        with an XDP program of its own (:meth:`Lab.peer_xdp`): there while a configuration
        asks for ``hook: xdp``, gone when none does (``auto`` picks TC on veth)."""
        wants = any(i.hook == HookName.XDP for i in cfg.interfaces)
        if wants and self._peer_xdp is None:
            self._peer_xdp = self.lab.peer_xdp(self.node)
        elif not wants and self._peer_xdp is not None:
            self._peer_xdp()
            self._peer_xdp = None

    def destroy(self) -> None:
        """Stop the daemon if running, detach lb_xdp, remove every pin and run file."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        destroy(self.instance)
        if self._peer_xdp is not None:
            self._peer_xdp()
            self._peer_xdp = None
        for path in run_files(self.instance):
            path.unlink(missing_ok=True)
        # A killed daemon leaves its BIRD directory (its BIRD died with it).
        shutil.rmtree(paths.run_dir() / f"{self.instance}.bird", ignore_errors=True)


def run_files(instance: str) -> list[Path]:
    """What a daemon of ``instance`` writes in the run directory (the admin state survives
    its restarts, so only a teardown removes it)."""
    run = paths.run_dir()
    admin = [run / f"{instance}.admin.json", run / f"{instance}.admin.tmp"]
    return [paths.pid_file(instance), paths.api_socket(instance), *admin]


def start_nodes(nodes: Sequence[LbNode], timeout: float = 30.0) -> None:
    """Start every node's daemon at once, then wait until each serves its configuration
    (what :meth:`LbNode.start` does for one, without the daemons waiting in turn)."""
    for n in nodes:
        n.launch()
    for n in nodes:
        n._wait_serving(timeout)
    for n in nodes:
        n.wait_applied(timeout)
