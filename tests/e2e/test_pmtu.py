"""Path MTU discovery through the balancer, in the lab (docs/datapath.md step 4b).

The backends' replies to the client go through a router, ``rt``, whose route to the
client has a smaller MTU than the client's 1400 (``Lab(reply_mtu=...)``). A backend's
full-size TCP segment makes ``rt`` send "fragmentation needed" (IPv4) or "packet too
big" (IPv6) to the segment's source, the VIP; ``rt`` routes the VIP via the LB, and
lb_xdp forwards the error to the backend that owns the quoted connection, whose kernel
lowers its path MTU to the client and retransmits smaller segments.

A transfer of 1 MB from the backend to the client must complete that way, with the
LB's ``ICMP_ERROR`` counter moving by exactly the errors ``rt`` sent and the backend's
route cache holding the lowered MTU. The control run, on a fresh connection after the
route caches are flushed, drops those errors on ``rt``'s egress: the same transfer
stalls, so the test cannot pass without the forwarded ICMP.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from xdplb.core import paths
from xdplb.core.abi import Event
from xdplb.datapath import BpfObject, tc_attach, tc_hook_destroy
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.listeners import BackendListeners
from xdplb.lab.topology import IPV6_MIN_MTU
from xdplb.lab.traffic import open_socket
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP4 = "198.18.100.1"
VIP6 = "fd78:6470:6c62:100::1"
PORT = 9000
REPLY_MTU = 1200  # IPv4; IPv6 gets IPV6_MIN_MTU (1280), still below the client's 1400
SIZE = 1 << 20
PAYLOAD = os.urandom(SIZE)
#: The control run waits this long for a transfer that, with PMTU discovery working,
#: takes well under a second.
STALL_WAIT = 3.0


class BulkServer(BackendListeners):
    """On every backend, ``[::]:PORT``: on accept, send ``<name>\\n`` alone (a small
    segment: it reaches the client whatever the path MTU), then :data:`PAYLOAD`, then
    close."""

    def __init__(self, lab: Lab) -> None:
        super().__init__(lab, PORT)

    def handle(self, name: str, conn: socket.socket, peer: tuple[str, int]) -> None:
        conn.sendall(f"{name}\n".encode())
        conn.sendall(PAYLOAD)


@dataclass
class Transfer:
    backend: str
    received: bytes
    seconds: float

    @property
    def complete(self) -> bool:
        return self.received == PAYLOAD


def transfer(lab: Lab, vip: str, src_port: int, wait: float) -> Transfer:
    """One connection to ``vip``: the backend's name and what arrived within ``wait``
    seconds. The connection is reset at the end, never left retransmitting."""
    sock = open_socket(lab.ns("client"), vip, socket.SOCK_STREAM, src_port)
    # Closed with a reset: the backend stops sending at once.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    t0 = time.monotonic()
    try:
        sock.settimeout(wait)
        sock.connect((vip, PORT))
        head = b""
        while b"\n" not in head:
            chunk = sock.recv(64)
            assert chunk, f"{vip}: closed before the backend said its name"
            head += chunk
        name, _, rest = head.partition(b"\n")
        data = bytearray(rest)
        while len(data) < SIZE:
            left = t0 + wait - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                break
            if not chunk:
                break
            data += chunk
        return Transfer(name.decode(), bytes(data), time.monotonic() - t0)
    finally:
        sock.close()


def wait_gone(lab: Lab, backend: str, client_port: int, timeout: float = 5.0) -> None:
    """Until ``backend`` has no socket of the connection from ``client_port``."""
    wait_for(
        lambda: lab.run(backend, ["ss", "-Htn", f"dport = :{client_port}"]).stdout.strip(),
        f"{backend} dropping the connection from port {client_port}",
        until=lambda sockets: not sockets,
        timeout=timeout,
        interval=0.05,
    )


def route_mtu(lab: Lab, node: str, family: int) -> int | None:
    """The MTU ``ip route get <client>`` shows in ``node`` (a learnt path MTU), if any."""
    out = lab.run(node, ["ip", f"-{family}", "route", "get", str(lab.addr("client", family))])
    m = re.search(r"\bmtu (?:lock )?(\d+)", out.stdout)
    return int(m.group(1)) if m else None


def flush_route_caches(lab: Lab) -> None:
    for name in lab.backends:
        for family in (4, 6):
            lab.run(name, ["ip", f"-{family}", "route", "flush", "cache"])


def icmp_sent(lab: Lab, family: int) -> int:
    """Frag-needed / packet-too-big messages ``rt`` has sent (its SNMP counters)."""
    if family == 4:
        lines = lab.run("rt", ["cat", "/proc/net/snmp"]).stdout.splitlines()
        head, vals = (line.split()[1:] for line in lines if line.startswith("Icmp:"))
        return int(dict(zip(head, vals, strict=True))["OutDestUnreachs"])
    out = lab.run("rt", ["cat", "/proc/net/snmp6"]).stdout
    return int(dict(line.split() for line in out.splitlines())["Icmp6OutPktTooBigs"])


def icmp_errors(lb: LbNode) -> int:
    with lb.maps() as maps:
        return maps.counters(exact_conns=False).events[Event.ICMP_ERROR]


class DropTooBig:
    """tests/bpf/progs/lab_drop_too_big.bpf.c on ``rt``'s egress: the frag-needed /
    packet-too-big messages it sends are dropped and counted. The control run. (lb_xdp
    runs before any filter on the LB, so the errors are stopped where they are made.)"""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.obj = BpfObject.load(paths.test_object("lab_drop_too_big"))
        self.ifindex = lab.ifindex("rt")

    def __enter__(self) -> DropTooBig:
        with self.lab.enter("rt"):
            tc_attach(self.obj.program("lab_drop_too_big"), self.ifindex, ingress=False)
        return self

    def dropped(self) -> int:
        raw = self.obj.map("lab_dropped").lookup((0).to_bytes(4, "little"))
        assert raw is not None
        return int.from_bytes(raw, "little")

    def __exit__(self, *exc: object) -> None:
        with self.lab.enter("rt"):
            tc_hook_destroy(self.ifindex)
        self.obj.close()


def backends(lab: Lab, family: int) -> list[dict[str, str]]:
    return [{"address": str(lab.addr(b, family))} for b in lab.backends]


@pytest.fixture(scope="module")
def pmtu_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Lab, LbNode]]:
    cleanup_stale()
    with Lab(backends=2, reply_mtu=REPLY_MTU) as lab:
        for name in lab.backends:
            attach_host(lab, name)
        vips = [
            {"address": vip, "port": PORT, "backends": backends(lab, family)}
            for vip, family in ((VIP4, 4), (VIP6, 6))
        ]
        lb = LbNode(lab, Path(tmp_path_factory.mktemp("pmtu")), vips)
        lb.start()
        server = BulkServer(lab)
        try:
            yield lab, lb
        finally:
            server.close()
            lb.destroy()


@pytest.mark.parametrize(("vip", "family"), [(VIP4, 4), (VIP6, 6)])
def test_transfer_completes_through_forwarded_too_big(
    pmtu_lab: tuple[Lab, LbNode], vip: str, family: int
) -> None:
    lab, lb = pmtu_lab
    mtu = REPLY_MTU if family == 4 else IPV6_MIN_MTU
    base_port = 20000 if family == 4 else 21000

    # Control: the router's errors never leave it; a fresh flow, no path MTU learnt.
    flush_route_caches(lab)
    assert {route_mtu(lab, b, family) for b in lab.backends} == {1400}
    errors0 = icmp_errors(lb)
    with DropTooBig(lab) as drop:
        stalled = transfer(lab, vip, base_port, STALL_WAIT)
        # Until the reset has reached the backend, it retransmits: errors about those
        # retransmissions must not get through once the filter is gone.
        wait_gone(lab, stalled.backend, base_port)
        dropped = drop.dropped()
        assert icmp_errors(lb) == errors0
        assert route_mtu(lab, stalled.backend, family) == 1400
    assert stalled.backend in lab.backends
    assert not stalled.complete and len(stalled.received) < SIZE // 10, (
        f"{len(stalled.received)} bytes arrived with the router's errors dropped"
    )
    assert dropped > 0, "the router sent no too-big error: the path MTU is not in play"

    # The real run: the same transfer on a fresh flow, the errors reach the LB.
    flush_route_caches(lab)
    errors1, sent1 = icmp_errors(lb), icmp_sent(lab, family)
    done = transfer(lab, vip, base_port + 1, 10.0)
    assert done.complete, (
        f"{vip}: {len(done.received)} of {SIZE} bytes in {done.seconds:.1f} s from {done.backend}"
    )
    sent = icmp_sent(lab, family) - sent1
    forwarded = icmp_errors(lb) - errors1
    assert sent > 0
    assert forwarded == sent, f"rt sent {sent} too-big errors, the LB forwarded {forwarded}"
    # The backend that served the flow learnt the smaller MTU, the other one nothing.
    assert route_mtu(lab, done.backend, family) == mtu
    others = {route_mtu(lab, b, family) for b in lab.backends if b != done.backend}
    assert others == {1400}
    print(
        f"IPv{family}: {SIZE} bytes in {done.seconds * 1000:.1f} ms via {done.backend}; rt sent "
        f"{sent} errors, lb forwarded {forwarded}; control: {len(stalled.received)} bytes "
        f"in {STALL_WAIT} s, {dropped} errors dropped"
    )
