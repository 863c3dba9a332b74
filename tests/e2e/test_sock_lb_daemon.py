"""The daemon's socket_lb section end to end: a real ``xdplb run`` in a fresh namespace,
clients in a cgroup, backends on loopback addresses. Clients reach the VIPs' backends by
the configured weights and see only the VIP; a backend whose health check fails gets no
new connection and the UDP sockets connected to it are reset; a reload changes the
weights. The daemon's status and metrics say where sock_lb is attached, how many backends
each VIP's table holds, and what sock_lb counted."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from xdplb.cli.client import Client
from xdplb.control.status import SocketLbStatus
from xdplb.core import paths
from xdplb.daemon.main import read_pid
from xdplb.datapath import sock_lb
from xdplb.datapath.sock_lb import SockLb, SockLbEvent
from xdplb.lab import netns as netns_mod
from xdplb.lab.cgroup_clients import argv, child_cgroup
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.e2e

VIP = "127.0.0.10"
TCP_PORT, UDP_PORT, CHECK_PORT = 8080, 5353, 9000
BACKENDS = {"b1": "127.0.0.2", "b2": "127.0.0.3", "b3": "127.0.0.4"}
FLOWS = 300
#: Buckets of every table: a prime over 100 x the backends (shares within 1%), small enough
#: that reading the tables back while waiting for them costs little.
TABLE_SIZE = 2039
#: A backend's share of FLOWS flows is binomial (each socket's bucket is a hash of its
#: cookie): 4.5 standard deviations, about one check in 150,000 fails by chance.
SIGMAS = 4.5


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture
def cgroup() -> Iterator[Path]:
    with child_cgroup("socklbd") as path:
        yield path


class Servers:
    """Each backend answers with its name on TCP and UDP, and accepts health checks on
    CHECK_PORT until :meth:`fail_check`; threads of this process, outside the cgroup."""

    def __init__(self, ns: str) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self.checks: dict[str, socket.socket] = {}
        with netns_mod.enter(ns):
            for name, addr in BACKENDS.items():
                tcp = socket.create_server((addr, TCP_PORT), backlog=1024)
                udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                udp.bind((addr, UDP_PORT))
                check = socket.create_server((addr, CHECK_PORT), backlog=64)
                self.checks[name] = check
                for s, loop in ((tcp, self._tcp), (udp, self._udp), (check, self._tcp)):
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
            except OSError:  # closed by fail_check
                return
            with conn:
                conn.sendall(name)

    def _udp(self, s: socket.socket, name: bytes) -> None:
        while not self._stop.is_set():
            try:
                _, src = s.recvfrom(64)
            except TimeoutError:
                continue
            s.sendto(name, src)

    def fail_check(self, name: str) -> None:
        """Close ``name``'s health-check listener: its checks are refused from now on."""
        self.checks[name].close()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for s in self._socks:
            s.close()


@pytest.fixture
def servers(netns: str) -> Iterator[Servers]:
    srv = Servers(netns)
    try:
        yield srv
    finally:
        srv.close()


def config(instance: str, cgroup: Path, weights: dict[str, int]) -> dict[str, Any]:
    """Two VIPs (TCP and UDP) over the three backends, each checked by TCP every 100 ms."""
    health = {
        "checker": {"tcp": {"check_port": CHECK_PORT}},
        "interval_ms": 100,
        "timeout_ms": 100,
        "rise_count": 1,
        "fall_count": 1,
        "via": "direct",
    }
    backends = [{"address": BACKENDS[n], "weight": w} for n, w in weights.items()]
    return {
        "instance": instance,
        "tunnel": {"source_v4": "127.0.0.1"},
        "table_size": TABLE_SIZE,
        "vips": [
            {
                "address": VIP,
                "port": port,
                "protocol": proto,
                "health": health,
                "backends": backends,
            }
            for port, proto in ((TCP_PORT, "tcp"), (UDP_PORT, "udp"))
        ],
        "socket_lb": {"cgroup": str(cgroup)},
    }


