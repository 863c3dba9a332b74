"""`xdplb capture` against the lab's balancer (the real daemon) while traffic flows.

A client's HTTP exchange is forwarded, and a SYN from a denied source is dropped by the
global ACL; the pcapng the command writes is read back with scapy: the denied SYN with
`point=drop reason=ACL`, the client's packets with `point=forward` and the backend that
answered. `--summary --count` prints a line per packet and stops; a killed capture stops
sampling by itself within its lease; sampling is off once the command is gone.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from scapy.layers.inet import IP, TCP
from scapy.utils import PcapNgReader

from xdplb.datapath.capture import LEASE_NS, CaptureMaps
from xdplb.lab import Lab, netns
from xdplb.lab.lbnode import LbNode
from xdplb.lab.traffic import http_post
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "198.18.100.1"
DENIED_NET = "198.18.0.64/26"
DENIED_SRC = "198.18.0.77"


@pytest.fixture(scope="module")
def lb(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LbNode]:
    lab.run("client", ["ip", "addr", "add", f"{DENIED_SRC}/24", "dev", "eth0"])
    lab.start_servers()
    backends = [{"address": str(lab.addr(b))} for b in lab.backends]
    vips: list[dict[str, Any]] = [{"address": VIP, "port": 80, "backends": backends}]
    node = LbNode(lab, tmp_path_factory.mktemp("capture"), vips, acl={"deny": [DENIED_NET]})
    node.start()
    yield node
    node.destroy()


def capture_maps(node: LbNode) -> CaptureMaps:
    return CaptureMaps.from_pins(node.pins_dir())


def sampling(node: LbNode) -> bool:
    with capture_maps(node) as maps:
        return maps.active()


def start_capture(node: LbNode, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "xdplb.cli.app", "capture", "-i", node.instance, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(
        lambda: sampling(node) or proc.poll() is not None,
        "the capture turned sampling on",
        timeout=20,
    )
    assert proc.poll() is None, proc.communicate()
    return proc


def denied_syn(lab: Lab) -> None:
    """One connection attempt from the denied source (its SYNs are dropped in XDP)."""
    with netns.enter(lab.ns("client")):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((DENIED_SRC, 0))
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.connect((VIP, 80))
    finally:
        sock.close()


def test_pcapng_of_a_drop_and_of_forwarded_traffic(lab: Lab, lb: LbNode, tmp_path: Path) -> None:
    out = tmp_path / "lb.pcapng"
    proc = start_capture(lb, "-p", "drop,forward", "--vip", VIP, "-w", str(out))
    try:
        backend = http_post(lab.ns("client"), VIP, 80, b"captured")
        denied_syn(lab)
        # Every SYN the denied source sent is in the file before we stop.
        wait_for(lambda: out.stat().st_size, "records written", until=lambda n: n > 400, timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "packets captured" in err
    assert not sampling(lb)

    with PcapNgReader(str(out)) as reader:
        pkts = [(p, b" ".join(p.comments or []).decode()) for p in reader]
    drops = [(p, c) for p, c in pkts if c.startswith("point=drop")]
    forwards = [(p, c) for p, c in pkts if c.startswith("point=forward")]
    assert drops, [c for _, c in pkts]
    for p, c in drops:
        assert c == "point=drop reason=ACL"
        assert (p[IP].src, p[IP].dst, p[TCP].dport, p[TCP].flags.S) == (DENIED_SRC, VIP, 80, 1)
    client = str(lab.addr("client"))
    be = str(lab.addr(backend))
    mine = [(p, c) for p, c in forwards if p[IP].src == client]
    assert mine, [c for _, c in pkts]
    for p, c in mine:
        words = dict(w.split("=", 1) for w in c.split())
        assert (words["backend"], words["vip"], p[IP].dst, p[TCP].dport) == (
            be, f"{VIP}:80/tcp", VIP, 80
        )  # fmt: skip
    # The SYN was balanced by the table, the rest of the connection by the connection table.
    reasons = [dict(w.split("=", 1) for w in c.split())["reason"] for _, c in mine]
    assert reasons[0] == "TABLE" and "CONN_HIT" in reasons[1:]


def test_summary_lines_until_the_count(lab: Lab, lb: LbNode) -> None:
    proc = start_capture(lb, "-p", "drop", "--summary", "--count", "1")
    try:
        denied_syn(lab)
        stdout, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    (line,) = stdout.splitlines()
    _when, point, reason, src, arrow, dst, proto, *_ = line.split()
    assert (point, reason, src.split(":")[0], arrow, dst, proto) == (
        "drop", "ACL", DENIED_SRC, ">", f"{VIP}:80", "tcp"
    )  # fmt: skip
    assert "1 packets captured" in err
    assert not sampling(lb)


def test_a_killed_capture_stops_sampling_by_itself(lab: Lab, lb: LbNode) -> None:
    proc = start_capture(lb, "-p", "drop,forward,pass")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_for(
        lambda: not sampling(lb),
        "the abandoned capture expired",
        timeout=LEASE_NS / 1e9 + 5,
        interval=0.1,
    )
    # Traffic afterwards is served and recorded no more.
    with capture_maps(lb) as maps:
        maps.ring.skip()  # what was sampled before the expiry
        assert http_post(lab.ns("client"), VIP, 80, b"after") in lab.backends
        assert maps.read(0) == []
    # A new capture can start (the dead one's lock went with it).
    proc = start_capture(lb, "--seconds", "1")
    assert proc.wait(timeout=20) == 0
