"""lb_xdp on fixture packets (BPF_PROG_TEST_RUN), against docs/datapath.md.

Each fixture case (tests/bpf/lb_fixtures.py) gives an input frame, the verdict, the exact
output frame and the exact counter deltas; the tests after the table cover behaviour that
needs more than one packet (connection table, source hashing, stats).
"""

from __future__ import annotations

import dataclasses
import struct

import lb_fixtures as fx
import pytest
from lb_harness import Counters, Lb
from scapy.layers.inet import TCP
from scapy.layers.l2 import Ether
from scapy.utils import hexdump

from xdplb.core import abi
from xdplb.core.abi import DropReason, Event

pytestmark = pytest.mark.bpf


# --- assertions with readable diffs -------------------------------------------------------


def _clip(line: str, width: int = 72) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def _side_by_side(left: str, right: str, titles: tuple[str, str]) -> str:
    a = [_clip(x) for x in left.splitlines()]
    b = [_clip(x) for x in right.splitlines()]
    width = max([len(x) for x in a] + [len(titles[0])]) + 2
    rows = [f"{titles[0]:<{width}}| {titles[1]}", "-" * (width * 2)]
    for i in range(max(len(a), len(b))):
        la = a[i] if i < len(a) else ""
        lb_ = b[i] if i < len(b) else ""
        mark = " " if la == lb_ else "*"
        rows.append(f"{la:<{width}}|{mark}{lb_}")
    return "\n".join(rows)


def assert_frames_equal(got: bytes, want: bytes) -> None:
    if got == want:
        return
    first = next(
        (i for i, (x, y) in enumerate(zip(got, want, strict=False)) if x != y),
        min(len(got), len(want)),
    )
    msg = [
        f"output frame differs: {len(got)} bytes, want {len(want)}; first difference at "
        f"byte {first}",
        _side_by_side(Ether(got).show2(dump=True), Ether(want).show2(dump=True), ("got", "want")),
        _side_by_side(hexdump(got, dump=True), hexdump(want, dump=True), ("got", "want")),
    ]
    pytest.fail("\n".join(msg), pytrace=False)


def assert_verdict(got: int, want: int) -> None:
    assert got == want, f"verdict {fx.VERDICTS.get(got, got)}, want {fx.VERDICTS[want]}"


def assert_deltas(delta: Counters, want: fx.Expect) -> None:
    expected = Counters(
        {int(k): v for k, v in want.events.items()},
        {int(k): v for k, v in want.drops.items()},
        dict(want.vip_stats),
        dict(want.be_stats),
    )
    assert delta.named() == expected.named(), "counters moved otherwise than expected"


def run_case(lb: Lb, frame: bytes, want: fx.Expect) -> None:
    before = lb.counters()
    res = lb.run(frame)
    assert_verdict(res.retval, want.verdict)
    assert_frames_equal(res.data, want.output)
    assert_deltas(lb.counters() - before, want)


# --- the fixture table -----------------------------------------------------------------------


@pytest.mark.parametrize("case", fx.CASES, ids=[c.description for c in fx.CASES])
def test_fixture(lb: Lb, case: fx.Case) -> None:
    frame = case.frame(lb.env)
    run_case(lb, frame, case.expect(lb.env, frame))


# --- more than one packet ------------------------------------------------------------------


def _frame(
    lb: Lb, vip: str, sport: int = 40000, src: fx.IPAddress | None = None, flags: str = "S"
) -> bytes:
    v = fx.VIPS[vip]
    return bytes(
        fx.client_frame(
            v.addr, v.port, v.proto, src=src, sport=sport, lb_mac=lb.env.lb_mac, flags=flags
        )
    )


def _known_flow(lb: Lb, frame: bytes, vip: fx.VipDef, be_id: int, h: int) -> fx.Expect:
    """Expected result of a packet that the connection table sends to ``be_id``."""
    be = fx.BACKENDS[be_id]
    assert be.mac is not None
    ip_len = fx.flow_of(frame)[5]
    return fx.Expect(
        fx.XDP_TX,
        fx.encapsulated(frame, vip, be, h, eth_dst=be.mac, eth_src=lb.env.lb_mac),
        events={Event.CONN_HIT: 1, Event.TX: 1},
        vip_stats={vip.id: (1, ip_len, 0)},
        be_stats={be_id: (1, ip_len, 0)},
    )


