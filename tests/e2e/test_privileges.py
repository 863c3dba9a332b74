"""What is left of root's powers once the daemon serves: only the capabilities it needs
(``xdplb.daemon.privileges.DAEMON_KEEP``), in every set, with no_new_privs, so even its health
checks' commands cannot get more. And it still does all of its work without the rest:
a reload that adds a VIP (a new table map), health checks through the tunnel, status
(tables read from its own record, not by id), traffic to the new VIP. Its pins are
root's only."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from xdplb.core import paths
from xdplb.daemon import privileges
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import EchoStream
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"  # on the backends' loopback
HEALTH = {
    "checker": {"http": {"uri": "/", "codes": [200], "check_port": 80}},
    "interval_ms": 200,
    "timeout_ms": 200,
    "rise_count": 1,
    "fall_count": 2,
}


def vip(lab: Lab, addr: str, port: int = 80, health: bool = True) -> dict[str, object]:
    return {
        "address": addr,
        "port": port,
        **({"health": HEALTH} if health else {}),
        "backends": [{"address": str(lab.addr(b))} for b in lab.backends],
    }


def test_daemon_keeps_only_what_it_needs(lab: Lab, tmp_path: Path) -> None:
    procs = lab.start_servers()
    node = LbNode(lab, tmp_path, [vip(lab, VIP, 7, health=False)])
    try:
        node.start()
        assert node.proc is not None
        caps = privileges.capabilities(node.proc.pid)
        want = privileges.mask(privileges.DAEMON_KEEP)
        for name in ("CapEff", "CapPrm", "CapBnd"):
            assert caps[name] == want, (name, hex(caps[name]), hex(want))
        assert caps["CapInh"] == 0 and caps["CapAmb"] == 0
        status = Path(f"/proc/{node.proc.pid}/status").read_text()
        assert "NoNewPrivs:\t1" in status
        assert (caps["CapEff"] >> privileges.Cap.SYS_ADMIN) & 1 == 0

        # Work it does after dropping them: a new VIP (a new table map, and the health
        # tunnel's program loaded), checked through the tunnel, shown in status; the
        # first VIP's table follows the health checks.
        node.reload([vip(lab, VIP, 7), vip(lab, VIP)])
        procs[0].kill()  # b1's servers: its checks (through the tunnel) must fail
        procs[0].wait()
        with node.api() as api:

            def vips_now() -> dict[str, Any]:
                return {v["name"]: v for v in api.get("/api/v1/status").json()["vips"]}

            def b1_down_in_both(vips: dict[str, Any]) -> bool:
                new = vips.get(f"{VIP}:80/tcp", {}).get("backends", [])
                b1 = next((b for b in new if b["address"] == str(lab.addr("b1"))), None)
                echo_b1 = vips[f"{VIP}:7/tcp"]["backends"][0]
                return b1 is not None and b1["health"] == echo_b1["health"] == "down"

            vips = wait_for(
                vips_now,
                "b1 down for both VIPs",
                until=b1_down_in_both,
                interval=0.1,
                detail=node.log_tail,
            )
            health = {b["address"]: b for b in vips[f"{VIP}:80/tcp"]["backends"]}
            others = [b for a, b in health.items() if a != str(lab.addr("b1"))]
            # The others answered their checks: up, and a check ran.
            assert all(b["health"] == "up" and b["health_detail"] for b in others), [
                (a, b["health"], b["health_detail"]) for a, b in health.items()
            ]
        ns = lab.ns("client")
        streams = [EchoStream.open(ns, VIP, 7) for _ in range(12)]
        try:
            for s in streams:
                s.exchange(512)
            assert "b1" not in {s.backend for s in streams}
            assert len({s.backend for s in streams}) > 1
        finally:
            for s in streams:
                s.close()
        assert node.proc.poll() is None, node.log_tail()
        assert "kept capabilities" not in node.log_path.read_text()
    finally:
        node.destroy()
        for p in procs:
            p.kill()
            p.wait()


def test_pins_are_root_only(lab: Lab, tmp_path: Path) -> None:
    node = LbNode(lab, tmp_path, [vip(lab, VIP, 7, health=False)])
    try:
        node.start()
        root = paths.pin_root(node.instance)
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert stat.S_IMODE(node.pins_dir().stat().st_mode) == 0o700
        pins = [p for p in root.rglob("*") if not p.is_dir()]
        assert len(pins) >= 10
        for p in pins:
            assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, p
        # Another user cannot even find them (the system python: the venv may not be
        # readable to them).
        conns = node.pins_dir() / "lb_conns"
        probe = subprocess.run(
            ["/usr/bin/python3", "-c", f"import os; os.stat({str(conns)!r})"],
            preexec_fn=lambda: (os.setgroups([]), os.setgid(65534), os.setuid(65534)),
            capture_output=True,
            text=True,
        )
        assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe
    finally:
        node.destroy()
