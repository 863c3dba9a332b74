"""A real etcd server for the lab's fleet state (docs/cluster.md, "Fleet state"): Debian's
``etcd`` in one of the lab's namespaces, on that node's segment address, its data in a
directory of the test's; ``etcdctl`` (v3 API) from the same namespace writes to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from xdplb.core.errors import LabError
from xdplb.lab.topology import Lab
from xdplb.lab.wait import wait_for

CLIENT_PORT = 2379
PEER_PORT = 2380


class Etcd:
    """One etcd member in node ``node`` of ``lab`` (default: the client's namespace, which
    every LB node reaches over the segment)."""

    def __init__(self, lab: Lab, directory: Path, node: str = "client") -> None:
        self.lab = lab
        self.node = node
        self.host = str(lab.addr(node))
        self.dir = directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{CLIENT_PORT}"

    @property
    def url(self) -> str:
        """What a node's ``cluster.store`` names."""
        return f"etcd://{self.endpoint}"

    def start(self, timeout: float = 20.0) -> None:
        """Start (or restart, on the same data) and wait until it answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise LabError("etcd is already running")
        self.dir.mkdir(parents=True, exist_ok=True)
        client, peer = f"http://{self.endpoint}", f"http://{self.host}:{PEER_PORT}"
        argv = [
            "etcd",
            "--name=lab",
            f"--data-dir={self.dir / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=lab={peer}",
        ]
        log = (self.dir / "etcd.log").open("ab")
        try:
            self.proc = self.lab.popen(self.node, argv, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        wait_for(
            lambda: self.ctl("endpoint", "health", check=False).returncode == 0,
            "etcd answering",
            timeout=timeout,
        )

    def kill(self) -> None:
        """SIGKILL: the store is gone at once (its data stays for :meth:`start`)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``etcdctl ARGS`` against this member (v3 API)."""
        return self.lab.run(
            self.node,
            ["etcdctl", f"--endpoints={self.endpoint}", "--dial-timeout=2s", *args],
            check=check,
            env={**os.environ, "ETCDCTL_API": "3"},
        )

    def put(self, key: str, value: str) -> int:
        """Write ``value`` at ``key``; the store's revision after the write."""
        if value.startswith("-"):
            raise LabError("etcdctl would take a value starting with '-' for an option")
        out = self.ctl("put", "-w", "json", key, value).stdout
        return int(json.loads(out)["header"]["revision"])
