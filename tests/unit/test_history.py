"""The daemon's short history of rates (xdplb.daemon.history): rates from counter
samples, no rate across a counter that went back, a fresh start when the clock goes
back (another daemon), a bounded length, and ``since`` for what is newer."""

from __future__ import annotations

import pytest
from fake_controller import FakeController
from fastapi.testclient import TestClient

from xdplb.control.status import Traffic
from xdplb.daemon.api import create_app
from xdplb.daemon.history import History

pytestmark = pytest.mark.unit

VIP = "198.18.100.1:80/tcp"
B1, B2, B3 = "198.18.0.11", "198.18.0.12", "198.18.0.13"


def status(counters: dict[str, tuple[int, int, int]]) -> Traffic:
    """The traffic in the fake daemon's status with these per-backend counters (address
    -> packets, bytes, new flows; the VIP's are their sums, the others' 0)."""
    return Traffic.of(FakeController(counters=counters).status())


def at(packets: dict[str, int]) -> Traffic:
    """Counters in which bytes are 100 x packets and new flows packets // 10."""
    return status({k: (p, 100 * p, p // 10) for k, p in packets.items()})


def test_rates_from_counter_samples() -> None:
    h = History()
    h.add(10.0, at({B1: 0, B2: 0}))
    assert len(h) == 0 and h.view().times == []
    h.add(11.0, at({B1: 100, B2: 50}))
    h.add(13.0, at({B1: 300, B2: 50}))  # two seconds: the rate divides by the real gap
    v = h.view()
    assert v.times == [11.0, 13.0] and (v.interval, v.length) == (1.0, 60)
    assert v.backends[B1].packets == [100.0, 100.0]
    assert v.backends[B1].bytes == [10000.0, 10000.0]
    assert v.backends[B1].new_flows == [10.0, 10.0]
    assert v.backends[B2].packets == [50.0, 0.0]
    assert v.vips[VIP].packets == [150.0, 100.0]  # the fake's VIP sums its backends
    assert list(v.backends) == [B1, B2, B3, "fd78:6470:6c62::11"]  # in the status's order
    assert v.backends[B3].packets == [0.0, 0.0]


def test_a_counter_that_goes_back_has_no_rate_for_that_interval() -> None:
    h = History()
    h.add(1.0, at({B1: 1000, B2: 10}))
    h.add(2.0, at({B1: 1100, B2: 20}))
    h.add(3.0, at({B1: 40, B2: 30}))  # B1 re-added under a new id, or wrapped
    h.add(4.0, at({B1: 90, B2: 40}))
    v = h.view()
    assert v.backends[B1].packets == [100.0, None, 50.0]
    assert v.backends[B1].bytes == [10000.0, None, 5000.0]
    assert v.backends[B2].packets == [10.0, 10.0, 10.0]  # the others keep their rates
    assert v.vips[VIP].packets == [110.0, None, 60.0]


def test_a_clock_that_goes_back_starts_afresh() -> None:
    """Samples of a restarted daemon (its clock from zero again) are not compared with
    the old one's, whose counters may be far higher or lower."""
    h = History()
    for t in range(5):
        h.add(100.0 + t, at({B1: 1000 * t}))
    assert len(h) == 4
    h.add(0.5, at({B1: 7}))
    assert len(h) == 0 and h.view().backends == {}
    h.add(1.5, at({B1: 17}))
    assert h.view().times == [1.5] and h.view().backends[B1].packets == [10.0]


def test_a_backend_missing_from_a_sample_has_no_rate_there() -> None:
    h = History()
    h.add(1.0, status({B1: (10, 1000, 1)}))
    empty = FakeController(cfg=FakeController().cfg.model_copy(update={"vips": []}))
    h.add(2.0, Traffic.of(empty.status()))
    h.add(3.0, status({B1: (30, 3000, 3)}))
    h.add(4.0, status({B1: (40, 4000, 4)}))
    assert h.view().backends[B1].packets == [None, None, 10.0]


def test_the_length_is_bounded() -> None:
    h = History(interval=1.0, length=5)
    for t in range(100):
        h.add(float(t), at({B1: 10 * t}))
    v = h.view()
    assert len(h) == 5 and v.times == [95.0, 96.0, 97.0, 98.0, 99.0]
    assert v.backends[B1].packets == [10.0] * 5 and v.length == 5


def test_since_gives_only_newer_intervals_and_due_paces_the_samples() -> None:
    h = History(interval=1.0)
    assert h.due(0.0)
    h.add(0.0, at({B1: 0}))
    assert not h.due(0.6) and h.due(1.0)
    for t in (1.0, 2.0, 3.0):
        h.add(t, at({B1: int(5 * t)}))
    assert h.view(since=2.0).times == [3.0]
    assert h.view(since=2.0).backends[B1].packets == [5.0]
    assert h.view(since=3.0).times == [] and h.view(since=3.0).backends == {}
    assert h.view(since=-1.0) == h.view()


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        History(interval=0)
    with pytest.raises(ValueError, match="must be positive"):
        History(length=0)


def test_the_api_serves_the_history_behind_the_token() -> None:
    h = History()
    for t in range(4):
        h.add(float(t), at({B1: 10 * t}))
    app = create_app(FakeController(), token="s3cret-token-0123", history=h)
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.get("/api/v1/history").status_code == 401
        auth = {"Authorization": "Bearer s3cret-token-0123"}
        got = c.get("/api/v1/history", headers=auth).json()
        assert got == h.view().model_dump(mode="json")
        assert got["times"] == [1.0, 2.0, 3.0] and got["backends"][B1]["packets"] == [10.0] * 3
        newer = c.get("/api/v1/history", params={"since": 2.0}, headers=auth).json()
        assert newer["times"] == [3.0]
        for bad in ("soon", "nan", "inf"):
            r = c.get("/api/v1/history", params={"since": bad}, headers=auth)
            assert r.status_code == 400 and r.json()["field"] == "since", (bad, r.text)
    # The daemon without samples yet (and the spec's app): an empty history.
    with TestClient(create_app(FakeController(), token="s3cret-token-0123")) as c:
        assert c.get("/api/v1/history", headers=auth).json()["times"] == []
