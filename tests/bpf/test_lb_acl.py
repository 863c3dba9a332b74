"""Source ACLs, the new-flow rate limit and the insert budget of lb_xdp (BPF_PROG_TEST_RUN).

docs/datapath.md steps 5a, 6a, 8a and 9: exact verdicts and counter deltas (drops,
events, ``lb_acl_hits`` by scope and list) for hand-made cases, then random packets
and random rules against the model (xdplb.model), hit counters included.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import os
import random
import struct
import time
from collections.abc import Iterator

import lb_fixtures as fx
import pytest
from lb_harness import Lb

from xdplb import model
from xdplb.core import abi
from xdplb.core.acl import AclKey, rate_key, rate_map_key, rule_value
from xdplb.core.state import ConnEntry
from xdplb.datapath.lb import MAP_NAMES, LbMaps
from xdplb.model import frames

pytestmark = pytest.mark.bpf

A = ipaddress.ip_address
N = ipaddress.ip_network
G = abi.ACL_GLOBAL
ALLOW, DENY, DEFAULT = abi.AclList.ALLOW, abi.AclList.DENY, abi.AclList.DEFAULT
ACL_MAPS = ("lb_acl4", "lb_acl6", "lb_rate")


def _u32(n: int) -> bytes:
    return struct.pack("<I", n)


def _clear(lb: Lb) -> None:
    for name in ACL_MAPS:
        m = lb.obj.map(name)
        for key in list(m.keys()):
            m.delete(key)


@pytest.fixture
def acl_lb(lb: Lb) -> Iterator[Lb]:
    """The fixture lab with empty ACL tries and rate buckets (before and after)."""
    _clear(lb)
    yield lb
    _clear(lb)


def rule(lb: Lb, scope: int, prefix: str, action: abi.AclList) -> None:
    key = AclKey(scope, N(prefix))
    lb.obj.map(key.map_name).update(key.abi_key().pack(), rule_value(action))


def set_flags(lb: Lb, flags: int = 0, **fields: int) -> None:
    """lb_config with the fixture's values plus ``flags`` and other fields."""
    m = lb.obj.map("lb_config")
    lb.set_config()
    cfg = abi.Config.from_buffer_copy(m.lookup(_u32(0)) or b"")
    cfg.flags = flags
    for name, value in fields.items():
        setattr(cfg, name, value)
    m.update(_u32(0), cfg.pack())


def vip_flags(lb: Lb, name: str, flags: int) -> None:
    v = fx.VIPS[name]
    lb.put_vip(dataclasses.replace(v, flags=v.flags | flags))


def hits(
    lb: Lb, slots: tuple[int, ...] = (*(i + 1 for i in fx.VIP_BY_ID), abi.ACL_GLOBAL_SLOT)
) -> dict[tuple[int, abi.AclList], int]:
    """Every non-zero lb_acl_hits counter of ``slots`` as (scope, list) -> packets."""
    m = lb.obj.map("lb_acl_hits")
    out = {}
    for slot in slots:
        for lst in abi.AclList:
            n = sum(
                struct.unpack("<Q", r)[0]
                for r in m.lookup_percpu(_u32(slot * len(abi.AclList) + lst))
            )
            if n:
                out[(G if slot == abi.ACL_GLOBAL_SLOT else slot - 1, lst)] = n
    return out


def frame(lb: Lb, vip: str, src: str | None = None, sport: int = 40000, flags: str = "S") -> bytes:
    v = fx.VIPS[vip]
    return bytes(
        fx.client_frame(
            v.addr,
            v.port or 8080,
            v.proto,
            src=A(src) if src else None,
            sport=sport,
            lb_mac=lb.env.lb_mac,
            flags=flags,
        )
    )


#: A token bucket's stamp in the far future: lb_xdp then counts no time since it (elapsed
#: 0), so the bucket does not refill however long the machine takes to the next packet.
FROZEN = 1 << 63


