"""The CLI against the real daemon (issue 10, failures 1 and 3): with ``api.listen`` on
127.0.0.1 in the file, ``list -c`` and ``status -c`` reach it; ``stop`` where bpffs is
not mounted fails and leaves lb_xdp attached and every pin in place; a real ``stop``
reports the link it detached and the pins it removed, and they are gone."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from xdplb.core import paths
from xdplb.datapath.links import Link
from xdplb.lab import Lab
from xdplb.lab.lbnode import LbNode

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
PORT = 9180
#: The command in a mount namespace of its own where /sys/fs/bpf is a tmpfs: bpffs is not
#: mounted there, as inside `ip netns exec`.
NO_BPFFS = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs none /sys/fs/bpf && exec "$@"', "sh")


@pytest.fixture
def lb(lab: Lab, tmp_path: Path) -> Iterator[LbNode]:
    backends = [{"address": str(lab.addr("b1"))}]
    node = LbNode(
        lab,
        tmp_path,
        [{"address": VIP, "port": 80, "backends": backends}],
        api={"listen": f"127.0.0.1:{PORT}"},
    )
    node.start()
    yield node
    node.destroy()


def xdplb(lab: Lab, *args: str, wrap: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The CLI in the LB's namespace, as an operator on that host runs it."""
    return lab.run("lb", [*wrap, sys.executable, "-m", "xdplb.cli.app", *args], check=False)


def test_list_and_status_reach_the_daemon_the_file_names(lab: Lab, lb: LbNode) -> None:
    cfg = str(lb.config_path)
    r = xdplb(lab, "list", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert f"TCP  {VIP}:80 maglev" in r.stdout
    r = xdplb(lab, "status", "-c", cfg, "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["source"] == "daemon" and st["vips"][0]["backends"][0]["health"] == "unchecked"
    # Which program runs on which interface, and why: the lab's eth0 is a veth.
    assert st["hooks"] == [
        {
            "name": "eth0",
            "hook": "tc",
            "why": "auto: veth is a virtual device (XDP there would lose GSO and checksum offload)",
        }
    ]
    r = xdplb(lab, "status", "-c", cfg)
    assert r.returncode == 0, r.stderr
    assert "attached to eth0 (tc)" in r.stdout.splitlines()[0]
    assert "  eth0: tc (auto: veth is a virtual device" in r.stdout
    # From the pins (no daemon asked): the hook, not the reason, which only the daemon saw.
    r = xdplb(lab, "status", "-c", cfg, "--offline", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["hooks"] == [{"name": "eth0", "hook": "tc", "why": None}]
    # By instance name alone the CLI asks the default socket, where nothing listens.
    r = xdplb(lab, "list", "-i", lb.instance)
    assert r.returncode == 3
    assert f"no daemon: {lb.api_socket} does not exist" in r.stderr


def test_stop_fails_where_bpffs_is_not_mounted_then_stops_and_reports(lab: Lab, lb: LbNode) -> None:
    root = paths.pin_root(lb.instance)
    link_pin = lb.link_pin
    with Link.from_pinned(link_pin) as link:
        link_id, prog_id = link.id, link.prog_id
        assert link.xdp_ifindex == lab.ifindex("lb")  # what destroy reads as 0 once detached
    pins = sorted(p for p in root.rglob("*") if not p.is_dir())
    assert lb.kernel_prog() == prog_id

    r = xdplb(lab, "stop", "-c", str(lb.config_path), wrap=NO_BPFFS)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.startswith(
        f"cannot stop instance {lb.instance}: bpffs is not mounted at /sys/fs/bpf"
    )
    assert "stopped" not in r.stdout
    # Nothing changed: the daemon serves, the program is attached, every pin is there.
    assert lb.proc is not None and lb.proc.poll() is None
    assert lb.kernel_prog() == prog_id
    assert sorted(p for p in root.rglob("*") if not p.is_dir()) == pins
    with Link.from_pinned(link_pin) as link:
        assert link.id == link_id

    r = xdplb(lab, "stop", "-c", str(lb.config_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"instance {lb.instance} stopped: the balancer detached from eth0 (tc, link {link_id}); "
        f"{len(pins)} pins removed with {root}\n"
    )
    assert lb.proc.wait(5) == 0
    lb.proc = None
    assert lb.kernel_prog() is None
    assert not root.exists()
