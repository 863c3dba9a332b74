"""sock_lb end to end: real clients in a cgroup, real backends on loopback addresses of a
fresh network namespace, every answer checked (who answered, which address it seemed to
come from, which calls failed and how).

Backends answer with their name: a TCP backend sends it and closes, a UDP backend sends
it back to whoever sent a datagram. Clients are subprocesses that move themselves into
the test's cgroup before they open a socket (a socket belongs to the cgroup of the
process that created it); the test process itself stays outside.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from xdplb.datapath import sock_lb
from xdplb.datapath.sock_lb import Endpoint, SockLb, SockLbEvent
from xdplb.lab import netns as netns_mod
from xdplb.lab.cgroup_clients import argv, child_cgroup
from xdplb.sockets.socklb_plan import Backend, Service, apply

pytestmark = pytest.mark.e2e

SVC4 = ipaddress.ip_address("127.0.0.10")
SVC6 = ipaddress.ip_address("fd00::10")
#: SVC4 as a dual-stack IPv6 socket names it (IPV6_V6ONLY off, Java's default), written as
#: the kernel reports it (Python 3.11 would print ::ffff:7f00:a).
MAPPED = f"::ffff:{SVC4}"
TCP_PORT, UDP_PORT = 80, 53
#: name -> (address, port), weights 1:1:2.
BACKENDS4 = {"b1": ("127.0.0.2", 8001), "b2": ("127.0.0.3", 8002), "b3": ("127.0.0.4", 8003)}
WEIGHTS = {"b1": 1, "b2": 1, "b3": 2}
BACKENDS6 = {"v1": ("fd00::2", 8001), "v2": ("fd00::3", 8002)}
#: Flows per share test, and the tolerance on a backend's share of them: 4.5 standard
#: deviations of a binomial share (each flow's bucket is a hash of its socket cookie),
#: so about one check in 150,000 fails by chance; the buckets themselves are within 1%.
FLOWS = 600
SIGMAS = 4.5


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture
def cgroup() -> Iterator[Path]:
    with child_cgroup("socklb") as path:
        yield path


class Servers:
    """Backends answering with their name, on sockets opened in the test's namespace and
    served by threads of this process (outside the cgroup)."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []

    def start(self, backends: dict[str, tuple[str, int]]) -> None:
        with netns_mod.enter(self.ns):
            for name, (addr, port) in backends.items():
                fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
                tcp = socket.socket(fam, socket.SOCK_STREAM)
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((addr, port))
                tcp.listen(1024)
                udp = socket.socket(fam, socket.SOCK_DGRAM)
                udp.bind((addr, port))
                for s, loop in ((tcp, self._tcp), (udp, self._udp)):
                    s.settimeout(0.2)
                    self._socks.append(s)
                    t = threading.Thread(target=loop, args=(s, name.encode()), daemon=True)
                    t.start()
                    self._threads.append(t)

    def _tcp(self, s: socket.socket, name: bytes) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = s.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(name)

    def _udp(self, s: socket.socket, name: bytes) -> None:
        while not self._stop.is_set():
            try:
                _, src = s.recvfrom(64)
            except TimeoutError:
                continue
            s.sendto(name, src)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for s in self._socks:
            s.close()


@pytest.fixture
def servers(netns: str) -> Iterator[Servers]:
    # The backends' addresses, and the IPv6 service's, so that binding it could work.
    for addr in ("fd00::2", "fd00::3", str(SVC6)):
        netns_mod.run(netns, ["ip", "addr", "add", f"{addr}/128", "dev", "lo", "nodad"])
    srv = Servers(netns)
    try:
        srv.start(BACKENDS4 | BACKENDS6)
        yield srv
    finally:
        srv.close()


@pytest.fixture
def lb(netns: str, cgroup: Path) -> Iterator[SockLb]:
    """sock_lb attached to the cgroup, pins under the namespace's pin directory."""
    obj = SockLb(netns)
    try:
        obj.attach(cgroup)
        yield obj
    finally:
        obj.close()
        sock_lb.detach(netns)


# -- helpers ---------------------------------------------------------------------------


def services(down: frozenset[str] = frozenset(), affinity_s: float = 0.0) -> list[Service]:
    def backends(table: dict[str, tuple[str, int]]) -> tuple[Backend, ...]:
        return tuple(
            Backend(Endpoint(ipaddress.ip_address(a), p), WEIGHTS.get(n, 1), up=n not in down)
            for n, (a, p) in table.items()
        )

    v4, v6 = backends(BACKENDS4), backends(BACKENDS6)
    return [
        Service(SVC4, TCP_PORT, socket.IPPROTO_TCP, v4, affinity_s=affinity_s),
        Service(SVC4, UDP_PORT, socket.IPPROTO_UDP, v4, affinity_s=affinity_s),
        Service(SVC6, TCP_PORT, socket.IPPROTO_TCP, v6),
        Service(SVC6, UDP_PORT, socket.IPPROTO_UDP, v6),
    ]


