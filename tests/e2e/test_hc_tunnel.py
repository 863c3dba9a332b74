"""Health checks through the tunnel, in the lab (src/xdplb/datapath/hc.py).

In the LB's namespace a HealthTunnel sends marked sockets' traffic to the VIP through
hc_tc, which tunnels it to the backend the mark names; the backend's host_tc
decapsulates, the lab's servers answer from the VIP straight back. The LB's eth0 has tx
checksumming off, so what reaches the backends carries checksums computed for real
(a veth passes CHECKSUM_PARTIAL packets on unchecked otherwise): the backends verify
them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import socket
from collections.abc import Callable, Iterator

import pytest
from pyroute2 import IPRoute

from xdplb.core import abi, paths
from xdplb.datapath import tc_detach
from xdplb.datapath.hc import (
    HC_MARK_BASE,
    HC_MARK_MASK,
    HealthTunnel,
    destroy_health_tunnel,
    ifname_for,
    pin_dir,
    table_for,
)
from xdplb.lab import Lab, cleanup_stale
from xdplb.lab.host import attach_host

pytestmark = pytest.mark.e2e

VIP = {4: "198.18.100.1", 6: "fd78:6470:6c62:100::1"}
AF = {4: socket.AF_INET, 6: socket.AF_INET6}
HTTP_PORT, UDP_PORT = 80, 53
#: How long a check that must fail is given: a SYN retransmits after 1 s.
FAIL_TIMEOUT = 0.5
OK_TIMEOUT = 3.0

#: One mark per (backend, encapsulation, outer family): every tunnel variant.
TARGETS = list(itertools.product(("b1", "b2"), (abi.Encap.GUE, abi.Encap.IPIP), (4, 6)))


@dataclasses.dataclass
class HcLab:
    lab: Lab
    tunnel: HealthTunnel
    marks: dict[tuple[str, abi.Encap, int], int]


@pytest.fixture(scope="module")
def hc_lab() -> Iterator[HcLab]:
    cleanup_stale()
    with Lab(backends=2) as lab:
        for name in lab.backends:
            attach_host(lab, name)
        lab.start_servers()
        instance = f"{lab.prefix}-hc"
        lab.pin_root("hc")  # registered: the lab removes it at teardown
        with lab.enter("lb"):
            tunnel = HealthTunnel(instance, lab.addr("lb", 4), lab.addr("lb", 6), abi.GUE_PORT)
        marks = {t: HealthTunnel.mark_for(i + 1) for i, t in enumerate(TARGETS)}
        tunnel.set_targets({m: (lab.addr(b, fam), encap) for (b, encap, fam), m in marks.items()})

        def destroy() -> None:
            tunnel.close()
            with lab.enter("lb"):
                destroy_health_tunnel(instance)

        lab.on_teardown(destroy)
        yield HcLab(lab, tunnel, marks)


def _sock(family: int, kind: int, mark: int | None, timeout: float) -> socket.socket:
    s = socket.socket(AF[family], kind)
    if mark is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
    s.settimeout(timeout)
    return s


def http(
    lab: Lab, family: int, mark: int | None, body: bytes = b"", timeout: float = OK_TIMEOUT
) -> bytes:
    """An HTTP request from the LB to the VIP (POST with ``body``); the response body."""
    method = b"POST" if body else b"GET"
    req = (
        method + b" / HTTP/1.1\r\nHost: vip\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    with lab.enter("lb"), _sock(family, socket.SOCK_STREAM, mark, timeout) as s:
        s.connect((VIP[family], HTTP_PORT))
        s.sendall(req)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    head, _, payload = b"".join(chunks).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return payload


def syn_retransmits(lab: Lab) -> int:
    """SYNs the LB's namespace has sent again (TcpExtTCPSynRetrans)."""
    lines = lab.run("lb", ["cat", "/proc/net/netstat"]).stdout.splitlines()
    names, values = (line.split()[1:] for line in lines if line.startswith("TcpExt:"))
    return int(dict(zip(names, values, strict=True))["TCPSynRetrans"])


