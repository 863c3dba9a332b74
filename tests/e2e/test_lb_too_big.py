"""The balancer's own "too big" answer, in the lab (docs/datapath.md step 12, ``lib/lb_ptb.h``),
from lb_tc (the lab's hook on veth).

The LB's routes to the backends get a locked MTU of 1400 -- the client's own MTU -- so
a full-size client packet no longer fits once encapsulated (bpf_fib_lookup() says
``FRAG_NEEDED``; it honours a route MTU only when locked). With ``tunnel:
{icmp_too_big: true}`` lb_xdp answers such a packet itself, from the VIP: ICMP
"fragmentation needed" / ICMPv6 "packet too big" naming 1400 - the tunnel overhead.
The client's kernel lowers its path MTU to the VIP and retransmits smaller segments.

A 1 MB upload from the client to a VIP must complete that way, byte for byte (the
backend answers with the count and SHA-256 of what it got), with the LB's ``ICMP_PTB``
event moving by exactly the errors the client received and the client's route cache
holding the lowered MTU. The control run, on a fresh connection after the daemon
reloaded with the option off and the client's route cache was flushed: the same upload
makes no progress in :data:`STALL_WAIT` seconds and the ``TOO_BIG`` drop counter moves,
so the test cannot pass without the answer.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from xdplb.core.abi import DropReason, Event
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host
from xdplb.lab.lbnode import LbNode
from xdplb.lab.listeners import BackendListeners
from xdplb.lab.topology import CLIENT_MTU
from xdplb.lab.traffic import open_socket

pytestmark = pytest.mark.e2e

VIP4, VIP6 = "198.18.100.1", "fd78:6470:6c62:100::1"
#: IPv4 in IPv4 (IPIP) instead of GUE.
IPIP4 = "198.18.100.3"
PORT = 9100
#: The route MTU from the LB to each backend: the client's, so nothing encapsulated fits.
ROUTE_MTU = CLIENT_MTU
#: Outer headers lb_xdp adds (lib/encap.h): IP + UDP 8 + GUE 4 + private 4 + one hop.
OVERHEAD = {VIP4: 20 + 8 + 4 + 4 + 4, VIP6: 40 + 8 + 4 + 4 + 16, IPIP4: 20}
SIZE = 1 << 20
PAYLOAD = os.urandom(SIZE)
DIGEST = hashlib.sha256(PAYLOAD).hexdigest()
#: The control run waits this long for an upload that, answered, takes well under a second.
STALL_WAIT = 3.0


class SinkServer(BackendListeners):
    """On every backend, ``[::]:PORT``: reads until the client shuts down its side, then
    answers ``<name> <bytes> <sha256>\\n``. What each connection has received so far is
    in :attr:`received`, by client port."""

    def __init__(self, lab: Lab) -> None:
        self.received: dict[int, int] = {}
        super().__init__(lab, PORT)

    def handle(self, name: str, conn: socket.socket, peer: tuple[str, int]) -> None:
        port = peer[1]
        self.received[port] = 0
        digest = hashlib.sha256()
        while chunk := conn.recv(1 << 16):
            digest.update(chunk)
            self.received[port] += len(chunk)
        conn.sendall(f"{name} {self.received[port]} {digest.hexdigest()}\n".encode())


@dataclass
class Upload:
    #: The backend's answer (``name bytes sha256``), or None if none came in time.
    answer: str | None
    seconds: float

    @property
    def complete(self) -> bool:
        return self.answer is not None and self.answer.split()[1:] == [str(SIZE), DIGEST]


def upload(lab: Lab, vip: str, src_port: int, wait: float) -> Upload:
    """One connection to ``vip`` from ``src_port``: send :data:`PAYLOAD`, shut down,
    read the backend's answer, all within ``wait`` seconds. The connection is reset at
    the end, never left retransmitting."""
    sock = open_socket(lab.ns("client"), vip, socket.SOCK_STREAM, src_port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    t0 = time.monotonic()
    try:
        # Since Python 3.5 the timeout bounds the whole sendall, not each chunk.
        sock.settimeout(wait)
        sock.connect((vip, PORT))
        sock.sendall(PAYLOAD)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while not answer.endswith(b"\n"):
            sock.settimeout(max(0.01, t0 + wait - time.monotonic()))
            chunk = sock.recv(256)
            assert chunk, f"{vip}: closed before the backend answered"
            answer += chunk
        return Upload(answer.decode().strip(), time.monotonic() - t0)
    except TimeoutError:
        return Upload(None, time.monotonic() - t0)
    finally:
        sock.close()


def client_route_mtu(lab: Lab, vip: str) -> int | None:
    """The MTU ``ip route get <vip>`` shows on the client (a learnt path MTU), if any."""
    out = lab.run("client", ["ip", "route", "get", vip]).stdout
    m = re.search(r"\bmtu (?:lock )?(\d+)", out)
    return int(m.group(1)) if m else None


def client_icmp_in(lab: Lab, family: int) -> int:
    """Frag-needed (all destination unreachables) / packet-too-big messages the client
    has received (its SNMP counters)."""
    if family == 4:
        lines = lab.run("client", ["cat", "/proc/net/snmp"]).stdout.splitlines()
        head, vals = (line.split()[1:] for line in lines if line.startswith("Icmp:"))
        return int(dict(zip(head, vals, strict=True))["InDestUnreachs"])
    out = lab.run("client", ["cat", "/proc/net/snmp6"]).stdout
    return int(dict(line.split() for line in out.splitlines())["Icmp6InPktTooBigs"])


def counters(lb: LbNode) -> tuple[int, int]:
    """The LB's ``ICMP_PTB`` events and ``TOO_BIG`` drops."""
    with lb.maps() as maps:
        c = maps.counters(exact_conns=False)
    return c.events[Event.ICMP_PTB], c.drops[DropReason.TOO_BIG]