def freeze_bucket(lb: Lb, key: bytes) -> None:
    """Stop the clock of one token bucket (``lb_rate`` key) until a packet draws from it."""
    m = lb.obj.map("lb_rate")
    raw = m.lookup(key)
    if raw is not None:
        bucket = abi.Rate.from_buffer_copy(raw)
        bucket.stamp = FROZEN
        m.update(key, bucket.pack())


def age_buckets(lb: Lb, seconds: float) -> None:
    """Every token bucket as if its last new flow came ``seconds`` ago (less a jiffy: lb_xdp
    reads the coarse monotonic clock, which lags this one by at most that)."""
    now = time.monotonic_ns()
    m = lb.obj.map("lb_rate")
    for key in list(m.keys()):
        raw = m.lookup(key)
        if raw is not None:
            bucket = abi.Rate.from_buffer_copy(raw)
            bucket.stamp = now - int(seconds * 1e9)
            m.update(key, bucket.pack())


def run(
    lb: Lb, frm: bytes
) -> tuple[int, dict[str, int], dict[str, int], dict[tuple[int, abi.AclList], int]]:
    """Verdict, then the deltas of events, drops (by name) and ACL hits. The token buckets
    are frozen after it: between two packets of a test no time passes for them."""
    c0, h0 = lb.counters(), hits(lb)
    verdict = lb.run(frm).retval
    for key in list(lb.obj.map("lb_rate").keys()):
        freeze_bucket(lb, key)
    d, h1 = (lb.counters() - c0).named(), hits(lb)
    dh = {k: n - h0.get(k, 0) for k, n in h1.items() if n != h0.get(k, 0)}
    return verdict, d["events"], d["drops"], dh  # type: ignore[return-value]


FWD = {"CONN_MISS": 1, "CONN_INSERT": 1, "TX": 1}
#: A new flow over the insert budget: balanced, not recorded.
FLOOD = {"CONN_MISS": 1, "CONN_FLOOD": 1, "TX": 1}
ACL_DROP = {"ACL": 1}


# --- ACLs ----------------------------------------------------------------------------------


def test_global_deny_drops_every_vip_and_leaves_other_traffic(acl_lb: Lb) -> None:
    rule(acl_lb, G, "198.18.5.0/24", DENY)
    rule(acl_lb, G, "fd78:6470:6c62:5::/64", DENY)
    set_flags(acl_lb, abi.CFG_F_ACL)
    for vip in ("tcp4", "udp4", "wild", "tcp6", "udp6"):
        assert run(acl_lb, frame(acl_lb, vip)) == (fx.XDP_DROP, {}, ACL_DROP, {(G, DENY): 1})
    # Another source: untouched (a deny list counts nothing for sources it does not name).
    assert run(acl_lb, frame(acl_lb, "tcp4", "198.18.6.1")) == (fx.XDP_TX, FWD, {}, {})
    assert run(acl_lb, frame(acl_lb, "tcp6", "fd78:6470:6c62:6::1")) == (fx.XDP_TX, FWD, {}, {})
    # Not a VIP address: never looked at, whatever the source.
    other = fx.client_frame(A("198.19.9.9"), 80, lb_mac=acl_lb.env.lb_mac)
    assert run(acl_lb, bytes(other)) == (fx.XDP_PASS, {"PASS_NOT_VIP": 1}, {}, {})


def test_global_allow_list_denies_everyone_else(acl_lb: Lb) -> None:
    rule(acl_lb, G, "198.18.6.0/24", ALLOW)
    set_flags(acl_lb, abi.CFG_F_ACL | abi.CFG_F_ACL_DENY)
    assert run(acl_lb, frame(acl_lb, "tcp4", "198.18.6.9")) == (
        fx.XDP_TX,
        FWD,
        {},
        {(G, ALLOW): 1},
    )
    assert run(acl_lb, frame(acl_lb, "tcp4")) == (fx.XDP_DROP, {}, ACL_DROP, {(G, DEFAULT): 1})
    # No IPv6 rule at all: every IPv6 source is outside the allow list.
    assert run(acl_lb, frame(acl_lb, "udp6")) == (fx.XDP_DROP, {}, ACL_DROP, {(G, DEFAULT): 1})