def test_new_flow_is_recorded_with_its_hash(lb: Lb) -> None:
    frame = _frame(lb, "tcp4")
    be_id, h = fx.pick(frame, fx.VIPS["tcp4"])
    assert lb.conn(frame) is None
    assert lb.run(frame).retval == fx.XDP_TX
    conn = lb.conn(frame)
    assert conn is not None
    assert (conn.backend_id, conn.hash) == (be_id, h)


def test_beamer_records_a_mid_connection_flow_with_its_hops(lb: Lb) -> None:
    """A mid-flow TCP packet of a Beamer VIP may be any hop's: it is recorded with the
    bucket's usable later hops (state TCP_EST), and its next packet, a hit, carries the
    same GUE hop list. A SYN starts at the first hop: recorded with that hop alone, so
    its connection's next packet goes to the first hop with a one-hop list."""
    vip = fx.VIPS["beamer"]
    ack_pkt = fx.client_frame(vip.addr, vip.port, sport=42001, lb_mac=lb.env.lb_mac)
    ack_pkt[TCP].flags = "A"  # from a connection made before this LB knew the flow
    ack = bytes(ack_pkt)
    hops = fx.beamer_hops(ack, vip)
    assert len(hops) == 2
    run_case(lb, ack, fx._beamer(lb.env, ack))
    conn = lb.conn(ack)
    assert conn is not None
    assert conn.hops == tuple(b.id for b in hops)
    assert conn.state is abi.SessState.TCP_EST
    assert conn.hash == fx.hash_of(ack, vip)
    first = fx._beamer(lb.env, ack)
    ip_len = fx.flow_of(ack)[5]
    hit = dataclasses.replace(
        first,
        events={Event.CONN_HIT: 1, Event.TX: 1},
        vip_stats={vip.id: (1, ip_len, 0)},
        be_stats={hops[0].id: (1, ip_len, 0)},
    )
    run_case(lb, ack, hit)  # the same bytes as the first: the same hop list

    syn = _frame(lb, "beamer", sport=42000)
    run_case(lb, syn, fx._beamer(lb.env, syn))
    conn = lb.conn(syn)
    assert conn is not None and conn.hops == (hops[0].id,)
    assert conn.state is abi.SessState.TCP_SYN
    h = fx.hash_of(syn, vip)
    ack2 = _frame(lb, "beamer", sport=42000, flags="A")
    run_case(lb, ack2, _known_flow(lb, ack2, vip, fx.beamer_hops(syn, vip)[0].id, h))


def test_beamer_hop_lists_of_every_length(lb: Lb) -> None:
    """New flows on Beamer VIPs whose buckets name 1-3 later hops, with gaps, inactive
    and other-family ones: GUE hop lists of two, three and four hops, IPv4 and IPv6."""
    seen: set[tuple[str, int]] = set()
    for name in ("beamer", "beamer4", "beamer_skip", "beamer6"):
        for sport in range(43000, 43016):
            frame = _frame(lb, name, sport=sport)
            hops = fx.beamer_hops(frame, fx.VIPS[name])
            run_case(lb, frame, fx.beamer_flow(name)(lb.env, frame))
            seen.add((name, len(hops)))
    assert seen == {
        ("beamer", 2),
        ("beamer4", 4),
        ("beamer_skip", 2),
        ("beamer6", 4),
        ("beamer6", 3),
    }