def client(ns: str, cg: Path | None, mode: str, **params: Any) -> dict[str, Any]:
    done = netns_mod.run(ns, argv(cg, mode, **params), timeout=30)
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def shares(names: dict[str, int]) -> dict[str, float]:
    total = sum(names.values())
    return {n: c / total for n, c in names.items()}


def expected_shares() -> dict[str, float]:
    total = sum(WEIGHTS.values())
    return {n: w / total for n, w in WEIGHTS.items()}


# -- tests -----------------------------------------------------------------------------


def test_tcp_and_udp_reach_every_backend_by_weight(
    netns: str, servers: Servers, lb: SockLb, cgroup: Path
) -> None:
    apply(lb, services())
    tcp = client(netns, cgroup, "tcp", addr=str(SVC4), port=TCP_PORT, n=FLOWS)
    udp = client(netns, cgroup, "udp", addr=str(SVC4), port=UDP_PORT, n=FLOWS)

    for got in (tcp, udp):
        assert got["errors"] == {}
        assert sum(got["names"].values()) == FLOWS
        for name, p in expected_shares().items():
            tolerance = SIGMAS * math.sqrt(p * (1 - p) / FLOWS)
            assert shares(got["names"])[name] == pytest.approx(p, abs=tolerance), got
    # The application only ever sees the service address.
    assert tcp["peers"] == {f"{SVC4} {TCP_PORT}": FLOWS}
    assert udp["sources"] == {f"{SVC4} {UDP_PORT}": FLOWS}
    events = lb.events()
    assert events[SockLbEvent.CONNECT] == FLOWS
    assert events[SockLbEvent.SENDMSG] == FLOWS
    assert events[SockLbEvent.RECVMSG] == FLOWS


def test_ipv6_service(netns: str, servers: Servers, lb: SockLb, cgroup: Path) -> None:
    apply(lb, services())
    tcp = client(netns, cgroup, "tcp", addr=str(SVC6), port=TCP_PORT, n=100)
    udp = client(netns, cgroup, "udp", addr=str(SVC6), port=UDP_PORT, n=100)
    assert set(tcp["names"]) == set(udp["names"]) == set(BACKENDS6)
    assert tcp["peers"] == {f"{SVC6} {TCP_PORT}": 100}
    assert udp["sources"] == {f"{SVC6} {UDP_PORT}": 100}


def test_a_dual_stack_socket_reaches_an_ipv4_service_by_its_mapped_address(
    netns: str, servers: Servers, lb: SockLb, cgroup: Path
) -> None:
    apply(lb, services())
    tcp = client(netns, cgroup, "tcp", addr=MAPPED, port=TCP_PORT, n=100)
    udp = client(netns, cgroup, "udp", addr=MAPPED, port=UDP_PORT, n=100)
    for got in (tcp, udp):
        assert got["errors"] == {} and set(got["names"]) == set(BACKENDS4), got
    # The IPv6 socket sees the address it asked for, mapped as it asked.
    assert tcp["peers"] == {f"{MAPPED} {TCP_PORT}": 100}
    assert udp["sources"] == {f"{MAPPED} {UDP_PORT}": 100}
    assert client(netns, cgroup, "bind", addr=MAPPED, port=TCP_PORT, proto="tcp") == {
        "error": "EPERM"
    }
    events = lb.events()
    assert (events[SockLbEvent.CONNECT], events[SockLbEvent.SENDMSG]) == (100, 100)
    assert events[SockLbEvent.BIND_REFUSED] == 1


def test_bind_to_a_service_address_is_refused(
    netns: str, servers: Servers, lb: SockLb, cgroup: Path
) -> None:
    apply(lb, services())
    for addr, proto, port in (
        (SVC4, "tcp", TCP_PORT),
        (SVC4, "udp", UDP_PORT),
        (SVC6, "tcp", TCP_PORT),
    ):
        got = client(netns, cgroup, "bind", addr=str(addr), port=port, proto=proto)
        assert got == {"error": "EPERM"}, (addr, proto)
    # Another port of the same address is no service: allowed.
    assert client(netns, cgroup, "bind", addr=str(SVC4), port=81, proto="tcp") == {"error": None}
    assert lb.events()[SockLbEvent.BIND_REFUSED] == 3