def test_per_vip_allow_list_applies_to_that_vip_only(acl_lb: Lb) -> None:
    vid = fx.VIPS["tcp4"].id
    rule(acl_lb, vid, "198.18.6.0/24", ALLOW)
    rule(acl_lb, fx.VIPS["udp4"].id, "198.18.0.0/16", DENY)  # flags clear: never read
    vip_flags(acl_lb, "tcp4", abi.VIP_F_ACL | abi.VIP_F_ACL_DENY)
    assert run(acl_lb, frame(acl_lb, "tcp4")) == (fx.XDP_DROP, {}, ACL_DROP, {(vid, DEFAULT): 1})
    assert run(acl_lb, frame(acl_lb, "tcp4", "198.18.6.7")) == (
        fx.XDP_TX,
        FWD,
        {},
        {(vid, ALLOW): 1},
    )
    # Same address, other port: another VIP, another scope.
    assert run(acl_lb, frame(acl_lb, "udp4")) == (fx.XDP_TX, FWD, {}, {})


def test_global_then_vip(acl_lb: Lb) -> None:
    vid = fx.VIPS["tcp6"].id
    rule(acl_lb, G, "fd78:6470:6c62::/48", ALLOW)
    rule(acl_lb, vid, "fd78:6470:6c62:5::1/128", DENY)
    set_flags(acl_lb, abi.CFG_F_ACL)
    vip_flags(acl_lb, "tcp6", abi.VIP_F_ACL)
    assert run(acl_lb, frame(acl_lb, "tcp6")) == (
        fx.XDP_DROP,
        {},
        ACL_DROP,
        {(G, ALLOW): 1, (vid, DENY): 1},
    )
    assert run(acl_lb, frame(acl_lb, "tcp6", "fd78:6470:6c62:5::2")) == (
        fx.XDP_TX,
        FWD,
        {},
        {(G, ALLOW): 1},
    )


@pytest.mark.parametrize(
    ("rules", "sources"),
    [
        (
            [("198.18.0.0/16", DENY), ("198.18.5.0/24", ALLOW), ("198.18.5.128/25", DENY)],
            [
                ("198.18.5.1", ALLOW),
                ("198.18.5.200", DENY),
                ("198.18.9.1", DENY),
                ("198.19.77.1", None),
            ],
        ),
        (
            [
                ("fd78:6470:6c62::/48", ALLOW),
                ("fd78:6470:6c62:7::/64", DENY),
                ("fd78:6470:6c62:7::66/128", ALLOW),
                ("fd78:6470:6c62:7::64/126", DENY),
            ],
            [
                ("fd78:6470:6c62:5::1", ALLOW),
                ("fd78:6470:6c62:7::1", DENY),
                ("fd78:6470:6c62:7::66", ALLOW),
                ("fd78:6470:6c62:7::65", DENY),
            ],
        ),
    ],
    ids=["v4", "v6"],
)
def test_longest_prefix_wins(
    acl_lb: Lb, rules: list[tuple[str, abi.AclList]], sources: list[tuple[str, abi.AclList | None]]
) -> None:
    for prefix, action in rules:
        rule(acl_lb, G, prefix, action)
    set_flags(acl_lb, abi.CFG_F_ACL)
    vip = "tcp4" if "." in sources[0][0] else "tcp6"
    for i, (src, want) in enumerate(sources):
        verdict, events, drops, dh = run(acl_lb, frame(acl_lb, vip, src, sport=41000 + i))
        if want is DENY:
            assert (verdict, events, drops, dh) == (fx.XDP_DROP, {}, ACL_DROP, {(G, DENY): 1}), src
        else:
            assert (verdict, events, drops) == (fx.XDP_TX, FWD, {}), src
            assert dh == ({(G, ALLOW): 1} if want is ALLOW else {}), src


