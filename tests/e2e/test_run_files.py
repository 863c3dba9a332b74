"""Run files (issue 10, failure 8): a daemon leaving on SIGTERM removes its API socket and
pid file and leaves lb_xdp serving; the demo's cleanup leaves no file of its instance in
/run/xdplb (before, `make demo` left `<instance>.api.sock` and `.pid` behind)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from xdplb.core import paths
from xdplb.lab import Lab, demo
from xdplb.lab.lbnode import LbNode, run_files
from xdplb.lab.traffic import http_post

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"


def present(instance: str) -> list[str]:
    """Names of the instance's files in the run directory."""
    return sorted(p.name for p in paths.run_dir().iterdir() if p.name.startswith(instance + "."))


def test_sigterm_removes_socket_and_pid_and_keeps_serving(lab: Lab, tmp_path: Path) -> None:
    servers = lab.start_servers()
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    lb = LbNode(lab, tmp_path, [{"address": VIP, "port": 80, "backends": backends}])
    try:
        lb.start()
        i = lb.instance
        assert present(i) == [f"{i}.api.sock", f"{i}.pid"]
        lb.stop_daemon()  # SIGTERM, exit code 0 checked
        assert present(i) == []
        # The program stays attached and the pins serve without the daemon.
        assert lb.link_pin.exists()
        assert http_post(lab.ns("client"), VIP, 80, b"hello") in lab.backends
    finally:
        lb.destroy()
        for p in servers:
            p.kill()
            p.wait()


def test_sigterm_again_while_stopping_is_still_a_clean_exit(lab: Lab, tmp_path: Path) -> None:
    """``systemctl stop`` twice, or a supervisor that repeats its SIGTERM: the exit is
    still a clean one (it once ended in status -15 when a SIGTERM came after the loop)."""
    lb = LbNode(lab, tmp_path, [])
    try:
        lb.start()
        proc = lb.proc
        assert proc is not None
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.005)
        assert proc.wait(5) == 0, lb.log_tail()
    finally:
        lb.destroy()


def test_demo_cleanup_removes_every_run_file(tmp_path: Path) -> None:
    with demo.demo_lab(tmp_path) as (lab, lb, _):
        i = lb.instance
        done = lb.cli("backend", "drain", f"{demo.VIP4}:80/tcp", str(lab.addr("b1")))
        assert done.returncode == 0, done.stdout + done.stderr
        assert present(i) == [f"{i}.admin.json", f"{i}.api.sock", f"{i}.pid"]
    assert present(i) == []
    assert not paths.pin_root(i).exists()
    assert all(not p.exists() for p in run_files(i))