def test_processes_outside_the_cgroup_are_not_rewritten(
    netns: str, servers: Servers, lb: SockLb, cgroup: Path
) -> None:
    apply(lb, services())
    got = client(netns, None, "tcp", addr=str(SVC4), port=TCP_PORT, n=5)
    # Nothing listens on the service address itself.
    assert got == {"names": {}, "peers": {}, "errors": {"ECONNREFUSED": 5}}
    assert lb.events()[SockLbEvent.CONNECT] == 0


def test_affinity_keeps_a_client_on_one_backend_while_on(
    netns: str, servers: Servers, lb: SockLb, cgroup: Path
) -> None:
    apply(lb, services(affinity_s=60))
    tcp = client(netns, cgroup, "tcp", addr=str(SVC4), port=TCP_PORT, n=100)
    udp = client(netns, cgroup, "udp", addr=str(SVC4), port=UDP_PORT, n=100)
    assert len(tcp["names"]) == 1 and sum(tcp["names"].values()) == 100
    assert len(udp["names"]) == 1 and sum(udp["names"].values()) == 100
    assert lb.events()[SockLbEvent.AFFINITY_HIT] >= 198

    apply(lb, services(affinity_s=0))
    tcp = client(netns, cgroup, "tcp", addr=str(SVC4), port=TCP_PORT, n=100)
    assert set(tcp["names"]) == set(BACKENDS4)