def test_no_rules_flag_means_no_lookup(acl_lb: Lb) -> None:
    """Rules in the tries but no scope flag: nothing is looked up, nothing counted; the
    packet goes exactly as with empty tries."""
    base = run(acl_lb, frame(acl_lb, "tcp4", sport=42000))
    rule(acl_lb, G, "0.0.0.0/0", DENY)
    rule(acl_lb, fx.VIPS["tcp4"].id, "0.0.0.0/0", DENY)
    assert run(acl_lb, frame(acl_lb, "tcp4", sport=42001)) == base == (fx.XDP_TX, FWD, {}, {})


# --- the rate limit ------------------------------------------------------------------------

RL = {"RATE_LIMIT": 1}


def test_rate_limit_burst_then_drops_per_prefix(acl_lb: Lb) -> None:
    set_flags(acl_lb, rl_rate=1, rl_burst=3, rl_prefix4=24, rl_prefix6=64)
    for i in range(3):
        assert run(acl_lb, frame(acl_lb, "tcp4", sport=43000 + i))[:3] == (fx.XDP_TX, FWD, {})
    # The bucket of 198.18.5.0/24 is empty: a new flow from any address of it is dropped.
    assert run(acl_lb, frame(acl_lb, "tcp4", sport=43003))[:3] == (fx.XDP_DROP, {}, RL)
    assert run(acl_lb, frame(acl_lb, "udp4", "198.18.5.77"))[:3] == (fx.XDP_DROP, {}, RL)
    # Packets of open connections are not new flows: an ACK goes by the connection table.
    ack = frame(acl_lb, "tcp4", sport=43000, flags="A")
    assert run(acl_lb, ack)[:3] == (fx.XDP_TX, {"CONN_HIT": 1, "TX": 1}, {})
    # Another prefix has its own bucket.
    assert run(acl_lb, frame(acl_lb, "tcp4", "198.18.6.1"))[:3] == (fx.XDP_TX, FWD, {})
    # IPv6 is keyed by /64 here.
    for i in range(3):
        assert run(acl_lb, frame(acl_lb, "tcp6", sport=43100 + i))[:3] == (fx.XDP_TX, FWD, {})
    assert run(acl_lb, frame(acl_lb, "tcp6", "fd78:6470:6c62:5::9"))[:3] == (fx.XDP_DROP, {}, RL)


def test_rate_limit_spares_udp_flows_the_table_knows(acl_lb: Lb) -> None:
    set_flags(acl_lb, rl_rate=1, rl_burst=1)
    udp = frame(acl_lb, "udp4", sport=44000)
    assert run(acl_lb, udp)[:3] == (fx.XDP_TX, FWD, {})
    assert run(acl_lb, udp)[:3] == (fx.XDP_TX, {"CONN_HIT": 1, "TX": 1}, {})
    assert run(acl_lb, frame(acl_lb, "udp4", sport=44001))[:3] == (fx.XDP_DROP, {}, RL)


def test_rate_limit_refills(acl_lb: Lb) -> None:
    set_flags(acl_lb, rl_rate=20, rl_burst=1)
    sport = iter(range(45000, 46000))
    assert run(acl_lb, frame(acl_lb, "tcp4", sport=next(sport)))[0] == fx.XDP_TX
    assert run(acl_lb, frame(acl_lb, "tcp4", sport=next(sport)))[:3] == (fx.XDP_DROP, {}, RL)
    age_buckets(acl_lb, 0.1)  # 20/s: a token every 50 ms, so one (the burst) is back
    assert run(acl_lb, frame(acl_lb, "tcp4", sport=next(sport)))[0] == fx.XDP_TX
    assert run(acl_lb, frame(acl_lb, "tcp4", sport=next(sport)))[:3] == (fx.XDP_DROP, {}, RL)


def test_rate_limit_off_when_rate_is_zero(acl_lb: Lb) -> None:
    set_flags(acl_lb, rl_rate=0, rl_burst=0)
    for i in range(20):
        assert run(acl_lb, frame(acl_lb, "tcp4", sport=47000 + i))[:3] == (fx.XDP_TX, FWD, {})
    assert not list(acl_lb.obj.map("lb_rate").keys())