def udp_echo(lab: Lab, family: int, mark: int | None, timeout: float = OK_TIMEOUT) -> bytes:
    with lab.enter("lb"), _sock(family, socket.SOCK_DGRAM, mark, timeout) as s:
        s.sendto(b"are you there?", (VIP[family], UDP_PORT))
        data, peer = s.recvfrom(4096)
    assert peer[0] == VIP[family]
    return data


def _target_id(t: tuple[str, abi.Encap, int]) -> str:
    return f"{t[0]}-{t[1].name.lower()}-outer-v{t[2]}"


@pytest.mark.parametrize("family", [4, 6], ids=["vip-v4", "vip-v6"])
@pytest.mark.parametrize("target", TARGETS, ids=[_target_id(t) for t in TARGETS])
def test_check_reaches_the_marked_backend(
    hc_lab: HcLab, target: tuple[str, abi.Encap, int], family: int
) -> None:
    """TCP (HTTP GET) and UDP echo to the VIP answer from exactly the backend the mark
    names, for every encapsulation and outer family (4in6 and 6in4 included)."""
    backend = target[0]
    mark = hc_lab.marks[target]
    before = hc_lab.tunnel.counters()
    assert http(hc_lab.lab, family, mark) == f"{backend}\n".encode()
    assert udp_echo(hc_lab.lab, family, mark) == f"{backend}\nare you there?".encode()
    moved = {k: v - before[k] for k, v in hc_lab.tunnel.counters().items() if v != before[k]}
    assert set(moved) <= {"redirect", "redirect_neigh"}, moved
    assert sum(moved.values()) >= 4  # SYN, request, ACK(s), FIN, datagram


@pytest.mark.parametrize("family", [4, 6], ids=["vip-v4", "vip-v6"])
def test_large_request_is_segmented_and_checksummed(hc_lab: HcLab, family: int) -> None:
    """100 kB through the tunnel: TCP hands hc_tc GSO packets, which the LB's eth0
    segments and checksums after encapsulation; the backend gets every byte."""
    body = bytes(range(256)) * 400
    mark = hc_lab.marks[("b2", abi.Encap.GUE, family)]
    assert http(hc_lab.lab, family, mark, body) == b"b2\n" + body


@pytest.mark.parametrize("family", [4, 6], ids=["v4", "v6"])
def test_broken_decapsulation_fails_the_check(hc_lab: HcLab, family: int) -> None:
    """host_tc off b2: checks to b2 time out (GUE and IPIP), b1 still answers."""
    lab = hc_lab.lab
    att = lab.hosts["b2"]
    with lab.enter("b2"):
        tc_detach(att.ifindex, ingress=True)
    try:
        for encap in abi.Encap:
            mark = hc_lab.marks[("b2", encap, family)]
            with pytest.raises(TimeoutError):
                http(lab, family, mark, timeout=FAIL_TIMEOUT)
            with pytest.raises(TimeoutError):
                udp_echo(lab, family, mark, timeout=FAIL_TIMEOUT)
        assert http(lab, family, hc_lab.marks[("b1", abi.Encap.GUE, family)]) == b"b1\n"
    finally:
        with lab.enter("b2"):
            att.dp.attach(att.ifindex)
    assert http(lab, family, hc_lab.marks[("b2", abi.Encap.GUE, family)]) == b"b2\n"


@pytest.mark.parametrize("family", [4, 6], ids=["v4", "v6"])
def test_unmarked_socket_is_unaffected(hc_lab: HcLab, family: int) -> None:
    """The LB has no route to the VIPs of its own: without the mark, no tunnel."""
    before = hc_lab.tunnel.counters()
    with pytest.raises(OSError) as exc:
        http(hc_lab.lab, family, None)
    assert exc.value.errno == errno.ENETUNREACH
    with pytest.raises(OSError) as exc:
        udp_echo(hc_lab.lab, family, None)
    assert exc.value.errno == errno.ENETUNREACH
    assert hc_lab.tunnel.counters() == before


