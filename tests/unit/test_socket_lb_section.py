"""The configuration's ``socket_lb`` section: what it accepts, the field it names when it
refuses, the services the daemon hands sock_lb from the XDP tier's tables, and the
status it reads back from sock_lb's maps (a stub of SockLb whose maps are its last plan)."""

from __future__ import annotations

import collections
import ipaddress
import socket
from pathlib import Path
from typing import Any

import pytest

from xdplb.config import Config, parse_config
from xdplb.control.overlay import Effective
from xdplb.control.status import SocketLbService, SocketLbStatus
from xdplb.core import abi
from xdplb.core.errors import ConfigError
from xdplb.core.limits import SOCKLB_MAX_BACKENDS, SOCKLB_MAX_SERVICES
from xdplb.daemon import socket_lb
from xdplb.daemon.socket_lb import SocketBalancer, services
from xdplb.datapath.sock_lb import (
    ApplyResult,
    Endpoint,
    Plan,
    ServiceKey,
    ServiceState,
    SockLbError,
    SockLbEvent,
)
from xdplb.sockets.socklb_plan import Backend

pytestmark = pytest.mark.unit

B1, B2 = "127.0.0.2", "127.0.0.3"


def doc(socket_lb: Any, **vip: Any) -> dict[str, Any]:
    backends = [{"address": B1, "weight": 1}, {"address": B2, "weight": 2}]
    return {
        "tunnel": {"source_v4": "127.0.0.1", "source_v6": "fd00::1"},
        "table_size": 1009,
        "vips": [
            {"address": "10.96.0.10", "port": 80, "backends": backends, **vip},
            {"address": "10.96.0.10", "port": 80, "protocol": "udp", "backends": backends},
            {"address": "10.96.0.11", "backends": backends},  # port 0: every port
        ],
        "socket_lb": socket_lb,
    }


def test_absent_by_default_and_every_vip_with_a_port_when_none_are_named() -> None:
    assert parse_config({}).socket_lb is None
    cfg = parse_config(doc({"cgroup": "/sys/fs/cgroup/unified/clients"}))
    assert cfg.socket_lb is not None
    assert cfg.socket_lb.cgroup == Path("/sys/fs/cgroup/unified/clients")
    assert cfg.socket_lb.affinity_seconds == 0
    assert [v.name for v in cfg.socket_lb.selected(cfg.vips)] == [
        "10.96.0.10:80/tcp",
        "10.96.0.10:80/udp",
    ]
    named = parse_config(doc({"cgroup": "/cg", "vips": ["10.96.0.10:80/udp"]}))
    assert named.socket_lb is not None
    assert [v.name for v in named.socket_lb.selected(named.vips)] == ["10.96.0.10:80/udp"]


