"""host_tc in the lab: real tunnel packets from the client, real UDP echo on the backends.

The client plays the balancer: it sends GUE / IPIP packets (as lb_xdp would build them)
straight to a backend. host_tc decapsulates them, the backend's echo server bound to the
VIP answers, and the reply comes back to the client directly, from the VIP.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6

from xdplb.core import abi, paths
from xdplb.core.addresses import IPAddress
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host
from xdplb.lab.packets import ether, gue_encap, ipip_encap
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

ECHO_PORT = 7777
#: socket(7): no UDP checksum on what this IPv4 socket sends (asm-generic/socket.h).
SO_NO_CHECK = 11
#: How long an echo may take to come back (waited for: it costs nothing when it is quick).
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def echo_lab(lab: Lab) -> Iterator[Lab]:
    """The lab with the lab's servers (UDP echo on ECHO_PORT) on every backend."""
    procs = lab.start_servers("--udp", str(ECHO_PORT))
    yield lab
    for proc in procs:
        proc.kill()
        proc.wait()


def _vip(lab: Lab, family: int) -> IPAddress:
    return next(v for v in lab.vips if v.version == family)


CASES = [
    # (id, encap, outer family, inner family, backend)
    ("gue-v4-in-v4", "gue", 4, 4, "b1"),
    ("gue-v6-in-v6", "gue", 6, 6, "b2"),
    ("gue-v4-in-v6", "gue", 6, 4, "b3"),
    ("gue-v6-in-v4", "gue", 4, 6, "b1"),
    ("ipip", "ipip", 4, 4, "b2"),
    ("ip6ip6", "ipip", 6, 6, "b3"),
    ("4in6", "ipip", 6, 4, "b1"),
    ("6in4", "ipip", 4, 6, "b2"),
]