def test_unknown_mark_is_dropped_and_counted(hc_lab: HcLab) -> None:
    """A mark in the range with no target: routed to the device, dropped by hc_tc."""
    before = hc_lab.tunnel.counters()["drop_unknown_mark"]
    with pytest.raises(TimeoutError):
        udp_echo(hc_lab.lab, 4, HealthTunnel.mark_for(0xFFFF), timeout=0.3)
    assert hc_lab.tunnel.counters()["drop_unknown_mark"] == before + 1


# --- lifecycle: reuse on restart, complete removal ---------------------------------------


def _state(instance: str) -> dict[str, object]:
    """What of an instance's tunnel exists in the calling thread's namespace."""
    table = table_for(instance)
    with IPRoute() as ipr:
        links = ipr.link_lookup(ifname=ifname_for(instance))
        rules = [
            (fam, r.get_attr("FRA_TABLE"))
            for fam in (socket.AF_INET, socket.AF_INET6)
            for r in ipr.get_rules(family=fam)
            if r.get_attr("FRA_FWMARK") == HC_MARK_BASE and r.get_attr("FRA_FWMASK") == HC_MARK_MASK
        ]
        routes = [
            (fam, r["type"])
            for fam in (socket.AF_INET, socket.AF_INET6)
            for r in ipr.get_routes(family=fam, table=table)
        ]
    return {"links": links, "rules": sorted(rules), "routes": sorted(routes)}


def test_restart_reuses_and_destroy_removes_everything(lab_factory: Callable[..., Lab]) -> None:
    lab = lab_factory(backends=1)
    attach_host(lab, "b1")
    lab.start_servers()
    instance = f"{lab.prefix}-hc"
    lab.pin_root("hc")
    b1 = lab.addr("b1", 4)
    with lab.enter("lb"):
        # No IPv6 source: IPv6 checks are unreachable at once, never sent some other way.
        first = HealthTunnel(instance, lab.addr("lb", 4), None, abi.GUE_PORT)
        first.set_targets({HealthTunnel.mark_for(7): (b1, abi.Encap.GUE)})
        made = _state(instance)
        first.close()
        with contextlib.ExitStack() as stack:
            second = HealthTunnel(instance, lab.addr("lb", 4), None, abi.GUE_PORT)
            stack.callback(second.close)
            # Same device, one rule per family, the target still in the pinned map.
            assert _state(instance) == made
            assert made["links"] == [second.ifindex]
            assert len(made["rules"]) == 2  # type: ignore[arg-type]
            assert second.targets() == {HealthTunnel.mark_for(7): (b1, abi.Encap.GUE, False)}
    # First contact: the LB has no neighbour entry for b1 yet, so hc_tc hands the packet
    # to bpf_redirect_neigh(), which must not lose it (no 1 s SYN retransmission).
    retrans = syn_retransmits(lab)
    assert http(lab, 4, HealthTunnel.mark_for(7)) == b"b1\n"
    assert syn_retransmits(lab) == retrans
    with lab.enter("lb"), HealthTunnel(instance, lab.addr("lb", 4), None, abi.GUE_PORT) as t:
        assert t.counters()["redirect_neigh"] == 1
    # The table's IPv6 default route is "unreachable": no falling through to main.
    with pytest.raises(OSError) as exc:
        http(lab, 6, HealthTunnel.mark_for(7))
    assert exc.value.errno == errno.EHOSTUNREACH

    with lab.enter("lb"):
        destroy_health_tunnel(instance)
        assert _state(instance) == {"links": [], "rules": [], "routes": []}
        destroy_health_tunnel(instance)  # idempotent
    assert not pin_dir(instance).exists()
    assert not paths.pin_root(instance).exists()
    # The address is free again for the unmarked world: the check now has no route.
    with pytest.raises(OSError) as exc:
        http(lab, 4, HealthTunnel.mark_for(7))
    assert exc.value.errno == errno.ENETUNREACH
