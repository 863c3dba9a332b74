"""sock_lb's planner, without a kernel: ids, tables and what went down."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from xdplb.datapath.sock_lb import Endpoint, SockLbError
from xdplb.sockets.socklb_plan import Backend, Service, check_services, plan
from xdplb.tables import maglev

pytestmark = pytest.mark.unit

SIZE = 1009  # a small prime keeps the tables quick to build


def ep(text: str, port: int) -> Endpoint:
    return Endpoint(ipaddress.ip_address(text), port)


B1, B2, B3 = ep("127.0.0.2", 8001), ep("127.0.0.3", 8002), ep("127.0.0.4", 8003)


def svc(*backends: Backend, port: int = 80, proto: int = socket.IPPROTO_TCP) -> Service:
    return Service(ipaddress.ip_address("10.96.0.10"), port, proto, backends, table_size=SIZE)


def test_tables_are_the_xdp_tiers_maglev_tables_of_the_backends_up() -> None:
    s = svc(Backend(B1, 1), Backend(B2, 1), Backend(B3, 2, up=False))
    p = plan([s], {}, {})
    sid, value, table = p.services[s.key]
    assert (sid, value.id, value.table_size) == (0, 0, SIZE)
    ids = {str(e): i for i, e in p.endpoints.items()}
    expected = maglev.build({str(B1): 1, str(B2): 1}, SIZE).map_ids(ids)
    assert table is not None and table.tolist() == expected.tolist()
    # The down backend still has its slot, marked down: affinity must not pick it.
    assert {p.endpoints[i]: bool(v.up) for i, v in p.backends.items()} == {
        B1: True,
        B2: True,
        B3: False,
    }
    assert 0 not in p.backends  # id 0 names nothing


def test_ids_stay_and_what_went_down_is_reported() -> None:
    first = plan([svc(Backend(B1), Backend(B2), Backend(B3))], {}, {})
    ids = {e: i for i, e in first.endpoints.items()}
    current_svcs = {k: v[0] for k, v in first.services.items()}
    current_bes = {e: (i, True) for e, i in ids.items()}

    second = plan([svc(Backend(B1), Backend(B2, up=False))], current_svcs, current_bes)
    assert {e: i for i, e in second.endpoints.items()} == {B1: ids[B1], B2: ids[B2]}
    assert second.removed_backends == {ids[B3]}
    assert second.went_down == {ids[B2], ids[B3]}
    assert second.removed_services == {}

    # Already down: not reported again (no second round of destroys).
    current_bes[B2] = (ids[B2], False)
    del current_bes[B3]
    third = plan([svc(Backend(B1), Backend(B2, up=False))], current_svcs, current_bes)
    assert third.went_down == frozenset()


def test_new_backends_take_the_lowest_free_id_and_removed_services_are_listed() -> None:
    current_bes = {B1: (1, True), B3: (3, True)}
    old = svc(Backend(B1), port=81)
    p = plan([svc(Backend(B1), Backend(B2))], {old.key: 5}, current_bes)
    assert {e: i for i, e in p.endpoints.items()} == {B1: 1, B2: 2}
    assert p.removed_services == {old.key: 5}
    assert p.services[svc().key][0] == 0


def test_ids_of_what_goes_away_are_not_reused_in_the_same_plan() -> None:
    # apply clears removed services' tables and removed backends' slots last: a newcomer
    # holding one of their ids would lose its own.
    old_svc = svc(Backend(B1), port=81)
    p = plan([svc(Backend(B2))], {old_svc.key: 0}, {B1: (1, True)})
    assert p.services[svc().key][0] == 1
    assert {e: i for i, e in p.endpoints.items()} == {B2: 2}
    assert p.removed_services == {old_svc.key: 0}
    assert p.removed_backends == {1}


def test_a_service_without_a_backend_up_has_no_table() -> None:
    p = plan([svc(Backend(B1, up=False), Backend(B2, weight=0))], {}, {})
    assert p.services[svc().key][2] is None


@pytest.mark.parametrize(
    ("services", "message"),
    [
        ([svc(Backend(B1)), svc(Backend(B2))], "twice"),
        ([svc(Backend(ep("::1", 80)))], "another address family"),
        (
            [svc(Backend(B1)), svc(Backend(B1, up=False), proto=socket.IPPROTO_UDP)],
            "up in one service, down in another",
        ),
        ([svc(Backend(B1), proto=socket.IPPROTO_SCTP)], "proto"),
    ],
)
def test_contradictions_are_refused(services: list[Service], message: str) -> None:
    with pytest.raises(SockLbError, match=message):
        check_services(services)


def test_endpoints_sort_across_families() -> None:
    eps = [ep("::1", 1), ep("127.0.0.1", 2), ep("127.0.0.1", 1)]
    assert sorted(eps, key=Endpoint.order) == [eps[2], eps[1], eps[0]]
    assert str(eps[0]) == "[::1]:1"