def test_second_packet_hits_the_connection_table_after_a_table_change(lb: Lb) -> None:
    vip = fx.VIPS["tcp4"]
    frame = _frame(lb, "tcp4", sport=41000)
    be_id, h = fx.pick(frame, vip)
    run_case(lb, frame, fx.new_flow("tcp4")(lb.env, frame))

    # Every bucket now names another backend: the known flow must not move...
    other = next(b for b in fx.V4_BES if b != be_id)
    lb.set_table(vip.id, [other])
    ack = _frame(lb, "tcp4", sport=41000, flags="A")
    run_case(lb, ack, _known_flow(lb, ack, vip, be_id, h))
    run_case(lb, ack, _known_flow(lb, ack, vip, be_id, h))

    # ... while a new flow follows the new table.
    fresh = _frame(lb, "tcp4", sport=41001)
    h2 = fx.hash_of(fresh, vip)
    want = fx.new_flow("tcp4")(lb.env, fresh)  # computed for the old table: fix it up
    be = fx.BACKENDS[other]
    assert be.mac is not None
    ip_len = fx.flow_of(fresh)[5]
    want = fx.Expect(
        fx.XDP_TX,
        fx.encapsulated(fresh, vip, be, h2, eth_dst=be.mac, eth_src=lb.env.lb_mac),
        events=want.events,
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={other: (1, ip_len, 1)},
    )
    run_case(lb, fresh, want)

    # A SYN of the known flow's 5-tuple (a reused port) is a new connection: it
    # follows the table too, and its entry replaces the old one.
    want = fx.Expect(
        fx.XDP_TX,
        fx.encapsulated(frame, vip, be, h, eth_dst=be.mac, eth_src=lb.env.lb_mac),
        events={**fx.NEW_FLOW, Event.TX: 1},
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={other: (1, ip_len, 1)},
    )
    run_case(lb, frame, want)
    conn = lb.conn(frame)
    assert conn is not None and conn.backend_id == other
    assert conn.state is abi.SessState.TCP_SYN
    assert sum(1 for e in lb.conns.iter_entries() if e.key == conn.key) == 1


def test_tcp_session_outlives_its_backend_leaving(lb: Lb) -> None:
    """Issue 11: established TCP connections keep going where they started. The backend
    leaves the VIP's table and its members and its slot goes inactive (the planner's
    DeleteBackend): a mid-connection packet still hits its session and goes to it; a SYN
    of the same 5-tuple (a reused port) follows the table."""
    vip = fx.VIPS["tcp6"]
    syn = _frame(lb, "tcp6", sport=42000)
    be_id, h = fx.pick(syn, vip)
    assert lb.run(syn).retval == fx.XDP_TX

    other = next(b for b in fx.V6_BES if b != be_id)
    lb.set_table(vip.id, [other])
    lb.set_backend(be_id, active=False)
    ack = _frame(lb, "tcp6", sport=42000, flags="A")
    run_case(lb, ack, _known_flow(lb, ack, vip, be_id, h))
    conn = lb.conn(ack)
    assert conn is not None and conn.backend_id == be_id
    assert conn.state is abi.SessState.TCP_EST  # the ACK moved it on

    be = fx.BACKENDS[other]
    assert be.mac is not None
    ip_len = fx.flow_of(syn)[5]
    want = fx.Expect(
        fx.XDP_TX,
        fx.encapsulated(syn, vip, be, h, eth_dst=be.mac, eth_src=lb.env.lb_mac),
        events={**fx.NEW_FLOW, Event.TX: 1},
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={other: (1, ip_len, 1)},
    )
    run_case(lb, syn, want)
    conn = lb.conn(syn)
    assert conn is not None and (conn.backend_id, conn.state) == (other, abi.SessState.TCP_SYN)


