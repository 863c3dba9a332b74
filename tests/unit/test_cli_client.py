"""The CLI's API commands against a live uvicorn serving the fake controller on a unix
socket in a temporary run directory: output, exit codes, and a drain that --wait sees
finish."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fake_controller import FakeController
from typer.testing import CliRunner

from xdplb.cli.app import app
from xdplb.cli.args import EXIT_CONFIG, EXIT_NOT_RUNNING, EXIT_OK, EXIT_RUNTIME
from xdplb.cli.client import Client, NotRunning, parse_vip
from xdplb.control.sessions import Connection
from xdplb.control.status import (
    BgpSession,
    BgpStatus,
    ClusterStatus,
    FleetNode,
    SocketLbService,
    SocketLbStatus,
    Status,
    StoreStatus,
    SyncPeerStatus,
    SyncStatus,
)
from xdplb.core.paths import api_socket
from xdplb.daemon.api import create_app
from xdplb.lab.wait import wait_for

pytestmark = pytest.mark.unit

runner = CliRunner()
VIP = "198.18.100.1:80/tcp"


@dataclass
class Served:
    fake: FakeController
    socket: Path


def xdplb(*args: str, instance: str = "fake") -> tuple[int, str, str]:
    """Run the CLI; exit code, stdout, stderr."""
    r = runner.invoke(app, [*args, "-i", instance])
    return r.exit_code, r.stdout, r.stderr


def serve(
    fake: FakeController, sock: Path | None = None, token: str | None = None
) -> Iterator[uvicorn.Server]:
    """uvicorn in a thread, on a unix socket (or a free TCP port of 127.0.0.1)."""
    where = {"uds": str(sock)} if sock is not None else {"host": "127.0.0.1", "port": 0}
    server = uvicorn.Server(
        uvicorn.Config(create_app(fake, token=token), log_level="warning", lifespan="off", **where)
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    wait_for(lambda: server.started or not t.is_alive(), "uvicorn starting", timeout=5)
    assert t.is_alive(), "uvicorn died"
    try:
        yield server
    finally:
        server.should_exit = True
        t.join(5)
        assert not t.is_alive()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("XDPLB_TOKEN", raising=False)
    monkeypatch.delenv("XDPLB_API", raising=False)
    fake = FakeController()
    sock = api_socket("fake")
    assert sock.parent == tmp_path
    for _ in serve(fake, sock):
        yield Served(fake, sock)


def _session(port: int, backend: str, client: str = "198.18.7.1") -> Connection:
    bid = {"198.18.0.11": 1, "198.18.0.12": 2, "198.18.0.13": 3}[backend]
    return Connection(
        protocol="tcp",
        client=client,
        client_port=port,
        vip=VIP,
        destination="198.18.100.1",
        destination_port=80,
        backend=backend,
        backend_id=bid,
        later_hops=[],
        state="established",
        idle=1.5,
        set=port,
        way=0,
    )


def test_list_is_like_ipvsadm(served: Served) -> None:
    """Failure 6: columns (not key/value rows), InActConn, the session table's counts
    where no agent reports (marked), the same layout for ``vip list``."""
    served.fake.established["198.18.0.11"] = 3
    served.fake.sessions = [_session(40000 + i, "198.18.0.12") for i in range(2)]
    code, out, _ = xdplb("list", "-n")
    assert code == EXIT_OK
    assert out.splitlines() == [
        "Prot LocalAddress:Port Scheduler Flags",
        "  -> RemoteAddress:Port          Forward Weight ActiveConn InActConn State",
        "TCP  198.18.100.1:80 maglev",
        "  -> 198.18.0.11:80              gue          2          3         - -",
        "  -> 198.18.0.12:80              gue          1         2*         - -",
        "  -> 198.18.0.13:80              gue          1         0*         - -",
        "UDP  [fd78:6470:6c62:100::1]:53 maglev",
        "  -> [fd78:6470:6c62::11]:53     ipip         1         0*         - -",
        "* entries of the session table (no agent reports for that backend)",
    ]
    code, doc, _ = xdplb("list", "--json")
    b1, b2, _b3 = json.loads(doc)[0]["backends"]
    assert (b1["active"], b1["conns_source"]) == (3, "agent")
    assert (b2["active"], b2["inactive"], b2["conns_source"]) == (2, None, "table")
    code, out, _ = xdplb("vip", "list")
    assert code == EXIT_OK
    assert out.splitlines()[3].split() == ["->", "198.18.0.11:80", "gue", "2", "3", "-", "-"]
    assert out.splitlines()[4].split() == ["->", "198.18.0.12:80", "gue", "1", "-", "-", "-"]
    code, out, _ = xdplb("vip", "list", "--json")
    assert code == EXIT_OK
    assert [v["name"] for v in json.loads(out)] == [VIP, "[fd78:6470:6c62:100::1]:53/udp"]


def test_list_stats_and_rate(served: Served) -> None:
    served.fake.counters["198.18.0.12"] = (1234567, 150_000_000, 2)
    code, out, _ = xdplb("list", "--stats")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split() == ["Prot", "LocalAddress:Port", "Conns", "InPkts", "InBytes"]
    assert lines[4].split() == ["->", "198.18.0.12:80", "2", "1235K", "150M"]
    assert all(len(line) <= 100 for line in lines)
    code, out, _ = xdplb("list", "--rate", "--interval", "0.05", "--json")
    assert code == EXIT_OK
    assert json.loads(out)[0]["backends"][1]["pps"] == 0.0  # nothing moved in between
    code, _, err = xdplb("list", "--stats", "--rate")
    assert (code, err) == (EXIT_CONFIG, "--stats and --rate: choose one\n")


def test_list_connections_filters_and_pages(served: Served) -> None:
    served.fake.sessions = [
        *(_session(40000 + i, "198.18.0.11") for i in range(1500)),  # two pages of the API
        _session(50000, "198.18.0.12", client="203.0.113.9"),
    ]
    code, out, _ = xdplb("list", "--connections")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split() == [
        "Pro",
        "FromIP:Port",
        "ToIP:Port",
        "Backend",
        "State",
        "Idle",
        "Set:Way",
    ]
    assert len(lines) == 1 + 1501
    assert lines[1].split() == [
        "TCP",
        "198.18.7.1:40000",
        "198.18.100.1:80",
        "198.18.0.11",
        "established",
        "1.5",
        "40000:0",
    ]
    code, out, _ = xdplb("list", "--connections", "--client", "203.0.113.0/24", "--json")
    assert code == EXIT_OK
    (one,) = [json.loads(line) for line in out.splitlines()]
    assert (one["client"], one["client_port"], one["backend"]) == (
        "203.0.113.9",
        50000,
        "198.18.0.12",
    )
    code, out, _ = xdplb("list", "--connections", "--backend", "198.18.0.11", "--limit", "3")
    assert [line.split()[1] for line in out.splitlines()[1:]] == [
        "198.18.7.1:40000",
        "198.18.7.1:40001",
        "198.18.7.1:40002",
    ]
    code, _, err = xdplb("list", "--connections", "--client", "nope")
    assert (code, err) == (EXIT_CONFIG, "invalid --client: 'nope' is not an address or prefix\n")
    code, _, err = xdplb("list", "--vip", VIP)
    assert (code, err) == (EXIT_CONFIG, "--vip filters --connections only\n")


def test_status_through_the_api(served: Served) -> None:
    served.fake.counters["198.18.0.12"] = (10, 1500, 2)
    code, out, _ = xdplb("status")
    assert code == EXIT_OK
    assert out.startswith("instance fake (/etc/xdplb/fake.yaml), attached to eth0, up 1m40s\n")
    assert "connection table 17 of 1024 entries" in out
    assert all(len(line) <= 100 for line in out.splitlines())
    line = next(x for x in out.splitlines() if "198.18.0.12:80" in x)
    assert line.split() == ["->", "198.18.0.12:80", "1", "1", "25.0%", "-", "-", "10", "1500", "-"]
    assert "drops: no_backend 3  bad_header 0" in out
    code, out, _ = xdplb("status", "--json")
    assert code == EXIT_OK
    assert Status.model_validate_json(out) == served.fake.status()


def test_status_shows_socket_lb_when_configured(served: Served) -> None:
    _, out, _ = xdplb("status")
    assert "socket_lb" not in out
    served.fake.socket_lb_view = SocketLbStatus(
        cgroup="/sys/fs/cgroup/clients",
        attached=False,
        services=[
            SocketLbService(
                name=name,
                address="198.18.100.1",
                port=80,
                protocol=proto,
                backends=3,
                backends_up=up,
                table_size=size,
            )
            for name, proto, up, size in (
                ("198.18.100.1:80/tcp", "tcp", 2, 65537),
                ("198.18.100.1:80/udp", "udp", 0, None),
            )
        ],
        events={"connect": 120, "no_backend": 4},
    )
    code, out, _ = xdplb("status")
    assert code == EXIT_OK
    assert out.splitlines()[-4:] == [
        "socket_lb on /sys/fs/cgroup/clients: NOT ATTACHED",
        "  TCP  198.18.100.1:80         2/3 backends up, table 65537",
        "  UDP  198.18.100.1:80         0/3 backends up, table -  NO BACKEND UP",
        "socket_lb events: connect 120  no_backend 4",
    ]
    code, out, _ = xdplb("status", "--json")
    assert Status.model_validate_json(out).socket_lb == served.fake.socket_lb_view


WHY = "probe of 198.18.100.1:80/tcp: to 198.18.0.13, the tables say to 198.18.0.11"


def test_cluster_status(served: Served) -> None:
    code, _, err = xdplb("cluster", "status")
    assert code == EXIT_CONFIG and "no bgp, cluster or sync section" in err
    served.fake.cluster_view = ClusterStatus(
        bgp=BgpStatus(
            asn=65001,
            router_id="198.18.0.2",
            announced=[],
            withdrawn_because=WHY,
            sessions=[BgpSession(peer="198.18.0.3", state="up Established")],
            self_checks=12,
            self_check_failures=2,
        )
    )
    code, out, _ = xdplb("cluster", "status")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0] == f"node 198.18.0.2 (AS 65001): withdrawn: {WHY}"
    assert lines[1] == "self-checks: 12, 2 failed"
    assert lines[3].split() == ["198.18.0.3", "up", "Established"]
    code, out, _ = xdplb("cluster", "status", "--json")
    assert ClusterStatus.model_validate_json(out) == served.fake.cluster_view


def test_cluster_status_of_the_fleet_store(served: Served) -> None:
    served.fake.cluster_view = ClusterStatus(
        store=StoreStatus(
            store="etcd://198.18.0.1:2379/xdplb",
            node="lb1",
            connected=False,
            error="connection refused",
            revision=12,
            refused_revision=13,
            refused_error="vips[0].port: not a port",
            nodes=[
                FleetNode(
                    node="lb1",
                    revision=12,
                    refused_revision=13,
                    refused_error="vips[0].port: not a port",
                    age=0.4,
                    announced=["198.18.100.1"],
                    sessions={"198.18.0.3": "up Established", "fd78::3": "start Active"},
                    tables_differ=[],
                ),
                FleetNode(
                    node="lb2",
                    revision=11,
                    refused_revision=None,
                    refused_error="",
                    age=1.2,
                    announced=[],
                    tables_differ=["198.18.100.1:80/tcp"],
                ),
            ],
        )
    )
    code, out, _ = xdplb("cluster", "status")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0] == (
        "store etcd://198.18.0.1:2379/xdplb as lb1: unreachable (connection refused), "
        "serving revision 12"
    )
    assert lines[1] == "refused revision 13: vips[0].port: not a port"
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    assert rows["lb1"] == ["12", "13", "0.4s", "1/2", "198.18.100.1", "-"]
    assert rows["lb2"] == ["11", "-", "1.2s", "-", "-", "198.18.100.1:80/tcp"]


def test_cluster_status_of_session_sync(served: Served) -> None:
    served.fake.cluster_view = ClusterStatus(
        sync=SyncStatus(
            node="lb1",
            listen="198.18.0.2:7946",
            ready=False,
            waiting_for="session sync: waiting for a full copy from lb3 (copying)",
            peers=[
                SyncPeerStatus(
                    node="lb2",
                    address="198.18.0.4:7946",
                    state="synced",
                    error="",
                    copies=1,
                    last_copy_entries=332,
                    last_copy_ms=35.0,
                    received=400,
                    imported=398,
                ),
                SyncPeerStatus(
                    node="lb3",
                    address="198.18.0.5:7946",
                    state="copying",
                    error="refused a message: mac: the MAC does not match",
                    copies=0,
                    last_copy_entries=None,
                    last_copy_ms=None,
                    received=0,
                    imported=0,
                ),
            ],
            subscribers=["lb2"],
            sent=1200,
            imported={"written": 398, "present": 2},
            refused={"mac": 1},
            skipped={"unknown_backend": 2},
            overflows=0,
        )
    )
    code, out, _ = xdplb("cluster", "status")
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0] == (
        "session sync as lb1 on 198.18.0.2:7946: not synced: session sync: waiting for a "
        "full copy from lb3 (copying)"
    )
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:4]}
    assert rows["lb2"] == ["synced", "1", "0", "332", "in", "35", "ms", "400", "398"]
    assert rows["lb3"] == ["copying", "0", "0", "-", "0", "0"]
    assert "lb3 (198.18.0.5:7946): refused a message: mac: the MAC does not match" in out
    assert "followed by: lb2" in out and "refused messages: mac 1" in out
    assert "entries not imported: unknown_backend 2" in out
    code, out, _ = xdplb("cluster", "status", "--json")
    assert ClusterStatus.model_validate_json(out) == served.fake.cluster_view


def test_changes_reach_the_controller(served: Served) -> None:
    fake = served.fake
    code, out, _ = xdplb("backend", "add", VIP, "198.18.0.14", "--weight", "3")
    assert (code, out) == (
        EXIT_OK,
        f"backend 198.18.0.14 of {VIP}, weight 3: 1 map operations, "
        "runtime only (--persist writes the file)\n",
    )
    assert [(str(b.address), b.weight) for b in fake.cfg.vips[0].backends][-1] == (
        "198.18.0.14",
        3,
    )
    assert fake.status().runtime_changes
    assert xdplb("backend", "weight", VIP, "198.18.0.14", "0", "--persist")[0] == EXIT_OK
    assert fake.cfg.vips[0].backends[-1].weight == 0
    assert fake.persisted == 1
    assert not fake.status().runtime_changes
    assert xdplb("backend", "del", "198.18.100.1:80", "198.18.0.14")[0] == EXIT_OK
    assert len(fake.cfg.vips[0].backends) == 3

    code, out, _ = xdplb("vip", "add", "198.18.100.7", "53", "udp", "--encap", "ipip")
    assert code == EXIT_OK, out
    assert "added VIP 198.18.100.7:53/udp" in out
    assert fake.cfg.vips[-1].name == "198.18.100.7:53/udp"
    assert str(fake.cfg.vips[-1].encap) == "ipip"
    assert xdplb("backend", "add", "198.18.100.7:53/udp", "198.18.0.11")[0] == EXIT_OK
    assert [str(b.address) for b in fake.cfg.vips[-1].backends] == ["198.18.0.11"]
    assert xdplb("vip", "del", "198.18.100.7", "53", "udp")[0] == EXIT_OK
    assert len(fake.cfg.vips) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("backend", "weight", "198.18.100.1", "198.18.0.11", "5"), "ADDRESS:PORT[/PROTOCOL]"),
        (("backend", "weight", "198.18.100.1:80/sctp", "198.18.0.11", "5"), "tcp or udp"),
        (("backend", "weight", "[198.18.100.1]:80", "198.18.0.11", "5"), "brackets"),
        (("backend", "weight", "fd78::1:80", "198.18.0.11", "5"), "ADDRESS:PORT"),
        (("backend", "weight", "198.18.100.1:99999", "198.18.0.11", "5"), "above 65535"),
        (("backend", "weight", VIP, "198.18.0.1111", "5"), "not an IP address"),
        (("vip", "add", "not-an-ip", "80", "tcp"), "not an IP address"),
    ],
)
def test_bad_syntax_exits_2_with_a_message(
    served: Served, args: tuple[str, ...], message: str
) -> None:
    code, _, err = xdplb(*args)
    assert code == EXIT_CONFIG
    assert message in err


def test_api_errors_exit_2_with_the_field_and_5xx_exits_1(served: Served) -> None:
    code, _, err = xdplb("backend", "weight", "198.18.100.1:81/tcp", "198.18.0.11", "5")
    assert (code, err) == (EXIT_CONFIG, "error 404: no VIP 198.18.100.1:81/tcp\n")
    code, _, err = xdplb("backend", "del", VIP, "198.18.0.99")
    assert code == EXIT_CONFIG
    assert err.startswith("error 404: no backend 198.18.0.99")
    code, _, err = xdplb("vip", "add", "198.18.100.1", "80", "tcp")
    assert code == EXIT_CONFIG
    assert err == f"error 409: VIP {VIP} exists (PUT replaces it) (field address)\n"
    code, _, err = xdplb("vip", "add", "198.18.100.9", "80", "--table-size", "4")
    assert code == EXIT_CONFIG
    # Refused by the models before any request, with the same words.
    assert err == "invalid VIP: must be a prime (Maglev needs it), got 4 (field table_size)\n"
    served.fake.explode = True  # a bug in the daemon
    code, _, err = xdplb("backend", "weight", VIP, "198.18.0.11", "5")
    assert (code, err) == (EXIT_RUNTIME, "error 500: internal error (see the daemon's log)\n")
    # Refused by the daemon's validation of the whole configuration: 422, exit 2.
    fake = served.fake
    fake.explode = False
    fake.cfg = fake.file_cfg = fake.cfg.model_copy(
        update={
            "tunnel": fake.cfg.tunnel.model_copy(update={"source_v6": None}),
            "vips": fake.cfg.vips[:1],  # the IPv6 VIP would be refused too
        }
    )
    code, _, err = xdplb("backend", "add", VIP, "fd78::99")
    assert (code, err) == (
        EXIT_CONFIG,
        "error 422: an IPv6 backend needs tunnel.source_v6 (field vips[0].backends[3].address)\n",
    )


def test_reload_refused_exits_2_naming_what_it_would_drop_and_force_applies(
    served: Served,
) -> None:
    fake = served.fake
    code, _, err = xdplb("acl", "deny", "203.0.113.0/24")
    assert code == EXIT_OK, err
    fake.refuse_reload = ["acl: deny 203.0.113.0/24 (added through the API) would be dropped"]
    code, out, err = xdplb("reload")
    assert (code, out) == (EXIT_CONFIG, "")
    assert err == (
        "error 409: reload refused, the running configuration is kept: acl: deny "
        "203.0.113.0/24 (added through the API) would be dropped (force it to apply the file "
        "anyway, or persist the changes)\n"
    )
    assert [str(p) for p in fake.cfg.acl.deny] == ["203.0.113.0/24"]
    code, out, err = xdplb("reload", "--force")
    assert (code, out, err) == (EXIT_OK, "reloaded: 1 map operations\n", "")
    assert fake.cfg.acl.deny == []


def test_drain_wait_returns_once_the_agent_reports_none_left(served: Served) -> None:
    fake = served.fake

    def agent() -> None:  # reports 0.3 s after the drain began
        wait_for(lambda: (VIP, "198.18.0.11") in fake.drains, "the drain beginning", interval=0.005)
        time.sleep(0.3)  # the scenario: the CLI must wait for a report that comes later
        fake.report(VIP, "198.18.0.11", 0)

    t = threading.Thread(target=agent)
    t.start()
    start = time.monotonic()
    code, out, err = xdplb("backend", "drain", VIP, "198.18.0.11", "--wait", "--timeout", "5")
    took = time.monotonic() - start
    t.join()
    assert code == EXIT_OK, err
    first, last = out.splitlines()
    assert first == (
        f"backend 198.18.0.11 of {VIP}: draining, "
        "established connections unknown (no agent report yet)"
    )
    m = re.fullmatch(rf"backend 198\.18\.0\.11 of {re.escape(VIP)} drained in ([0-9.]+) s", last)
    assert m is not None, last
    # It returned on the report (at its --timeout it would have exited EXIT_RUNTIME).
    assert 0.3 <= float(m[1]) <= took
    assert fake.status().vips[0].backends[0].admin == "drained"
    code, out, _ = xdplb("backend", "enable", VIP, "198.18.0.11")
    assert (code, out) == (
        EXIT_OK,
        f"backend 198.18.0.11 of {VIP}: enabled, established connections unknown "
        "(no agent report yet)\n",
    )
    assert fake.status().vips[0].backends[0].admin == "enabled"


def test_drain_wait_times_out(served: Served) -> None:
    start = time.monotonic()
    code, _, err = xdplb("backend", "drain", VIP, "198.18.0.12", "--wait", "--timeout", "0.4")
    assert code == EXIT_RUNTIME
    assert time.monotonic() - start >= 0.4  # it waited its --timeout
    assert "no agent reports for backend 198.18.0.12" in err
    # An agent reports, but connections stay open.
    served.fake.report(VIP, "198.18.0.12", 5)
    code, _, err = xdplb("backend", "drain", VIP, "198.18.0.12", "--wait", "--timeout", "0.5")
    assert code == EXIT_RUNTIME
    assert err == (
        f"backend 198.18.0.12 of {VIP}: draining, 5 established\n"
        "backend 198.18.0.12 not drained after 0.5 s\n"
    )


def test_no_daemon_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDPLB_RUN_DIR", str(tmp_path))
    code, _, err = xdplb("vip", "list", instance=f"absent-{tmp_path.name}")
    assert code == EXIT_NOT_RUNNING
    assert "is not running" in err
    # A socket file nobody listens on (a daemon that died) is no daemon either.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(api_socket("stale")))
    stale.close()
    assert xdplb("backend", "enable", VIP, "198.18.0.11", instance="stale")[0] == EXIT_NOT_RUNNING
    # status falls back to the pins, which are not there either.
    assert xdplb("status", instance=f"absent-{tmp_path.name}")[0] == EXIT_NOT_RUNNING
    with pytest.raises(NotRunning):
        Client("stale").status()


def test_token_over_tcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDPLB_TOKEN", raising=False)
    fake = FakeController()
    for server in serve(fake, token="s3cret"):
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        code, _, err = xdplb("vip", "list", "--api", url)
        assert (code, err) == (EXIT_CONFIG, "error 401: a bearer token is required\n")
        code, _, err = xdplb("vip", "list", "--api", url, "--token", "wrong")
        assert (code, err) == (EXIT_CONFIG, "error 401: wrong bearer token\n")
        code, out, _ = xdplb("vip", "list", "--api", url, "--token", "s3cret")
        assert code == EXIT_OK
        assert "TCP  198.18.100.1:80 maglev" in out
        monkeypatch.setenv("XDPLB_TOKEN", "s3cret")
        assert xdplb("backend", "weight", VIP, "198.18.0.13", "9", "--api", url)[0] == EXIT_OK
        assert fake.cfg.vips[0].backends[2].weight == 9
        with Client(api=url) as client:
            assert "xdplb_backend_weight" in client.metrics()
    # Nothing listens on that port any more.
    code, _, _ = xdplb("vip", "list", "--api", url)
    assert code == EXIT_NOT_RUNNING


def test_parse_vip() -> None:
    assert parse_vip("198.18.100.1:80").name == VIP
    assert parse_vip("198.18.100.1:0/UDP").name == "198.18.100.1:0/udp"
    assert parse_vip("[fd78:6470:6c62:100::1]:443/udp").name == "[fd78:6470:6c62:100::1]:443/udp"
    for bad in ("198.18.100.1", "fd78::1:80", "198.18.100.1:80/icmp", "[::1:80", "x:80"):
        with pytest.raises(ValueError):
            parse_vip(bad)
