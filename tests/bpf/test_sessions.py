"""The session table read a chunk at a time (``xdplb list -c``): filled by lb_xdp itself,
every entry comes out of the chunked walk exactly once, each read holds at most its
chunk, and the listing's pages, filters and counts agree with what lb_xdp recorded."""

from __future__ import annotations

import ipaddress
from collections import Counter
from typing import Any

import lb_fixtures as fx
import pytest
from lb_harness import Lb

from xdplb.control import sessions
from xdplb.control.sessions import ConnectionQuery
from xdplb.core import abi
from xdplb.core.errors import ConfigError
from xdplb.datapath.conns import WAYS, ConnTable

pytestmark = pytest.mark.bpf

#: (fixture VIP, client address) of the flows sent: two VIPs of each family and protocol.
FLOWS = [
    ("tcp4", fx.CLIENT4),
    ("udp4", fx.CLIENT4),
    ("tcp4", ipaddress.ip_address("198.18.6.9")),
    ("tcp6", fx.CLIENT6),
    ("udp6", fx.CLIENT6),
]
PER_FLOW = 60


def _fill(lb: Lb) -> dict[tuple[str, str, int], tuple[str, int]]:
    """Send PER_FLOW flows of each FLOWS kind through lb_xdp; (vip name, client, client
    port) -> (protocol, backend id), as the table recorded them."""
    out = {}
    for i, (name, client) in enumerate(FLOWS):
        v = fx.VIPS[name]
        for sport in range(20000 + 1000 * i, 20000 + 1000 * i + PER_FLOW):
            frame = bytes(
                fx.client_frame(
                    v.addr, v.port, v.proto, src=client, sport=sport, lb_mac=lb.env.lb_mac
                )
            )
            assert lb.run(frame).retval == fx.XDP_TX
            entry = lb.conn(frame)
            assert entry is not None
            proto = "tcp" if v.proto == abi.IPPROTO_TCP else "udp"
            addr = f"[{v.addr}]" if v.addr.version == 6 else str(v.addr)
            out[f"{addr}:{v.port}/{proto}", str(client), sport] = (proto, entry.backend_id)
    return out


def test_chunked_walk_yields_every_entry_and_holds_one_chunk(
    lb: Lb, monkeypatch: pytest.MonkeyPatch
) -> None:
    filled = _fill(lb)
    table = lb.conns
    whole = table.entries()
    assert len(whole) == len(filled) == len(FLOWS) * PER_FLOW
    asked: list[tuple[int, int]] = []
    real = ConnTable.read

    def spy(self: ConnTable, start: int = 0, count: int | None = None) -> Any:
        assert count is not None, "the chunked walk read the whole table"
        asked.append((start, count))
        recs, pos = real(self, start, count)
        assert len(recs) <= count * WAYS
        return recs, pos

    monkeypatch.setattr(ConnTable, "read", spy)
    walked = list(table.iter_entries(chunk=256))
    assert asked and max(c for _, c in asked) == 256
    # One copy of each chunk, in order, the whole table covered once.
    assert asked == [(s, 256) for s in range(0, table.sets_count, 256)]
    assert Counter(e.key for e in walked) == Counter(whole.keys())  # each exactly once
    assert {e.key: e for e in walked} == whole


def test_listing_pages_and_filters_match_the_table(lb: Lb) -> None:
    filled = _fill(lb)
    table = lb.conns
    snap = lb.maps.snapshot()
    backends = {i: str(b.addr) for i, b in fx.BACKENDS.items()}

    def walk(query: ConnectionQuery, limit: int, max_sets: int) -> list[sessions.Connection]:
        out, cursor = [], 0
        while True:
            p = sessions.page(table, snap, query, cursor=cursor, limit=limit, max_sets=max_sets)
            assert len(p.connections) <= limit and p.scanned_sets <= max_sets
            out += p.connections
            if p.next is None:
                return out
            assert p.next > cursor
            cursor = p.next

    # Small pages that end mid-set and scans that end on set boundaries: no entry lost
    # or repeated.
    every = walk(ConnectionQuery(), limit=7, max_sets=5000)
    got = {(c.vip, c.client, c.client_port): (c.protocol, c.backend_id) for c in every}
    assert len(every) == len(got) == len(filled)
    assert got == filled
    for c in every:
        assert c.backend == backends[c.backend_id]
        assert 0 <= c.way < WAYS and c.later_hops == []
        # Just sent: a SYN's session, or a UDP one, a few ticks idle at most.
        assert c.state == ("syn" if c.protocol == "tcp" else "udp")
        assert 0 <= c.idle < 10
        assert c.destination_port == int(c.vip.rsplit(":", 1)[1].split("/")[0])

    tcp4 = fx.VIPS["tcp4"]
    only = walk(ConnectionQuery(vip=(tcp4.addr, 80, "tcp")), limit=1000, max_sets=1 << 20)
    assert {(c.client, c.client_port) for c in only} == {
        (cl, p) for (v, cl, p) in filled if v == "198.19.1.1:80/tcp"
    }
    prefix = ipaddress.ip_network("198.18.6.0/24")
    narrow = walk(ConnectionQuery(client=prefix), limit=1000, max_sets=1 << 20)
    assert len(narrow) == PER_FLOW and {c.client for c in narrow} == {"198.18.6.9"}
    be = fx.BACKENDS[2].addr
    on_be = walk(ConnectionQuery(backend=be), limit=1000, max_sets=1 << 20)
    assert on_be and {c.backend for c in on_be} == {str(be)}
    assert len(on_be) == sum(1 for _, bid in filled.values() if bid == 2)

    want = Counter((v, backends[bid]) for (v, _, _), (_, bid) in filled.items())
    assert {(c.vip, c.backend): c.entries for c in sessions.counts(table, snap)} == want


def test_a_page_refuses_a_cursor_or_limit_out_of_range(lb: Lb) -> None:
    table = lb.conns
    snap = lb.maps.snapshot()
    end = table.sets_count * WAYS
    with pytest.raises(ConfigError) as e:
        sessions.page(table, snap, ConnectionQuery(), cursor=end + 1)
    assert str(e.value) == f"cursor: must be within 0..{end}, got {end + 1}"
    with pytest.raises(ConfigError) as e:
        sessions.page(table, snap, ConnectionQuery(), limit=0)
    assert str(e.value) == "limit: must be within 1..10000, got 0"