def test_stale_udp_session_rehashes_to_an_active_backend(lb: Lb) -> None:
    """A UDP session whose backend has left the VIP (members NONE, slot inactive) is
    stale: the packet is hashed into the table again and its insert replaces it."""
    vip = fx.VIPS["udp6"]
    frame = _frame(lb, "udp6", sport=42000)
    be_id, h = fx.pick(frame, vip)
    assert lb.run(frame).retval == fx.XDP_TX

    other = next(b for b in fx.V6_BES if b != be_id)
    lb.set_table(vip.id, [other])
    lb.set_backend(be_id, active=False)
    be = fx.BACKENDS[other]
    assert be.mac is not None
    ip_len = fx.flow_of(frame)[5]
    want = fx.Expect(
        fx.XDP_TX,
        fx.encapsulated(frame, vip, be, h, eth_dst=be.mac, eth_src=lb.env.lb_mac),
        events={Event.CONN_STALE: 1, **fx.NEW_FLOW, Event.TX: 1},
        vip_stats={vip.id: (1, ip_len, 1)},
        be_stats={other: (1, ip_len, 1)},
    )
    before = lb.conn(frame)
    assert before is not None
    run_case(lb, frame, want)
    conn = lb.conn(frame)
    assert conn is not None and (conn.backend_id, conn.hash) == (other, h)
    assert (conn.set, conn.way) == (before.set, before.way)  # replaced in place
    # The replaced session is now a plain hit.
    run_case(lb, frame, _known_flow(lb, frame, vip, other, h))


@pytest.mark.parametrize("proto", ["udp4", "tcp4"])
def test_stale_session_with_no_active_backend_left_is_dropped(lb: Lb, proto: str) -> None:
    """The VIP's one backend is down (members DOWN, slot inactive, the table still names
    it): a UDP session is stale and its re-hash finds no backend; a TCP session is not
    judged by its backend's state in the VIP, so its connection goes on."""
    vip = fx.VIPS[proto]
    frame = _frame(lb, proto, sport=42500)
    be_id, h = fx.pick(frame, vip)
    assert lb.run(frame).retval == fx.XDP_TX
    lb.set_backend(be_id, active=False)
    lb.set_table(vip.id, [be_id], members={be_id: abi.MemberState.DOWN})
    frame = _frame(lb, proto, sport=42500, flags="A")
    if proto == "udp4":
        want = fx.Expect(
            fx.XDP_DROP, frame, events={Event.CONN_STALE: 1}, drops={DropReason.NO_BACKEND: 1}
        )
    else:
        want = _known_flow(lb, frame, vip, be_id, h)
    run_case(lb, frame, want)


def test_source_hash_keeps_one_source_on_one_backend(lb: Lb) -> None:
    vip = fx.VIPS["srchash"]
    src = fx.A("198.18.7.9")
    frames = [_frame(lb, "srchash", sport=p, src=src) for p in (40000, 40001, 51234)]
    hashes = {fx.hash_of(f, vip) for f in frames}
    assert len(hashes) == 1, "the source-only hash ignores ports"
    backends = set()
    for f in frames:
        want = fx.new_flow("srchash")(lb.env, f)
        run_case(lb, f, want)
        backends.add(next(iter(want.be_stats)))
        # Still keyed by the full 5-tuple: one entry per flow.
        assert lb.conn(f) is not None
    assert len(backends) == 1


def test_stats_add_up_over_many_flows(lb: Lb) -> None:
    vip = fx.VIPS["udp4"]
    before = lb.counters()
    per_backend: dict[int, list[int]] = {}
    total_bytes = 0
    for sport in range(30000, 30040):
        frame = _frame(lb, "udp4", sport=sport)
        be_id, _ = fx.pick(frame, vip)
        ip_len = fx.flow_of(frame)[5]
        for _ in range(2):  # a new flow, then a known one
            assert lb.run(frame).retval == fx.XDP_TX
        st = per_backend.setdefault(be_id, [0, 0, 0])
        st[0] += 2
        st[1] += 2 * ip_len
        st[2] += 1
        total_bytes += 2 * ip_len
    delta = lb.counters() - before
    assert len(per_backend) == 3, "40 flows over 3 backends should use them all"
    assert delta.vip_stats == {vip.id: (80, total_bytes, 40)}
    assert delta.be_stats == {k: tuple(v) for k, v in per_backend.items()}
    assert delta.events == {
        Event.CONN_MISS: 40,
        Event.CONN_INSERT: 40,
        Event.CONN_HIT: 40,
        Event.TX: 80,
    }
    assert delta.drops == {}


