"""Beamer tables in the fleet's store (xdplb.control.beamer_share): by address, so a node
that numbered its backends otherwise takes the same hop lists, with their history."""

from __future__ import annotations

import ipaddress

import numpy as np
import pytest

from xdplb.control import beamer_share
from xdplb.tables import beamer

pytestmark = pytest.mark.unit

A = ipaddress.ip_address


def history() -> beamer.BeamerTable:
    policy = beamer.Policy(min_interval=0, max_step=1.0)
    table = beamer.build({1: 1, 2: 1, 3: 1}, 1009)
    for weights in ({1: 2, 2: 1, 3: 1}, {2: 1, 3: 1, 4: 1}, {2: 3, 3: 1, 4: 1}):
        table = beamer.adjust(table, weights, policy)
    return table


def test_a_table_goes_over_by_address_with_its_history() -> None:
    table = history()
    here = {1: A("10.0.0.1"), 2: A("10.0.0.2"), 3: A("10.0.0.3"), 4: A("10.0.0.4")}
    raw = beamer_share.encode(table, here, 1234.5)
    # The other node gave the same backends other ids.
    there = {A("10.0.0.1"): 11, A("10.0.0.2"): 7, A("10.0.0.3"): 3, A("10.0.0.4"): 20}
    got = beamer_share.decode(raw, there)
    assert got is not None
    back, at = got
    assert at == 1234.5 and back.generation == table.generation
    to_there = np.array([0, 11, 7, 3, 20], dtype=np.uint32)
    assert np.array_equal(back.first, to_there[table.first])
    assert np.array_equal(back.hops, to_there[table.hops])
    assert np.array_equal(back.changed, table.changed)
    assert len(raw) < table.size * 4  # compressed: runs of buckets


def test_a_previous_hop_unknown_here_is_left_out_and_an_unknown_first_hop_refuses() -> None:
    table = history()
    here = {1: A("10.0.0.1"), 2: A("10.0.0.2"), 3: A("10.0.0.3"), 4: A("10.0.0.4")}
    raw = beamer_share.encode(table, here, 0.0)
    # 1 left the configuration before this node started: it has no slot for it.
    there = {A("10.0.0.2"): 2, A("10.0.0.3"): 3, A("10.0.0.4"): 4}
    got = beamer_share.decode(raw, there)
    assert got is not None
    back = got[0]
    assert not (back.hops == 1).any() and np.array_equal(back.first, table.first)
    had_one = (table.hops == 1).any(axis=1)
    assert had_one.any() and not (back.hops[had_one] == table.hops[had_one]).all()
    # A first hop without an id here: not adoptable.
    assert beamer_share.decode(raw, {A("10.0.0.2"): 2, A("10.0.0.3"): 3}) is None


@pytest.mark.parametrize("raw", [b"", b"{}", b'{"v": 2}', b"not json", b'{"v": 1, "size": 3}'])
def test_what_is_not_a_table_is_none(raw: bytes) -> None:
    assert beamer_share.decode(raw, {}) is None