@pytest.mark.parametrize(
    ("svc", "table", "down"),
    [(str(SVC4), BACKENDS4, "b3"), (str(SVC6), BACKENDS6, "v2"), (MAPPED, BACKENDS4, "b3")],
    ids=["ipv4", "ipv6", "ipv4-mapped"],
)
def test_a_backend_marked_down_gets_nothing_new_and_its_connected_udp_is_reset(
    netns: str,
    servers: Servers,
    lb: SockLb,
    cgroup: Path,
    svc: str,
    table: dict[str, tuple[str, int]],
    down: str,
) -> None:
    apply(lb, services())
    params = {"addr": svc, "port": UDP_PORT, "connected": 40, "unconnected": 40}
    with netns_mod.popen(
        netns,
        argv(cgroup, "hold", **params),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            assert holder.stdin is not None and holder.stdout is not None
            before = json.loads(holder.stdout.readline())
            on_down = [peer for name, peer in before["connected"] if name == down]
            assert on_down, before
            assert all(peer == f"{svc} {UDP_PORT}" for _, peer in before["connected"])

            with netns_mod.enter(netns):  # the iterator walks this namespace's sockets
                result = apply(lb, services(down=frozenset({down})))
            assert len(result.destroyed) == len(on_down)

            holder.stdin.write("go\n")
            holder.stdin.flush()
            after = json.loads(holder.stdout.readline())
        finally:
            holder.kill()

    for (name, _), (pending, got) in zip(before["connected"], after["connected"], strict=True):
        if name == down:
            # Destroyed: its error is ECONNABORTED (what a blocked recv returns), and it is
            # no longer connected, so a send without an address fails too.
            assert (pending, got) == ("ECONNABORTED", "error EDESTADDRREQ")
        else:
            assert (pending, got) == (None, name)
    # Unconnected sockets were left alone: still answered, from the service address,
    # by backends that are up.
    up = set(table) - {down}
    for name, src in after["unconnected"]:
        assert name in up and src == f"{svc} {UDP_PORT}"
    assert lb.events()[SockLbEvent.DESTROYED] == len(on_down)

    tcp = client(netns, cgroup, "tcp", addr=svc, port=TCP_PORT, n=100)
    assert tcp["errors"] == {} and set(tcp["names"]) == up

    # Every backend down: refused at connect (EPERM), not sent to an address nobody serves.
    apply(lb, services(down=frozenset(table)))
    got = client(netns, cgroup, "tcp", addr=svc, port=TCP_PORT, n=3)
    assert got["errors"] == {"EPERM": 3}
    assert lb.events()[SockLbEvent.NO_BACKEND] == 3


def test_pins_outlive_the_process_and_detach_removes_them(netns: str, cgroup: Path) -> None:
    try:
        with SockLb(netns) as first:
            first.attach(cgroup)
            apply(first, services())
        # A second process (here: a second load) finds the same maps and links.
        with SockLb(netns) as second:
            assert second.attached()
            states = second.services()
            assert {(str(s.address), s.port) for s in states} == {
                (str(SVC4), TCP_PORT),
                (str(SVC4), UDP_PORT),
                (str(SVC6), TCP_PORT),
                (str(SVC6), UDP_PORT),
            }
            second.attach(cgroup)  # swaps programs in place
            # Tables shrink and grow (the service entry and its table change in turn).
            for size in (1009, 65537):
                apply(second, [dataclasses.replace(s, table_size=size) for s in services()])
                for state in second.services():
                    assert state.table_size == size == sum(state.buckets.values())
    except BaseException:
        sock_lb.detach(netns)
        raise
    assert sock_lb.detach(netns)
    assert not sock_lb.pin_dir(netns).parent.exists()
    assert not sock_lb.detach(netns)
    # Nothing of ours is attached to the cgroup any more.
    out = subprocess.run(
        ["bpftool", "cgroup", "show", str(cgroup)], capture_output=True, text=True, check=True
    )
    assert "sock_lb" not in out.stdout


def test_attaching_to_another_cgroup_moves_every_hook(
    netns: str, servers: Servers, cgroup: Path
) -> None:
    """A daemon restarted with another ``socket_lb.cgroup`` (here: a second load): the
    hooks leave the first cgroup, whose clients reach the service address itself again."""
    try:
        with child_cgroup("socklb-moved") as other:
            with SockLb(netns) as first:
                first.attach(cgroup)
                apply(first, services())
                assert first.attached(cgroup) and not first.attached(other)
            before = client(netns, cgroup, "tcp", addr=str(SVC4), port=TCP_PORT, n=20)
            assert before["errors"] == {} and set(before["names"]) <= set(BACKENDS4)

            with SockLb(netns) as second:
                second.attach(other)
                assert second.attached(other) and not second.attached(cgroup)
                moved = client(netns, other, "tcp", addr=str(SVC4), port=TCP_PORT, n=20)
                left = client(netns, cgroup, "tcp", addr=str(SVC4), port=TCP_PORT, n=5)
            assert moved["errors"] == {} and set(moved["names"]) <= set(BACKENDS4)
            assert left == {"names": {}, "peers": {}, "errors": {"ECONNREFUSED": 5}}
            # One link per hook, none left behind by the move.
            links = sorted(p.name for p in (sock_lb.pin_dir(netns) / "links").iterdir())
            assert links == sorted(name for name, _ in sock_lb.HOOKS)
            shown = subprocess.run(
                ["bpftool", "cgroup", "show", str(cgroup)], capture_output=True, text=True
            )
            assert "sock_lb" not in shown.stdout
            sock_lb.detach(netns)
    finally:
        sock_lb.detach(netns)


def test_cli_attach_apply_status_detach(
    netns: str, servers: Servers, cgroup: Path, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from xdplb.cli.socklb import socklb_app

    def write(down: bool) -> Path:
        path = tmp_path / "socklb.yaml"
        b3 = BACKENDS4["b3"]
        path.write_text(
            f"cgroup: {cgroup}\n"
            "services:\n"
            f"  - {{address: {SVC4}, port: {TCP_PORT}, protocol: tcp, backends: [\n"
            f"      {{address: {BACKENDS4['b1'][0]}, port: {BACKENDS4['b1'][1]}}},\n"
            f"      {{address: {b3[0]}, port: {b3[1]}, up: {str(not down).lower()}}}]}}\n"
        )
        return path

    runner = CliRunner()
    try:
        done = runner.invoke(socklb_app, ["attach", "-c", str(write(False)), "-i", netns])
        assert done.exit_code == 0, done.output
        got = client(netns, cgroup, "tcp", addr=str(SVC4), port=TCP_PORT, n=60)
        assert set(got["names"]) == {"b1", "b3"}

        done = runner.invoke(socklb_app, ["apply", "-c", str(write(True)), "-i", netns])
        assert done.exit_code == 0, done.output
        got = client(netns, cgroup, "tcp", addr=str(SVC4), port=TCP_PORT, n=30)
        assert got["names"] == {"b1": 30}

        done = runner.invoke(socklb_app, ["status", "--json", "-i", netns])
        assert done.exit_code == 0, done.output
        doc = json.loads(done.output)
        assert doc["attached"] is True
        (svc,) = doc["services"]
        assert svc["buckets"] == {"127.0.0.2:8001": svc["table_size"]}
        assert doc["events"]["connect"] == 90
    finally:
        done = runner.invoke(socklb_app, ["detach", "-i", netns])
    assert done.exit_code == 0, done.output
    assert runner.invoke(socklb_app, ["status", "-i", netns]).exit_code == 3