def vips(lab: Lab) -> list[dict[str, Any]]:
    def backends(family: int) -> list[dict[str, str]]:
        return [{"address": str(lab.addr(b, family))} for b in lab.backends]

    return [
        {"address": VIP4, "port": PORT, "backends": backends(4)},
        {"address": VIP6, "port": PORT, "backends": backends(6)},
        {"address": IPIP4, "port": PORT, "encap": "ipip", "backends": backends(4)},
    ]


def tunnel(lab: Lab, too_big: bool) -> dict[str, Any]:
    return {
        "source_v4": str(lab.addr("lb", 4)),
        "source_v6": str(lab.addr("lb", 6)),
        "icmp_too_big": too_big,
    }


@pytest.fixture(scope="module")
def too_big_lab(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Lab, LbNode, SinkServer]]:
    cleanup_stale()
    with Lab(backends=2) as lab:
        lab.add_vip_to_backends(IPIP4)
        # The client's segments arrive one per packet, as a remote client's do through a
        # router: only then is a full-size packet too big. A local sender's TSO packets
        # leave lb_tc with their segments shrunk by the tunnel (test_offloads.py) and
        # need no answer. Checksum offload stays on.
        lab.run("client", ["ethtool", "-K", "eth0", "tso", "off", "gso", "off"])
        for name in lab.backends:
            attach_host(lab, name)
            # Before lb_xdp sees a packet: no next hop is cached with the 1500-byte MTU.
            for family in (4, 6):
                dst = f"{lab.addr(name, family)}/{32 if family == 4 else 128}"
                route = ["route", "replace", dst, "dev", "eth0", "mtu", "lock", str(ROUTE_MTU)]
                lab.run("lb", ["ip", f"-{family}", *route])
        lb = LbNode(
            lab, Path(tmp_path_factory.mktemp("too_big")), vips(lab), tunnel=tunnel(lab, True)
        )
        lb.start()
        server = SinkServer(lab)
        try:
            yield lab, lb, server
        finally:
            server.close()
            lb.destroy()


@pytest.mark.parametrize(("vip", "family"), [(VIP4, 4), (VIP6, 6), (IPIP4, 4)])
def test_upload_completes_through_the_lbs_too_big(
    too_big_lab: tuple[Lab, LbNode, SinkServer], vip: str, family: int
) -> None:
    lab, lb, server = too_big_lab
    mtu = ROUTE_MTU - OVERHEAD[vip]
    base_port = {VIP4: 22000, VIP6: 23000, IPIP4: 24000}[vip]

    # Answered: a fresh flow, no path MTU learnt yet.
    lab.run("client", ["ip", f"-{family}", "route", "flush", "cache"])
    assert client_route_mtu(lab, vip) is None
    ptb0, too_big0 = counters(lb)
    in0 = client_icmp_in(lab, family)
    done = upload(lab, vip, base_port, 10.0)
    assert done.complete, f"{vip}: answer {done.answer!r} after {done.seconds:.1f} s"
    ptb1, too_big1 = counters(lb)
    received = client_icmp_in(lab, family) - in0
    assert ptb1 > ptb0
    assert received == ptb1 - ptb0, f"the LB sent {ptb1 - ptb0} too-big answers, {received} came"
    assert too_big1 == too_big0, "a too-big packet was dropped with the answer on"
    assert client_route_mtu(lab, vip) == mtu

    # Control: the same upload with the option off, on a fresh flow.
    lb.reload(vips(lab), tunnel=tunnel(lab, False))
    try:
        lab.run("client", ["ip", f"-{family}", "route", "flush", "cache"])
        assert client_route_mtu(lab, vip) is None
        stalled = upload(lab, vip, base_port + 1, STALL_WAIT)
        ptb2, too_big2 = counters(lb)
        assert client_route_mtu(lab, vip) is None
    finally:
        lb.reload(vips(lab), tunnel=tunnel(lab, True))
    got = server.received.get(base_port + 1)
    assert not stalled.complete and stalled.answer is None
    assert got is not None and got < SIZE // 10, f"{got} bytes arrived without the answer"
    assert ptb2 == ptb1
    assert too_big2 > too_big1, "nothing was dropped too big: the tunnel MTU is not in play"
    print(
        f"{vip}: {SIZE} bytes in {done.seconds * 1000:.1f} ms, client path MTU {mtu}, "
        f"{ptb1 - ptb0} too-big answers; control: {got} bytes in {STALL_WAIT} s, "
        f"{too_big2 - too_big1} dropped TOO_BIG"
    )