# --- the insert budget ---------------------------------------------------------------------


@pytest.fixture
def one_cpu() -> Iterator[None]:
    """lb_flood is per CPU: keep every test_run of a test on one CPU."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def test_insert_budget_from_config(acl_lb: Lb, one_cpu: None) -> None:
    set_flags(acl_lb, flood_max=2)
    flood = acl_lb.obj.map("lb_flood")  # zeroed: a fresh window (earlier tests opened one)
    flood.update_array(bytes(flood.max_entries * flood.value_stride))
    frames = [frame(acl_lb, "tcp4", sport=48000 + i) for i in range(4)]
    for f in frames[:2]:
        assert run(acl_lb, f)[:3] == (fx.XDP_TX, FWD, {})
    for f in frames[2:]:
        assert run(acl_lb, f)[:3] == (fx.XDP_TX, FLOOD, {})
    assert [acl_lb.conn(f) is not None for f in frames] == [True, True, False, False]


def test_insert_budget_zero_is_no_limit(acl_lb: Lb, one_cpu: None) -> None:
    set_flags(acl_lb, flood_max=0)
    frames = [frame(acl_lb, "udp4", sport=49000 + i) for i in range(50)]
    for f in frames:
        assert run(acl_lb, f)[:3] == (fx.XDP_TX, FWD, {})
    assert all(acl_lb.conn(f) is not None for f in frames)


# --- against the model ---------------------------------------------------------------------

N_PACKETS = 600
CHUNK = 100
NETS4 = [N(f"198.18.{i}.0/24") for i in range(4, 10)]
NETS6 = [N(f"fd78:6470:6c62:{i}::/64") for i in range(4, 10)]


def _random_prefix(
    rng: random.Random, version: int
) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    base = rng.choice(NETS4 if version == 4 else NETS6)
    bits = base.max_prefixlen
    plen = (
        rng.choice([16, 22, 24, 25, 26, 28])
        if version == 4
        else rng.choice([48, 56, 64, 120, 122, 126])
    )
    addr = int(base.network_address) + rng.randrange(base.num_addresses)
    return ipaddress.ip_network((addr >> (bits - plen) << (bits - plen), plen))  # type: ignore[arg-type]


def _random_source(rng: random.Random, version: int) -> fx.IPAddress:
    base = rng.choice(NETS4 if version == 4 else NETS6)
    return ipaddress.ip_address(int(base.network_address) + rng.randrange(1, 64))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_against_the_model(acl_lb: Lb, one_cpu: None, seed: int) -> None:
    """Random rules in the global scope and four VIPs' (allow lists and deny lists),
    random sources, TCP SYNs and ACKs and UDP, a rate limit of one new flow per /26
    (/120): verdict, drop reason, events, ACL hits and the forwarded bytes as the model
    says, with the model told which buckets are empty."""
    rng = random.Random(seed)
    lb = acl_lb
    scopes = {G: abi.CFG_F_ACL, 1: 0, 2: 0, 3: 0, 4: 0}
    deny_default = {s: s != G and rng.random() < 0.3 for s in scopes}
    rule(lb, G, str(NETS4[0]), ALLOW)
    rule(lb, G, str(NETS6[0]), ALLOW)
    for scope in scopes:
        for _ in range(rng.randrange(0, 6)):
            version = rng.choice((4, 6))
            rule(lb, scope, str(_random_prefix(rng, version)), rng.choice((ALLOW, DENY, DENY)))
    cfg_flags = abi.CFG_F_ACL | (abi.CFG_F_ACL_DENY if deny_default[G] else 0)
    set_flags(lb, cfg_flags, rl_rate=1, rl_burst=2, rl_prefix4=26, rl_prefix6=120)
    for name in ("tcp4", "udp4", "tcp6", "udp6"):
        vid = fx.VIPS[name].id
        vip_flags(lb, name, abi.VIP_F_ACL | (abi.VIP_F_ACL_DENY if deny_default[vid] else 0))

    ev, dr = lb.obj.map("lb_events"), lb.obj.map("lb_drops")
    slots = (2, 3, 4, 5, abi.ACL_GLOBAL_SLOT)

    def counts() -> tuple[list[int], list[int], dict[tuple[int, abi.AclList], int]]:
        return (
            [sum(struct.unpack("<Q", r)[0] for r in ev.lookup_percpu(_u32(e))) for e in abi.Event],
            [
                sum(struct.unpack("<Q", r)[0] for r in dr.lookup_percpu(_u32(d)))
                for d in abi.DropReason
            ],
            hits(lb, slots),
        )

    maps = LbMaps({n: lb.obj.map(n) for n in MAP_NAMES})
    state = model.state_from_snapshot(maps.snapshot())
    conns: dict[bytes, ConnEntry] = {}
    spent: dict[object, int] = {}
    seen: collections.Counter[str] = collections.Counter()
    for i in range(N_PACKETS):
        if i % CHUNK == 0:
            # Every chunk starts with full buckets: each chunk sees both full and empty ones.
            rate = lb.obj.map("lb_rate")
            for key in list(rate.keys()):
                rate.delete(key)
            spent.clear()
        vip = fx.VIPS[rng.choice(("tcp4", "udp4", "tcp6", "udp6", "wild", "6in4"))]
        src = _random_source(rng, vip.addr.version)
        flow = model.Flow(
            src, vip.addr, rng.choice((50000 + i, 50000)), vip.port or 8080, vip.proto
        )
        tcp_flags = rng.choice((0x02, 0x10)) if vip.proto == abi.IPPROTO_TCP else 0
        frm = frames.frame(flow, b"x" * 10, tcp_flags=tcp_flags)
        bucket = rate_key(src, 26, 120)
        st = dataclasses.replace(
            state,
            conns=conns,
            rate_limited=frozenset(b for b, n in spent.items() if n >= 2),
        )
        want = model.decide(st, frm)
        e0, d0, h0 = counts()
        verdict = lb.run(frm).retval
        # No refill before the bucket's next flow, however slow this loop: the model's
        # "empty" (two flows spent) never goes stale.
        freeze_bucket(lb, rate_map_key(bucket))
        e1, d1, h1 = counts()
        events = {
            abi.Event(k).name: b - a for k, (a, b) in enumerate(zip(e0, e1, strict=True)) if a != b
        }
        drops = {
            abi.DropReason(k).name: b - a
            for k, (a, b) in enumerate(zip(d0, d1, strict=True))
            if a != b
        }
        dh = {k: n - h0.get(k, 0) for k, n in h1.items() if n != h0.get(k, 0)}
        assert want.allows(verdict), (i, want.describe(), verdict)
        seen[want.drop.name if want.drop is not None else want.outcome.value] += 1
        seen.update(lst.name for _, lst in want.acl_hits)
        assert drops == ({want.drop.name: 1} if want.drop is not None else {}), (i, want.describe())
        fib = {"TX", "REDIRECT", "FIB_PASS", "LOCAL"}
        got_events = {k: v for k, v in events.items() if k not in fib}
        assert got_events == {e.name: 1 for e in want.events}, (i, want.describe())
        assert dh == {h: 1 for h in want.acl_hits}, (i, want.describe())
        if want.conn_insert is not None:
            conns[want.conn_insert[0]] = want.conn_insert[1]
        starts = vip.proto != abi.IPPROTO_TCP or tcp_flags == 0x02
        gone = (abi.DropReason.ACL, abi.DropReason.RATE_LIMIT)
        new = starts and want.vip is not None and abi.Event.CONN_HIT not in want.events
        if new and want.drop not in gone:
            spent[bucket] = spent.get(bucket, 0) + 1
    # Not vacuous: every path was taken.
    for what in ("forward", "ACL", "RATE_LIMIT", "ALLOW", "DENY"):
        assert seen[what] > 0, (what, seen)