class Daemon:
    """``xdplb run`` in the namespace, its configuration file written here."""

    def __init__(self, ns: str, workdir: Path) -> None:
        self.ns = ns
        self.path = workdir / "xdplb.yaml"
        self.log = workdir / "xdplb.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def write(self, doc: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(doc))
        tmp.replace(self.path)

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = netns_mod.popen(
                self.ns,
                [sys.executable, "-m", "xdplb.cli.app", "run", "-c", str(self.path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        proc = self.proc

        def pid() -> int | None:
            assert proc.poll() is None, f"the daemon exited: {self.tail()}"
            return read_pid(self.ns)

        wait_for(pid, "the daemon's pid file", until=lambda p: p == proc.pid, timeout=30)

    def sighup(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def tail(self) -> str:
        return self.log.read_text()[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def daemon(netns: str, cgroup: Path, servers: Servers, tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(netns, tmp_path)
    d.write(config(netns, cgroup, {"b1": 1, "b2": 1, "b3": 2}))
    try:
        d.start()
        yield d
    finally:
        d.stop()
        sock_lb.detach(netns)
        with contextlib.suppress(FileNotFoundError):
            paths.pid_file(netns).unlink()


# -- helpers ---------------------------------------------------------------------------


def client(ns: str, cg: Path, mode: str, port: int, n: int) -> dict[str, Any]:
    done = netns_mod.run(ns, argv(cg, mode, addr=VIP, port=port, n=n), timeout=30)
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def tables(lb: SockLb) -> dict[int, dict[str, int]]:
    """VIP port -> backend name -> buckets of its table."""
    names = {addr: n for n, addr in BACKENDS.items()}
    return {
        s.port: {names[str(ep.address)]: n for ep, n in s.buckets.items()} for s in lb.services()
    }


def assert_shares(names: dict[str, int], weights: dict[str, int]) -> None:
    total = sum(weights.values())
    assert set(names) == {n for n, w in weights.items() if w}, names
    for name, w in weights.items():
        p = w / total
        tolerance = SIGMAS * math.sqrt(p * (1 - p) / FLOWS)
        assert names.get(name, 0) / FLOWS == pytest.approx(p, abs=tolerance), names


def wait_tables(lb: SockLb, weights: dict[str, int], daemon: Daemon) -> None:
    """Until both VIPs' tables give each backend its share of buckets (within 1%)."""
    total = sum(weights.values())

    def close_enough(t: dict[int, dict[str, int]]) -> bool:
        if set(t) != {TCP_PORT, UDP_PORT}:
            return False
        for got in t.values():
            size = sum(got.values())
            if set(got) != {n for n, w in weights.items() if w}:
                return False
            if any(abs(got[n] / size - w / total) > 0.01 for n, w in weights.items() if w):
                return False
        return True

    wait_for(
        lambda: tables(lb),
        f"sock_lb's tables at weights {weights}",
        until=close_enough,
        timeout=20,
        detail=daemon.tail,
    )


def socket_lb_status(api: Client) -> SocketLbStatus:
    st = api.status().socket_lb
    assert st is not None
    return st


def backends_up(api: Client) -> dict[str, tuple[int, int]]:
    """VIP name -> (backends up, backends), as the daemon's status says."""
    return {s.name: (s.backends_up, s.backends) for s in socket_lb_status(api).services}


def socklb_events(api: Client) -> dict[str, float]:
    """``xdplb_socklb_events_total`` by event, from the daemon's metrics."""
    text = api.request("GET", "/metrics").text
    return {
        s.labels["event"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "xdplb_socklb_events_total"
    }


# -- the test ----------------------------------------------------------------------------


def test_daemon_balances_sockets_by_its_tables_and_health(
    netns: str, cgroup: Path, servers: Servers, daemon: Daemon
) -> None:
    tcp_vip, udp_vip = f"{VIP}:{TCP_PORT}/tcp", f"{VIP}:{UDP_PORT}/udp"
    with SockLb(netns) as lb, Client(netns) as api:
        wait_tables(lb, {"b1": 1, "b2": 1, "b3": 2}, daemon)
        assert lb.attached()
        st = socket_lb_status(api)
        assert (st.cgroup, st.attached) == (str(cgroup), True)
        assert [(s.name, s.table_size) for s in st.services] == [
            (tcp_vip, TABLE_SIZE),
            (udp_vip, TABLE_SIZE),
        ]
        assert backends_up(api) == {tcp_vip: (3, 3), udp_vip: (3, 3)}
        connects = socklb_events(api)["connect"]

        # Every backend by weight; the application sees only the VIP.
        tcp = client(netns, cgroup, "tcp", TCP_PORT, FLOWS)
        udp = client(netns, cgroup, "udp", UDP_PORT, FLOWS)
        assert tcp["errors"] == {} and udp["errors"] == {}
        # Each TCP flow was one connect() sock_lb rewrote (the UDP ones are sendto()).
        assert socklb_events(api)["connect"] - connects >= FLOWS
        assert_shares(tcp["names"], {"b1": 1, "b2": 1, "b3": 2})
        assert_shares(udp["names"], {"b1": 1, "b2": 1, "b3": 2})
        assert tcp["peers"] == {f"{VIP} {TCP_PORT}": FLOWS}
        assert udp["sources"] == {f"{VIP} {UDP_PORT}": FLOWS}

        # Connected UDP sockets on every backend; then b2's health check fails.
        hold = netns_mod.popen(
            netns,
            argv(cgroup, "hold", addr=VIP, port=UDP_PORT, connected=60, unconnected=0),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert hold.stdout is not None and hold.stdin is not None
            held = [name for name, _peer in json.loads(hold.stdout.readline())["connected"]]
            assert "b2" in held, held
            destroyed_before = lb.events()[SockLbEvent.DESTROYED]
            servers.fail_check("b2")
            wait_tables(lb, {"b1": 1, "b3": 2}, daemon)
            assert backends_up(api) == {tcp_vip: (2, 3), udp_vip: (2, 3)}
            # The daemon destroys b2's connected sockets right after the tables change.
            wait_for(
                lambda: lb.events()[SockLbEvent.DESTROYED] - destroyed_before,
                "b2's connected UDP sockets destroyed",
                until=lambda n: n == held.count("b2"),
                timeout=5,
                detail=daemon.tail,
            )
            hold.stdin.write("\n")
            hold.stdin.flush()
            answers = json.loads(hold.stdout.readline())["connected"]
            after = [(name, pending) for name, (pending, _got) in zip(held, answers, strict=True)]
        finally:
            hold.kill()
            hold.wait()
        # b2's sockets got ECONNABORTED (their owners reconnect); the others nothing.
        assert {(n, e) for n, e in after} <= {("b2", "ECONNABORTED"), ("b1", None), ("b3", None)}
        assert [e for n, e in after if n == "b2"] == ["ECONNABORTED"] * held.count("b2")

        tcp = client(netns, cgroup, "tcp", TCP_PORT, FLOWS)
        assert tcp["errors"] == {}
        assert_shares(tcp["names"], {"b1": 1, "b3": 2})

        # A reload changes the weights (b2 is still down).
        daemon.write(config(netns, cgroup, {"b1": 3, "b2": 1, "b3": 1}))
        daemon.sighup()
        wait_tables(lb, {"b1": 3, "b3": 1}, daemon)
        tcp = client(netns, cgroup, "tcp", TCP_PORT, FLOWS)
        udp = client(netns, cgroup, "udp", UDP_PORT, FLOWS)
        assert tcp["errors"] == {} and udp["errors"] == {}
        assert_shares(tcp["names"], {"b1": 3, "b3": 1})
        assert_shares(udp["names"], {"b1": 3, "b3": 1})

    # SIGTERM: the daemon exits, sock_lb stays attached (as lb_xdp does) and balancing.
    daemon.stop()
    assert (sock_lb.pin_dir(netns) / sock_lb.LINKS_SUBDIR).is_dir()
    tcp = client(netns, cgroup, "tcp", TCP_PORT, 50)
    assert tcp["errors"] == {} and set(tcp["names"]) <= {"b1", "b3"}
    # xdplb stop removes the instance's pins, sock_lb's links with them: the VIP is
    # no longer rewritten (nothing listens on it).
    netns_mod.run(netns, [sys.executable, "-m", "xdplb.cli.app", "stop", "-i", netns])
    assert not sock_lb.pin_dir(netns).exists()
    tcp = client(netns, cgroup, "tcp", TCP_PORT, 5)
    assert tcp["errors"] == {"ECONNREFUSED": 5}