@pytest.mark.parametrize(
    ("encap", "outer", "inner", "backend"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_decap_and_direct_reply(
    echo_lab: Lab, encap: str, outer: int, inner: int, backend: str
) -> None:
    lab = echo_lab
    client_addr = lab.addr("client", inner)
    vip = _vip(lab, inner)
    host = lab.hosts[backend]
    before = host.events()

    with lab.enter("client"):
        fam = socket.AF_INET if inner == 4 else socket.AF_INET6
        rx = socket.socket(fam, socket.SOCK_DGRAM)
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    with rx, raw:
        rx.bind((str(client_addr), 0))
        rx.settimeout(0.25)
        sport = rx.getsockname()[1]
        payload = f"hello {encap} {outer}/{inner}".encode()
        ip = IP if inner == 4 else IPv6
        inner_pkt = (
            ip(src=str(client_addr), dst=str(vip)) / UDP(sport=sport, dport=ECHO_PORT) / payload
        )
        src, dst = lab.addr("client", outer), lab.addr(backend, outer)
        outer_pkt = (
            gue_encap(inner_pkt, src, dst) if encap == "gue" else ipip_encap(inner_pkt, src, dst)
        )
        raw.bind(("eth0", 0))
        frame = ether(outer_pkt, src=lab.mac("client"), dst=lab.mac(backend))

        def send_and_receive() -> tuple[bytes, Any] | None:
            raw.send(frame)
            try:
                return rx.recvfrom(2048)
            except TimeoutError:  # rx's 0.25 s: the pace of the resends
                return None

        # The first reply may wait for neighbour resolution: resend until one arrives.
        data, peer = wait_for(
            send_and_receive,
            f"an echo from {backend} via {encap} {outer}/{inner}",
            timeout=TIMEOUT,
            interval=0,
        )

    assert data == backend.encode() + b"\n" + payload
    assert ipaddress.ip_address(peer[0]) == vip  # direct server return: from the VIP
    assert peer[1] == ECHO_PORT
    after = host.events()
    ev = abi.HostEvent.DECAP_GUE if encap == "gue" else abi.HostEvent.DECAP_IPIP
    assert after[ev] > before[ev]
    assert after[abi.HostEvent.DROP_MALFORMED] == before[abi.HostEvent.DROP_MALFORMED]
    assert after[abi.HostEvent.DROP_DECAP] == 0


def test_xdp_tx_on_lb_reaches_backend(echo_lab: Lab) -> None:
    """A frame the LB's XDP program sends back out with XDP_TX reaches the backend
    (with xdp_pass on the bridge-side peer, as lb_xdp gets it), and the backend's reply reaches the
    client directly. The client's datagrams carry no UDP checksum (SO_NO_CHECK): with
    checksum offload on, XDP on veth would deliver the pseudo-header sum in its place
    (test_offloads.py shows lb_xdp doing so)."""
    lab = echo_lab
    path = paths.test_object("lab_xdp_tx")
    from xdplb.datapath import BpfObject, XdpMode, attach_xdp

    vip = _vip(lab, 4)
    detach_peer = lab.peer_xdp("lb")
    with BpfObject.load(path) as obj:
        mac = bytes.fromhex(lab.mac("b3").replace(":", "")) + b"\0\0"
        obj.map("lab_tx_mac").update((0).to_bytes(4, "little"), mac)
        with lab.enter("lb"):
            link = attach_xdp(obj.program("lab_xdp_tx"), lab.ifindex("lb"), XdpMode.NATIVE)
        with lab.enter("client"):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, SO_NO_CHECK, 1)
        with link, sock:
            sock.connect((str(vip), ECHO_PORT))
            sock.settimeout(0.25)
            replies = 0
            for _ in range(5):
                sock.send(b"via xdp_tx")
                with contextlib.suppress(TimeoutError):
                    replies += sock.recv(2048) == b"b3\nvia xdp_tx"
            link.detach()
    detach_peer()
    assert replies >= 4  # the first may wait for ARP


def test_plain_traffic_passes(lab: Lab) -> None:
    """Traffic that is not a tunnel (ping) goes through host_tc untouched."""
    host = lab.hosts["b1"]
    before = host.events()[abi.HostEvent.PASS]
    lab.wait_reachable("client", "b1")
    assert host.events()[abi.HostEvent.PASS] > before


def test_lab_tears_down_completely() -> None:
    """Namespaces, pins and processes are gone after the block, error or not."""
    with Lab(backends=1) as small:
        attach_host(small, "b1")
        proc = small.popen("b1", ["sleep", "60"])
        assert small.leftovers()
        assert small.pin_root("b1").is_dir()
    assert small.leftovers() == []
    assert proc.poll() is not None

    with pytest.raises(RuntimeError, match="boom"), Lab(backends=1) as failing:
        attach_host(failing, "b1")
        raise RuntimeError("boom")
    assert failing.leftovers() == []


def test_cleanup_stale_removes_dead_instances(lab: Lab) -> None:
    """Leftovers of a dead process go; the live lab stays."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    ns = f"xl{dead.pid}z-client"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    pin = lab.pin_root("unused").parent / f"xl{dead.pid}z-b1"
    pin.mkdir(parents=True)
    try:
        removed = cleanup_stale()
        assert any(r.endswith(ns) for r in removed)
        assert str(pin) in removed
        assert not pin.exists()
        assert lab.leftovers()  # the live lab was not touched
        lab.wait_reachable("client", "b1")
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        if pin.exists():
            pin.rmdir()


def test_host_commands_attach_count_and_detach(lab_factory: Any) -> None:
    """`xdplb host attach/status/detach`, run inside a backend's namespace, is all a
    backend host needs: a GUE packet sent to it is decapsulated and counted."""
    small = lab_factory(backends=1)
    instance = f"{small.prefix}-b1"
    small.pin_root("b1")  # removed at teardown whatever happens
    cli = [sys.executable, "-m", "xdplb.cli.app", "host"]
    b1 = [str(small.addr("b1", 4)), str(small.addr("b1", 6))]
    small.run(
        "b1", [*cli, "attach", "--dev", "eth0", "--addr", b1[0], "--addr", b1[1], "-i", instance]
    )
    bad = small.run(
        "b1", [*cli, "attach", "--dev", "eth0", "--addr", "nope", "-i", instance], check=False
    )
    assert bad.returncode == 2 and "--addr" in bad.stderr

    inner = IP(src=str(small.addr("client")), dst=str(small.vips[0])) / UDP(sport=1, dport=9)
    frame = ether(
        gue_encap(inner, small.addr("client"), small.addr("b1")),
        src=small.mac("client"),
        dst=small.mac("b1"),
    )
    with small.enter("client"):
        raw = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    with raw:
        raw.bind(("eth0", 0))
        raw.send(frame)
    deadline = time.monotonic() + 2
    while True:
        out = small.run("b1", [*cli, "status", "-i", instance, "--json"]).stdout
        if json.loads(out)["events"]["decap_gue"] >= 1:
            break
        assert time.monotonic() < deadline, out
        time.sleep(0.05)

    small.run("b1", [*cli, "detach", "--dev", "eth0", "-i", instance])
    assert not paths.pin_root(instance).exists()
    gone = small.run("b1", [*cli, "status", "-i", instance], check=False)
    assert gone.returncode == 3