def test_missing_outer_source_address_is_no_config(lb: Lb) -> None:
    lb.set_config(src6=False)
    frame = _frame(lb, "tcp6")
    be_id, _ = fx.pick(frame, fx.VIPS["tcp6"])
    ip_len = fx.flow_of(frame)[5]
    want = fx.Expect(
        fx.XDP_DROP,
        frame,
        events={**fx.NEW_FLOW},
        drops={DropReason.NO_CONFIG: 1},
        vip_stats={fx.VIPS["tcp6"].id: (1, ip_len, 1)},
        be_stats={be_id: (1, ip_len, 1)},
    )
    run_case(lb, frame, want)
    # IPv4 tunnels still work.
    frame4 = _frame(lb, "tcp4")
    run_case(lb, frame4, fx.new_flow("tcp4")(lb.env, frame4))


def test_the_hash_seed_is_used(lb: Lb) -> None:
    vip = fx.VIPS["tcp4"]
    lb.set_config(seed=7)
    frame = _frame(lb, "tcp4", sport=43000)
    assert lb.run(frame).retval == fx.XDP_TX
    conn = lb.conn(frame)
    assert conn is not None
    assert conn.hash == fx.hash_of(frame, vip, seed=7) != fx.hash_of(frame, vip)


def test_cached_next_hop_follows_a_readdressed_backend(lb: Lb) -> None:
    """The per-CPU next-hop cache is keyed by address too, not only by backend id."""
    vip = fx.VIPS["tcp4"]
    frame = _frame(lb, "tcp4", sport=44000)
    be_id, h = fx.pick(frame, vip)
    run_case(lb, frame, fx.new_flow("tcp4")(lb.env, frame))  # fills the cache
    frame = _frame(lb, "tcp4", sport=44000, flags="A")
    # Same slot, now the address of a backend with no neighbour entry.
    moved = fx.BACKENDS[7]
    lb.obj.map("lb_backends").update(struct.pack("<I", be_id), abi.Backend.make(moved.addr).pack())
    ip_len = fx.flow_of(frame)[5]
    readdressed = dataclasses.replace(moved, id=be_id)
    want = fx.Expect(
        fx.XDP_PASS,
        fx.encapsulated(frame, vip, readdressed, h, eth_dst=lb.env.lb_mac, eth_src=fx.CLIENT_MAC),
        events={Event.CONN_HIT: 1, Event.FIB_PASS: 1},
        vip_stats={vip.id: (1, ip_len, 0)},
        be_stats={be_id: (1, ip_len, 0)},
    )
    run_case(lb, frame, want)


def test_longer_packet_than_cached_rechecks_the_mtu(lb: Lb) -> None:
    """A cached next hop covers packets up to the longest one that passed the MTU check."""
    vip = fx.VIPS["udp4"]
    small = _frame(lb, "udp4", sport=45000)
    be_id, h = fx.pick(small, vip)
    run_case(lb, small, fx.new_flow("udp4")(lb.env, small))
    v = fx.VIPS["udp4"]
    # 1,500 bytes of IP: fits lb0's MTU alone, not with 40 bytes of IPv4 + GUE around it.
    big = bytes(
        fx.client_frame(
            v.addr, v.port, v.proto, sport=45000, lb_mac=lb.env.lb_mac, payload=b"z" * 1472
        )
    )
    ip_len = fx.flow_of(big)[5]
    assert ip_len == 1500
    be = fx.BACKENDS[be_id]
    want = fx.Expect(
        fx.XDP_DROP,
        fx.encapsulated(big, vip, be, h, eth_dst=lb.env.lb_mac, eth_src=fx.CLIENT_MAC),
        events={Event.CONN_HIT: 1},
        drops={DropReason.TOO_BIG: 1},
        vip_stats={vip.id: (1, ip_len, 0)},
        be_stats={be_id: (1, ip_len, 0)},
    )
    run_case(lb, big, want)
    run_case(lb, small, _known_flow(lb, small, vip, be_id, h))