@pytest.mark.parametrize(
    ("socket_lb", "vip", "field", "message"),
    [
        ({"cgroup": "clients"}, {}, "socket_lb.cgroup", "must be an absolute path"),
        ({}, {}, "socket_lb.cgroup", "Field required"),
        ({"cgroup": "/cg", "vips": ["10.96.0.10:81/tcp"]}, {}, "socket_lb.vips[0]", "no VIP"),
        ({"cgroup": "/cg", "vips": ["10.96.0.11:0/tcp"]}, {}, "socket_lb.vips[0]", "no port"),
        ({"cgroup": "/cg", "affinity_seconds": -1}, {}, "socket_lb.affinity_seconds", "greater"),
        ({"cgroup": "/cg", "affinity_seconds": "5"}, {}, "socket_lb.affinity_seconds", "number"),
        ({"cgroup": "/cg", "cgroups": "/x"}, {}, "socket_lb.cgroups", "unknown field"),
        (
            {"cgroup": "/cg"},
            {"backends": [{"address": "fd00::2"}]},
            "vips[0].backends[0].address",
            "must be IPv4 too",
        ),
    ],
)
def test_a_bad_value_names_its_field(
    socket_lb: dict[str, Any], vip: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(doc(socket_lb, **vip))
    assert e.value.field == field
    assert message in str(e.value)


def test_more_services_or_endpoints_than_sock_lb_holds_are_refused() -> None:
    def many(n: int, backends_per_vip: int, **socket_lb: Any) -> dict[str, Any]:
        return {
            "tunnel": {"source_v4": "127.0.0.1"},
            "limits": {"vips": 1024, "backends": 8192},
            "vips": [
                {
                    "address": f"10.96.{i // 250}.{i % 250 + 1}",
                    "port": 80,
                    "backends": [
                        {"address": f"10.{100 + i // 250}.{i % 250}.{j + 1}"}
                        for j in range(backends_per_vip)
                    ],
                }
                for i in range(n)
            ],
            "socket_lb": {"cgroup": "/cg", **socket_lb},
        }

    assert parse_config(many(SOCKLB_MAX_SERVICES, 1)).socket_lb is not None
    with pytest.raises(ConfigError) as e:
        parse_config(many(SOCKLB_MAX_SERVICES + 1, 1))
    assert e.value.field == "socket_lb" and "at most 256" in str(e.value)
    # Naming the VIPs to balance brings it back under.
    named = many(SOCKLB_MAX_SERVICES + 1, 1, vips=["10.96.0.1:80/tcp"])
    assert parse_config(named).socket_lb is not None
    # 17 VIPs of 250 backends each: 4,250 endpoints, past 4,096.
    with pytest.raises(ConfigError) as e:
        parse_config(many(17, 250))
    assert e.value.field == "socket_lb" and "4250 backend endpoints" in str(e.value)
    assert SOCKLB_MAX_BACKENDS == 4096


def test_a_vip_not_balanced_at_the_socket_may_mix_families() -> None:
    d = doc({"cgroup": "/cg", "vips": ["10.96.0.10:80/udp"]}, backends=[{"address": "fd00::2"}])
    assert parse_config(d).socket_lb is not None


def effective(cfg: Config, down: dict[str, set[str]]) -> Effective:
    """As the overlay makes it: backends down have weight 0 and a DOWN member state."""
    vips = []
    members: dict[str, dict[Any, abi.MemberState]] = {}
    for vip in cfg.vips:
        out = {ipaddress.ip_address(a) for a in down.get(vip.name, set())}
        vips.append(
            vip.model_copy(
                update={
                    "backends": [
                        b.model_copy(update={"weight": 0}) if b.address in out else b
                        for b in vip.backends
                    ]
                }
            )
        )
        if out:
            members[vip.name] = dict.fromkeys(out, abi.MemberState.DOWN)
    return Effective(cfg.model_copy(update={"vips": vips}), members=members)


def ep(addr: str, port: int) -> Endpoint:
    return Endpoint(ipaddress.ip_address(addr), port)


def test_services_are_the_vips_at_their_port_with_the_tables_weights() -> None:
    cfg = parse_config(doc({"cgroup": "/cg", "affinity_seconds": 30}, table="beamer"))
    got = services(effective(cfg, {}))
    assert [(s.port, s.proto) for s in got] == [(80, socket.IPPROTO_TCP), (80, socket.IPPROTO_UDP)]
    for s in got:
        assert s.address == ipaddress.ip_address("10.96.0.10")
        assert s.backends == (Backend(ep(B1, 80), 1), Backend(ep(B2, 80), 2))
        assert s.affinity_s == 30
        assert s.table_size == 1009  # a Beamer VIP's too: sock_lb's tables are Maglev
    assert services(effective(parse_config({}), {})) == []


def test_an_endpoint_is_down_only_when_every_vip_naming_it_sees_it_down() -> None:
    cfg = parse_config(doc({"cgroup": "/cg"}))
    tcp, udp = services(effective(cfg, {"10.96.0.10:80/tcp": {B2}}))
    # The TCP VIP alone sees B2 down: out of its table, but the endpoint stays up for UDP.
    assert tcp.backends[1] == Backend(ep(B2, 80), 0, up=True)
    assert udp.backends[1] == Backend(ep(B2, 80), 2, up=True)
    tcp, udp = services(effective(cfg, {"10.96.0.10:80/tcp": {B2}, "10.96.0.10:80/udp": {B2}}))
    assert tcp.backends[1] == udp.backends[1] == Backend(ep(B2, 80), 0, up=False)


class StubSockLb:
    """SockLb without a kernel: its maps hold the last plan applied (ids planned afresh
    each time), its counters what the test sets."""

    def __init__(self, instance: str) -> None:
        self.plan: Plan | None = None
        self.linked = False
        self.fail = False
        self.counts = dict.fromkeys(SockLbEvent, 0)

    def attach(self, cgroup: Path) -> None:
        self.linked = True

    def attached(self, cgroup: Path | None = None) -> bool:
        return self.linked

    def current(self) -> tuple[dict[ServiceKey, int], dict[Endpoint, tuple[int, bool]]]:
        return {}, {}

    def apply(self, p: Plan) -> ApplyResult:
        if self.fail:
            raise SockLbError("the kernel said no")
        self.plan = p
        return ApplyResult(plan=p, destroyed=())

    def services(self) -> list[ServiceState]:
        p = self.plan
        if p is None:
            return []
        return [
            ServiceState(
                *key,
                id=sid,
                table_size=value.table_size,
                affinity_ns=value.affinity_ns,
                buckets={
                    p.endpoints[bid]: n
                    for bid, n in collections.Counter(
                        (table if table is not None else []).tolist()
                    ).items()
                },
            )
            for key, (sid, value, table) in p.services.items()
        ]

    def events(self) -> dict[SockLbEvent, int]:
        return dict(self.counts)

    def close(self) -> None:
        pass


def svc(proto: str, up: int, table_size: int | None = 1009) -> SocketLbService:
    return SocketLbService(
        name=f"10.96.0.10:80/{proto}",
        address="10.96.0.10",
        port=80,
        protocol=proto,
        backends=2,
        backends_up=up,
        table_size=table_size,
    )


def test_the_status_says_what_sock_lbs_maps_hold_for_the_vips_it_balances(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(socket_lb, "SockLb", StubSockLb)
    (tmp_path / "cgroup.procs").touch()
    sb = SocketBalancer("t", tmp_path)
    lb = sb.lb
    assert isinstance(lb, StubSockLb)
    none = dict.fromkeys((e.name.lower() for e in SockLbEvent), 0)
    assert sb.status() == SocketLbStatus(
        cgroup=str(tmp_path), attached=False, services=[], events=none
    )

    cfg = parse_config(doc({"cgroup": str(tmp_path), "vips": ["10.96.0.10:80/udp"]}))
    sb.on_planned(effective(cfg, {}))
    sb.attach()
    lb.counts[SockLbEvent.CONNECT] = 7
    lb.counts[SockLbEvent.NO_BACKEND] = 2
    st = sb.status()
    assert st == SocketLbStatus(
        cgroup=str(tmp_path),
        attached=True,
        services=[svc("udp", 2)],
        events={**none, "connect": 7, "no_backend": 2},
    )

    # Backends up are those its table holds: B2 down leaves it.
    sb.on_planned(effective(cfg, {"10.96.0.10:80/udp": {B2}}))
    assert sb.status().services == [svc("udp", 1)]

    # A VIP the maps do not hold (applying failed): listed, no table, nothing up.
    every = parse_config(doc({"cgroup": str(tmp_path)}))
    lb.fail = True
    sb.on_planned(effective(every, {}))
    assert sb.status().services == [svc("tcp", 0, None), svc("udp", 1)]
    lb.fail = False
    sb.on_planned(effective(every, {}))
    assert sb.status().services == [svc("tcp", 2), svc("udp", 2)]
