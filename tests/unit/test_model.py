"""The reference model on handcrafted packets, one group of cases per step of docs/datapath.md.

These pin the model to the contract without a kernel; tests/bpf/test_differential.py
and tests/bpf/test_malformed.py then pin the real program to the model.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import struct
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xdplb import model as m
from xdplb.core import abi, hashing
from xdplb.core.addresses import IPAddress
from xdplb.core.state import (
    BackendState,
    ConnEntry,
    LbConfig,
    LookupTable,
    Vip,
    VipParams,
    filter_bits,
)
from xdplb.model import frames
from xdplb.model.checksum import csum_replace16, ipv4_checksum
from xdplb.model.parse import ETH_P_8021AD, ETH_P_8021Q

pytestmark = pytest.mark.unit

V4 = ipaddress.IPv4Address
V6 = ipaddress.IPv6Address

VIP4 = V4("198.18.1.1")
VIP4_NOTABLE = V4("198.18.1.2")
VIP4_BEAMER = V4("198.18.1.3")
VIP6 = V6("fd78:6470:6c62:1::1")
CLIENT4 = V4("198.19.0.7")
CLIENT6 = V6("fd78:6470:6c62:2::7")
OTHER4 = V4("198.18.9.9")
SRC4 = V4("198.18.0.2")
SRC6 = V6("fd78:6470:6c62::2")
TCP, UDP = abi.IPPROTO_TCP, abi.IPPROTO_UDP
SIZE = 13  # a small prime: every bucket can be reasoned about

BACKENDS = {
    1: BackendState(V4("198.18.0.11")),
    2: BackendState(V4("198.18.0.12")),
    3: BackendState(V4("198.18.0.13")),
    4: BackendState(V6("fd78:6470:6c62::11")),
    5: BackendState(V4("198.18.0.14"), active=False),
}

VIPS = {
    Vip(VIP4, 80, TCP): VipParams(1, table_size=SIZE),
    Vip(VIP4, 0, UDP): VipParams(2, table_size=SIZE),
    Vip(VIP4, 53, UDP): VipParams(3, table_size=SIZE, encap=abi.Encap.IPIP),
    Vip(VIP6, 443, TCP): VipParams(4, flags=abi.VIP_F_SRC_HASH, table_size=SIZE),
    Vip(VIP4_NOTABLE, 80, TCP): VipParams(5, table_size=SIZE),
    Vip(VIP4_BEAMER, 80, TCP): VipParams(6, table_size=SIZE, table_kind=abi.TableKind.BEAMER),
}


def cycle(ids: list[int], size: int = SIZE) -> np.ndarray:
    return np.array([ids[i % len(ids)] for i in range(size)], dtype=np.uint32)


TABLES = {
    1: LookupTable(cycle([1, 2, 3])),
    2: LookupTable(cycle([2, 3])),
    3: LookupTable(cycle([3])),
    4: LookupTable(cycle([4])),
    6: LookupTable(cycle([1]), cycle([2, 0])),
}
CONFIG = LbConfig(SRC4, SRC6, gue_port=abi.GUE_PORT, seed=0x5EED)


def state(**changes: object) -> m.DataplaneState:
    kw: dict[str, object] = {
        "vips": VIPS,
        "backends": BACKENDS,
        "tables": TABLES,
        "config": CONFIG,
    }
    kw.update(changes)
    return m.DataplaneState(**kw)  # type: ignore[arg-type]


S = state()


def flow(dst: IPAddress = VIP4, dport: int = 80, proto: int = TCP, sport: int = 40000) -> m.Flow:
    src = CLIENT4 if dst.version == 4 else CLIENT6
    return m.Flow(src, dst, sport, dport, proto)


def expected_hash(f: m.Flow, src_only: bool = False) -> int:
    return hashing.flow_hash(f.hash_key(src_only), CONFIG.seed)


def table_choice(f: m.Flow, ids: list[int], src_only: bool = False) -> int:
    return ids[(expected_hash(f, src_only) % SIZE) % len(ids)]


# --- 1. Ethernet -----------------------------------------------------------------


def test_not_ip_passes() -> None:
    arp = frames.MAC_DST + frames.MAC_SRC + b"\x08\x06" + bytes(28)
    d = m.decide(S, arp)
    assert (d.outcome, d.events) == (m.Outcome.PASS, (abi.Event.PASS_NOT_IP,))


def test_runt_frame_is_not_ip() -> None:
    assert m.decide(S, b"\x02" * 13).events == (abi.Event.PASS_NOT_IP,)


@pytest.mark.parametrize("tpid", [ETH_P_8021Q, ETH_P_8021AD])
def test_one_vlan_tag_is_skipped_and_not_forwarded(tpid: int) -> None:
    f = flow()
    plain = m.decide(S, frames.frame(f))
    ip = frames.frame(f)[14:]
    tagged = m.decide(S, frames.ethernet(ip, 4, vlan=7, tpid=tpid))
    assert tagged.outcome is m.Outcome.FORWARD
    assert tagged.packet == plain.packet  # the tag is gone: outer IP onward is identical


def test_two_tags_are_not_ip() -> None:
    ip = frames.frame(flow())[14:]
    inner = ETH_P_8021Q.to_bytes(2, "big") + b"\x00\x07" + b"\x08\x00" + ip
    qinq = frames.MAC_DST + frames.MAC_SRC + ETH_P_8021AD.to_bytes(2, "big") + b"\x00\x05" + inner
    assert m.decide(S, qinq).events == (abi.Event.PASS_NOT_IP,)


def test_truncated_vlan_tag_is_not_ip() -> None:
    assert m.decide(S, frames.MAC_DST + frames.MAC_SRC + b"\x81\x00\x00").events == (
        abi.Event.PASS_NOT_IP,
    )


# --- 2. IP header -----------------------------------------------------------------


def v4_frame_with(
    f: m.Flow, *, vihl: int | None = None, tot_len: int | None = None, trail: bytes = b""
) -> bytes:
    fr = bytearray(frames.frame(f))
    if vihl is not None:
        fr[14] = vihl
    if tot_len is not None:
        fr[16:18] = tot_len.to_bytes(2, "big")
    return bytes(fr) + trail


@pytest.mark.parametrize(
    ("desc", "frame"),
    [
        ("version 6 in an IPv4 frame", v4_frame_with(flow(), vihl=0x65)),
        ("version 0", v4_frame_with(flow(), vihl=0x05)),
        ("IHL 4", v4_frame_with(flow(), vihl=0x44)),
        ("IHL 0", v4_frame_with(flow(), vihl=0x40)),
        ("options beyond the frame", v4_frame_with(flow(), vihl=0x4F)),
        ("tot_len < IHL*4", v4_frame_with(flow(), tot_len=19)),
        ("tot_len beyond the frame", v4_frame_with(flow(), tot_len=41)),
        ("header cut short", frames.frame(flow())[: 14 + 19]),
        ("IPv6 header cut short", frames.frame(flow(VIP6, 443))[: 14 + 39]),
        ("IPv6 payload_len beyond the frame", frames.frame(flow(VIP6, 443))[:-1]),
        (
            "version 4 in an IPv6 frame",
            frames.frame(flow(VIP6, 443))[:14] + b"\x46" + frames.frame(flow(VIP6, 443))[15:],
        ),
    ],
)
def test_malformed_ip_passes(desc: str, frame: bytes) -> None:
    d = m.decide(S, frame)
    assert (d.outcome, d.events) == (m.Outcome.PASS, (abi.Event.PASS_MALFORMED,)), desc


def test_ethernet_padding_stays_in_frame_but_not_in_lengths() -> None:
    f = flow()
    pad = b"\xee" * 6
    d = m.decide(S, frames.frame(f) + pad)
    base = m.decide(S, frames.frame(f))
    assert d.outcome is m.Outcome.FORWARD
    assert d.stats_bytes == base.stats_bytes == 40
    assert d.packet is not None and base.packet is not None
    assert d.packet == base.packet + pad
    assert d.packet[2:4] == base.packet[2:4]  # outer tot_len ignores the padding


def test_ipv4_options_are_carried() -> None:
    f = flow()
    tcp = frames.l4_header(TCP, f.sport, f.dport)
    ip = frames.ip_packet(f.src, f.dst, TCP, tcp, options=b"\x01\x01\x01\x00")
    d = m.decide(S, frames.ethernet(ip, 4))
    assert d.outcome is m.Outcome.FORWARD and d.backend_id == table_choice(f, [1, 2, 3])
    assert d.packet is not None and d.packet.endswith(ip)
    assert d.stats_bytes == 44


# --- 3. Protocol -------------------------------------------------------------------


def test_icmp_to_a_vip_passes_as_not_vip() -> None:
    ip = frames.ip_packet(CLIENT4, VIP4, 1, b"\x08\x00" + bytes(6))
    assert m.decide(S, frames.ethernet(ip, 4)).events == (abi.Event.PASS_NOT_VIP,)


def test_ipv6_extension_header_is_walked() -> None:
    tcp = frames.l4_header(TCP, 40000, 443)
    hbh = bytes([TCP, 0]) + bytes(6)  # hop-by-hop, next header TCP
    ip = frames.ip_packet(CLIENT6, VIP6, 0, hbh + tcp)
    d = m.decide(S, frames.ethernet(ip, 6))
    assert d.outcome is m.Outcome.FORWARD and d.flow == flow(VIP6, 443)


# --- 4. IPv4 fragments (more in test_model_icmp.py) -----------------------------------


def fragment(dst: IPAddress, frag: int, dport: int = 80) -> bytes:
    tcp = frames.l4_header(TCP, 40000, dport)
    return frames.ethernet(frames.ip_packet(CLIENT4, dst, TCP, tcp, frag=frag), 4)


@pytest.mark.parametrize("frag", [0x2000, 0x0001, 0x2010, 0x1FFF])
def test_fragment_of_a_vip_address_goes_to_its_fragment_vip(frag: int) -> None:
    d = m.decide(S, fragment(VIP4, frag))
    assert (d.outcome, d.events) == (m.Outcome.FORWARD, (abi.Event.FRAGMENT,))
    # Any port: the port may not even be in this fragment; VIP4's only TCP VIP takes it.
    assert m.decide(S, fragment(VIP4, frag, dport=9)).backend_id == d.backend_id


def test_fragment_elsewhere_passes() -> None:
    assert m.decide(S, fragment(OTHER4, 0x2000)).events == (abi.Event.PASS_NOT_VIP,)


def test_df_is_not_a_fragment() -> None:
    assert m.decide(S, fragment(VIP4, 0x4000)).outcome is m.Outcome.FORWARD


def test_fragment_uses_lb_vip_addrs_not_lb_vips() -> None:
    # lb_vip_filter passes both addresses (as while a plan moves a VIP from one to the other).
    s = state(vip_addrs=frozenset({OTHER4}), vip_filter=filter_bits({OTHER4, VIP4}))
    assert m.decide(s, fragment(OTHER4, 0x2000)).drop is abi.DropReason.FRAGMENT
    assert m.decide(s, fragment(VIP4, 0x2000)).events == (abi.Event.PASS_NOT_VIP,)


def test_a_destination_outside_the_vip_filter_passes_at_once() -> None:
    """Step 2': a destination whose lb_vip_filter bit is clear passes PASS_NOT_VIP before
    anything else is read: not even a fragment lb_vip_addrs names is dropped."""
    s = state(vip_addrs=frozenset({OTHER4}))
    assert hashing.addr_filter_bit(OTHER4.packed) not in s.vip_filter_bits
    assert m.decide(s, fragment(OTHER4, 0x2000)).events == (abi.Event.PASS_NOT_VIP,)
    assert s.vip_filter_bits == filter_bits(v.addr for v in VIPS)


# --- 5. L4 header ----------------------------------------------------------------------


def with_l4(dst: IPAddress, proto: int, l4: bytes) -> bytes:
    src = CLIENT4 if dst.version == 4 else CLIENT6
    return frames.ethernet(frames.ip_packet(src, dst, proto, l4), dst.version)


@pytest.mark.parametrize(
    ("desc", "proto", "l4"),
    [
        ("TCP 19 bytes", TCP, frames.l4_header(TCP, 1, 80)[:19]),
        ("TCP empty", TCP, b""),
        ("TCP doff 4", TCP, frames.l4_header(TCP, 1, 80)[:12] + b"\x40" + bytes(7)),
        ("TCP doff 0", TCP, frames.l4_header(TCP, 1, 80)[:12] + b"\x00" + bytes(7)),
        ("TCP doff 6, 20 bytes", TCP, frames.l4_header(TCP, 1, 80)[:12] + b"\x60" + bytes(7)),
        ("UDP 7 bytes", UDP, frames.l4_header(UDP, 1, 53)[:7]),
    ],
)
@pytest.mark.parametrize("dst", [VIP4, VIP6])
def test_truncated_l4_to_a_vip_address_drops(
    desc: str, proto: int, l4: bytes, dst: IPAddress
) -> None:
    d = m.decide(S, with_l4(dst, proto, l4))
    assert (d.outcome, d.drop) == (m.Outcome.DROP, abi.DropReason.MALFORMED_L4), desc
    d = m.decide(S, with_l4(OTHER4, proto, l4))
    assert d.events == (abi.Event.PASS_NOT_VIP,), desc


def test_tcp_options_that_fit_are_fine() -> None:
    tcp = bytearray(frames.l4_header(TCP, 40000, 80) + b"\x01\x01\x01\x01")
    tcp[12] = 6 << 4
    assert m.decide(S, with_l4(VIP4, TCP, bytes(tcp))).outcome is m.Outcome.FORWARD


def test_l4_header_in_padding_is_truncated() -> None:
    """The L4 header must be inside the IP packet; bytes past tot_len are padding."""
    fr = bytearray(frames.frame(flow()))
    fr[16:18] = (20 + 10).to_bytes(2, "big")  # IP says 10 bytes of TCP, frame has 20
    assert m.decide(S, bytes(fr)).drop is abi.DropReason.MALFORMED_L4


def test_udp_length_field_is_not_checked() -> None:
    fr = bytearray(frames.frame(flow(dport=5000, proto=UDP)))
    fr[38:40] = (3).to_bytes(2, "big")
    assert m.decide(S, bytes(fr)).outcome is m.Outcome.FORWARD


# --- 6. VIP lookup ------------------------------------------------------------------------


def test_exact_port_beats_wildcard() -> None:
    assert m.decide(S, frames.frame(flow(dport=53, proto=UDP))).vip == Vip(VIP4, 53, UDP)
    assert m.decide(S, frames.frame(flow(dport=54, proto=UDP))).vip == Vip(VIP4, 0, UDP)


def test_wildcard_is_per_protocol() -> None:
    assert m.decide(S, frames.frame(flow(dport=81))).events == (abi.Event.PASS_NOT_VIP,)


def test_other_address_passes() -> None:
    assert m.decide(S, frames.frame(flow(OTHER4))).events == (abi.Event.PASS_NOT_VIP,)


def test_family_is_part_of_the_key() -> None:
    """An IPv6 address whose first 4 bytes equal an IPv4 VIP's is not that VIP."""
    v6 = V6(VIP4.packed + bytes(12))
    assert m.decide(S, frames.frame(flow(v6))).events == (abi.Event.PASS_NOT_VIP,)


# --- 7. Flow key ----------------------------------------------------------------------------


@pytest.mark.parametrize("f", [flow(), flow(VIP6, 443), flow(dport=53, proto=UDP)])
def test_flow_key_is_the_c_struct(f: m.Flow) -> None:
    assert f.key() == abi.FlowKey.make(f.src, f.dst, f.sport, f.dport, f.proto).pack()


def test_src_hash_key_keeps_only_the_source() -> None:
    f = flow(VIP6, 443)
    assert f.hash_key(src_only=True) == abi.FlowKey.make(f.src, V6(0), 0, 0, 0).pack()


# --- 8. Connection table ------------------------------------------------------------------


def ack(f: m.Flow) -> bytes:
    """A packet of an open connection: TCP without SYN (a SYN skips the connection table)."""
    return frames.frame(f, tcp_flags=0x10)


def test_conn_hit_uses_stored_backend_and_hash() -> None:
    f = flow()
    s = state(conns={f.key(): ConnEntry(3, 0x1234_5678)})
    d = m.decide(s, ack(f))
    assert d.outcome is m.Outcome.FORWARD
    assert d.events == (abi.Event.CONN_HIT,)
    assert (d.backend_id, d.flow_hash, d.gue_sport) == (3, 0x1234_5678, 0x8000 | 0x5678)
    assert d.conn_insert is None and not d.new_flow
    assert d.stats_bytes == 40


def test_conn_hit_needs_no_table() -> None:
    f = flow(VIP4_NOTABLE)
    s = state(conns={f.key(): ConnEntry(2, 7)})
    assert m.decide(s, ack(f)).backend_id == 2


def test_a_syn_follows_the_table_whatever_the_connection_table_says() -> None:
    """A reused 5-tuple is a new connection: it must not reach a backend that left."""
    f = flow()
    s = state(conns={f.key(): ConnEntry(5, 7)})
    d = m.decide(s, frames.frame(f))
    assert d.events == (abi.Event.CONN_MISS, abi.Event.CONN_INSERT)
    assert d.backend_id == table_choice(f, [1, 2, 3]) != 5
    assert d.conn_insert == (
        f.key(),
        ConnEntry(d.backend_id, expected_hash(f), state=abi.SessState.TCP_SYN),
    )


@pytest.mark.parametrize(
    "desc,entry",
    [
        ("never a slot", ConnEntry(0, 7)),
        ("an empty slot", ConnEntry(99, 7)),
        ("beyond the slots", ConnEntry(abi.MAX_BACKENDS, 7)),
        ("the slot was given to another address", ConnEntry(1, 7, be_gen=1)),
    ],
)
def test_conn_to_a_slot_that_is_not_its_backend_is_stale(desc: str, entry: ConnEntry) -> None:
    f = flow()
    d = m.decide(state(conns={f.key(): entry}), ack(f))
    assert d.events == (abi.Event.CONN_STALE, abi.Event.CONN_MISS, abi.Event.CONN_INSERT), desc
    assert d.backend_id == table_choice(f, [1, 2, 3])
    assert d.conn_insert == (
        f.key(),
        ConnEntry(d.backend_id, expected_hash(f), state=abi.SessState.TCP_EST),
    )


def test_tcp_keeps_a_backend_that_left_its_vip() -> None:
    """Established connections keep going where they started (slot 5 is inactive: its
    address is in no table any more, but the slot still holds it)."""
    f = flow()
    d = m.decide(state(conns={f.key(): ConnEntry(5, 7)}), ack(f))
    assert (d.events, d.backend_id) == ((abi.Event.CONN_HIT,), 5)


def test_stale_then_no_table_drops_with_both_counted() -> None:
    f = flow(VIP4_NOTABLE)
    d = m.decide(state(conns={f.key(): ConnEntry(99, 7)}), ack(f))
    assert (d.drop, d.events) == (abi.DropReason.NO_TABLE, (abi.Event.CONN_STALE,))


MS = abi.MemberState

UDP_LIVENESS = [
    # (description, the backend's state in the UDP VIP, its session used?)
    ("ACTIVE: in the table", MS.ACTIVE, True),
    ("DRAINING keeps its flows until they go idle", MS.DRAINING, True),
    ("DOWN: its flows re-hash at once", MS.DOWN, False),
    ("NONE: it left the VIP", MS.NONE, False),
]


@pytest.mark.parametrize("desc,member,used", UDP_LIVENESS, ids=[c[0] for c in UDP_LIVENESS])
def test_a_udp_session_lives_while_its_backend_serves_its_vip(
    desc: str, member: abi.MemberState, used: bool
) -> None:
    # VIP 2 (UDP wildcard) has table [2, 3]; the session names backend 1, which the table
    # no longer names: whether it is used depends on lb_members alone, so on nothing any
    # other VIP (VIP 1 has backend 1 in its table) says.
    f = flow(dport=5000, proto=UDP)
    members = {2: {1: member}} if member else {}
    d = m.decide(state(conns={f.key(): ConnEntry(1, 7)}, members=members), frames.frame(f))
    if used:
        assert (d.events, d.backend_id) == ((abi.Event.CONN_HIT,), 1), desc
    else:
        assert d.events == (abi.Event.CONN_STALE, abi.Event.CONN_MISS, abi.Event.CONN_INSERT)
        assert d.backend_id in (2, 3), desc


def test_a_tcp_session_ignores_member_states() -> None:
    f = flow()
    d = m.decide(state(conns={f.key(): ConnEntry(1, 7)}, members={1: {1: MS.DOWN}}), ack(f))
    assert (d.events, d.backend_id) == ((abi.Event.CONN_HIT,), 1)


def test_a_session_of_another_generation_is_a_miss() -> None:
    f = flow()
    cfg = LbConfig(SRC4, SRC6, seed=CONFIG.seed, conn_gen=3)
    d = m.decide(state(config=cfg, conns={f.key(): ConnEntry(5, 7, gen=2)}), ack(f))
    assert d.events == (abi.Event.CONN_GEN_MISS, abi.Event.CONN_MISS, abi.Event.CONN_INSERT)
    assert d.conn_insert is not None and d.conn_insert[1].gen == 3


@pytest.mark.parametrize("st", list(abi.SessState))
def test_a_session_expires_after_its_states_timeout(st: abi.SessState) -> None:
    f = flow() if st is not abi.SessState.UDP else flow(dport=53, proto=UDP)
    timeouts = (100, 200, 300, 400)
    cfg = LbConfig(SRC4, SRC6, seed=CONFIG.seed, conn_timeouts=timeouts)
    members = {3: {3: MS.ACTIVE}}
    entry = ConnEntry(3, 7, state=st, last_seen=1000)
    pkt = ack(f) if f.proto == TCP else frames.frame(f)
    within = state(config=cfg, conns={f.key(): entry}, members=members, now=1000 + timeouts[st])
    assert m.decide(within, pkt).events == (abi.Event.CONN_HIT,)
    past = replace(within, now=1000 + timeouts[st] + 1)
    assert m.decide(past, pkt).events[0] is abi.Event.CONN_EXPIRED


def test_apply_makes_the_next_packet_a_hit() -> None:
    f = flow()
    first = m.decide(S, frames.frame(f))
    s1 = m.apply(S, first)
    assert s1.conns[f.key()].state is abi.SessState.TCP_SYN
    second = m.decide(s1, ack(f))
    assert second.events == (abi.Event.CONN_HIT,)
    assert (second.backend_id, second.gue_sport) == (first.backend_id, first.gue_sport)
    # The ACK moves the SYN's session on (lb_sess_set_state); nothing else is written.
    assert second.conn_insert is None and second.conn_update is not None
    s2 = m.apply(s1, second)
    assert s2.conns[f.key()] == ConnEntry(
        first.backend_id, first.flow_hash, state=abi.SessState.TCP_EST
    )
    third = m.decide(s2, ack(f))
    assert third.conn_update is None and m.apply(s2, third) is s2


@pytest.mark.parametrize(
    ("before", "flags", "after"),
    [
        (abi.SessState.TCP_SYN, 0x10, abi.SessState.TCP_EST),  # ACK
        (abi.SessState.TCP_SYN, 0x12, abi.SessState.TCP_EST),  # SYN-ACK: not a SYN
        (abi.SessState.TCP_EST, 0x11, abi.SessState.TCP_FIN),  # FIN
        (abi.SessState.TCP_SYN, 0x04, abi.SessState.TCP_FIN),  # RST
        (abi.SessState.TCP_FIN, 0x10, abi.SessState.TCP_FIN),  # closing stays closing
        (abi.SessState.TCP_EST, 0x18, abi.SessState.TCP_EST),  # PSH-ACK
    ],
)
def test_a_hit_moves_the_tcp_state(before: abi.SessState, flags: int, after: abi.SessState) -> None:
    """lb_conn_lookup with touch: FIN or RST closes a session, anything else moves a SYN's
    on to established; the update is reported only when something changes."""
    f = flow()
    s = state(conns={f.key(): ConnEntry(3, 7, state=before)})
    d = m.decide(s, frames.frame(f, tcp_flags=flags))
    assert d.events == (abi.Event.CONN_HIT,)
    if after is before:
        assert d.conn_update is None
    else:
        assert d.conn_update == (f.key(), ConnEntry(3, 7, state=after))


def test_a_hit_refreshes_last_seen_when_the_model_has_a_clock() -> None:
    f = flow(VIP4, 53, UDP)
    conns = {f.key(): ConnEntry(1, 7, state=abi.SessState.UDP, last_seen=100)}
    s = state(conns=conns, now=130, members={3: {1: abi.MemberState.ACTIVE}})
    d = m.decide(s, frames.frame(f))
    assert d.events == (abi.Event.CONN_HIT,)
    assert d.conn_update == (f.key(), ConnEntry(1, 7, last_seen=130))
    assert m.decide(dataclasses.replace(s, now=100), frames.frame(f)).conn_update is None


# --- 9. Table --------------------------------------------------------------------------------


@given(sport=st.integers(0, 65535), last=st.integers(1, 254))
def test_table_bucket_is_hash_mod_size(sport: int, last: int) -> None:
    f = m.Flow(V4(f"198.19.3.{last}"), VIP4, sport, 80, TCP)
    d = m.decide(S, frames.frame(f))
    h = expected_hash(f)
    assert (d.flow_hash, d.bucket, d.backend_id) == (h, h % SIZE, [1, 2, 3][h % SIZE % 3])
    assert d.events == (abi.Event.CONN_MISS, abi.Event.CONN_INSERT)
    assert d.conn_insert == (f.key(), ConnEntry(h % SIZE % 3 + 1, h, state=abi.SessState.TCP_SYN))


def test_source_hash_ignores_ports_but_conn_key_does_not() -> None:
    a = m.decide(S, frames.frame(flow(VIP6, 443, sport=1000)))
    b = m.decide(S, frames.frame(flow(VIP6, 443, sport=2000)))
    assert a.flow_hash == b.flow_hash == expected_hash(flow(VIP6, 443), src_only=True)
    assert a.conn_insert is not None and b.conn_insert is not None
    assert a.conn_insert[0] != b.conn_insert[0]


def test_no_table_drops() -> None:
    d = m.decide(S, frames.frame(flow(VIP4_NOTABLE)))
    assert (d.outcome, d.drop, d.events) == (m.Outcome.DROP, abi.DropReason.NO_TABLE, ())
    assert d.stats_bytes is None and d.conn_insert is None


@pytest.mark.parametrize(
    ("desc", "table", "size"),
    [
        ("hop 0 is zero", LookupTable(cycle([0])), SIZE),
        ("backend inactive", LookupTable(cycle([5])), SIZE),
        ("backend slot empty", LookupTable(cycle([77])), SIZE),
        ("backend id out of range", LookupTable(cycle([abi.MAX_BACKENDS])), SIZE),
        ("bucket beyond the inner map", LookupTable(cycle([1], 1)), 65537),
    ],
)
def test_no_backend_drops(desc: str, table: LookupTable, size: int) -> None:
    f = flow()
    if desc.startswith("bucket"):
        assert expected_hash(f) % size >= 1
    vips = {**VIPS, Vip(VIP4, 80, TCP): VipParams(1, table_size=size)}
    d = m.decide(state(vips=vips, tables={**TABLES, 1: table}), frames.frame(f))
    assert (d.outcome, d.drop, d.events) == (m.Outcome.DROP, abi.DropReason.NO_BACKEND, ()), desc
    assert d.conn_insert is None


def test_zero_table_size_is_no_table() -> None:
    vips = {**VIPS, Vip(VIP4, 80, TCP): VipParams(1, table_size=0)}
    assert m.decide(state(vips=vips), frames.frame(flow())).drop is abi.DropReason.NO_TABLE


@pytest.mark.parametrize(
    ("desc", "second"),
    [("inactive", 5), ("empty slot", 77), ("other family", 4), ("out of range", 1 << 20)],
)
def test_beamer_leaves_out_an_unusable_second_hop(desc: str, second: int) -> None:
    tables = {**TABLES, 6: LookupTable(cycle([1]), cycle([second]))}
    d = m.decide(state(tables=tables), frames.frame(flow(VIP4_BEAMER)))
    assert (d.outcome, d.hops) == (m.Outcome.FORWARD, (1,)), desc


def test_beamer_conn_hit_has_the_sessions_hops() -> None:
    f = flow(VIP4_BEAMER)
    d = m.decide(state(conns={f.key(): ConnEntry(1, 5)}), ack(f))
    assert d.hops == (1,)
    d = m.decide(state(conns={f.key(): ConnEntry(1, 5, later=(2, 5, 3))}), ack(f))
    assert d.hops == (1, 2, 3), "an inactive later hop (5) is left out, as from a bucket"


def test_maglev_ignores_second_hops() -> None:
    tables = {**TABLES, 1: LookupTable(cycle([1, 2, 3]), cycle([2]))}
    assert m.decide(state(tables=tables), frames.frame(flow())).hops == (
        table_choice(flow(), [1, 2, 3]),
    )


def test_beamer_writes_both_hops() -> None:
    # Table 6: first hop 1 everywhere, second hop 2 on even buckets, none on odd ones.
    for sport in range(40000, 40040):
        f = flow(VIP4_BEAMER, sport=sport)
        d = m.decide(S, frames.frame(f))
        assert d.bucket is not None and d.flow_hash is not None
        want = (1, 2) if d.bucket % 2 == 0 else (1,)
        assert d.hops == want
        # A SYN starts at the first hop: its session keeps that hop only.
        assert d.conn_insert == (
            f.key(),
            ConnEntry(1, d.flow_hash, state=abi.SessState.TCP_SYN),
        )
        # Met mid-connection, the flow may be any hop's: its session keeps them all.
        mid = m.decide(S, ack(f))
        assert mid.hops == want
        assert mid.conn_insert == (
            f.key(),
            ConnEntry(1, d.flow_hash, later=want[1:], state=abi.SessState.TCP_EST),
        )
        assert m.decide(m.apply(S, mid), ack(f)).hops == want, "a hit carries the hops"


@pytest.mark.parametrize(
    ("rest", "want"),
    [
        ([2, 3, 6], (1, 2, 3, 6)),
        ([6, 0, 2], (1, 6, 2)),  # a 0 in the middle is skipped
        ([5, 4, 3], (1, 3)),  # inactive and other-family hops are skipped
        ([0, 0, 0], (1,)),
        ([77, 2, 2], (1, 2, 2)),  # the data path does not deduplicate: the table does
    ],
)
def test_beamer_hop_list_is_the_usable_later_hops_in_order(
    rest: list[int], want: tuple[int, ...]
) -> None:
    backends = {**BACKENDS, 6: BackendState(V4("198.18.0.16"))}
    table = LookupTable(cycle([1]), np.tile(np.array(rest, dtype=np.uint32), (SIZE, 1)))
    st_ = state(backends=backends, tables={**TABLES, 6: table})
    d = m.decide(st_, frames.frame(flow(VIP4_BEAMER)))
    assert (d.outcome, d.hops) == (m.Outcome.FORWARD, want)
    assert d.packet is not None
    _, _, gue, _ = split_gue(d.packet, 4)
    addrs = b"".join(backends[h].addr.packed for h in want)
    assert gue == bytes([1 + len(want), 4, 0, 0, 0, 0, 0, len(want)]) + addrs


# --- 10./11. Stats and encapsulation ------------------------------------------------------------


def split_gue(pkt: bytes, outer_v: int) -> tuple[bytes, bytes, bytes, bytes]:
    """outer IP, UDP, GUE (header + private data), inner."""
    oh = 20 if outer_v == 4 else 40
    gue_len = 4 + 4 * pkt[oh + 8]
    return pkt[:oh], pkt[oh : oh + 8], pkt[oh + 8 : oh + 8 + gue_len], pkt[oh + 8 + gue_len :]


def test_gue_over_ipv4() -> None:
    f = flow()
    fr = frames.frame(f, b"hello", tos=0xB8)
    d = m.decide(S, fr)
    assert d.packet is not None and d.flow_hash is not None
    ip, udp, gue, inner = split_gue(d.packet, 4)
    assert inner == fr[14:]
    be = BACKENDS[table_choice(f, [1, 2, 3])].addr
    total = 20 + 8 + 8 + 4 + len(inner)
    assert ip == struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0xB8, total, 0, 0x4000, 64, 17,
        ipv4_checksum(ip[:10] + b"\0\0" + ip[12:]), SRC4.packed, be.packed,
    )  # fmt: skip
    assert ipv4_checksum(ip) == 0  # a header with its checksum sums to 0xffff
    assert udp == struct.pack(
        "!HHHH", 0x8000 | (d.flow_hash & 0x7FFF), abi.GUE_PORT, 8 + 12 + len(inner), 0
    )
    assert gue == bytes([2, 4, 0, 0, 0, 0, 0, 1]) + be.packed
    assert d.gue_sport == 0x8000 | (d.flow_hash & 0x7FFF)
    assert d.stats_bytes == len(inner)


def test_gue_over_ipv6_with_ipv6_inner() -> None:
    f = flow(VIP6, 443)
    fr = frames.frame(f, tos=0x2E)
    d = m.decide(S, fr)
    assert d.packet is not None and d.backend_id == 4
    ip, udp, gue, inner = split_gue(d.packet, 6)
    assert inner == fr[14:]
    plen = 8 + 4 + 4 + 16 + len(inner)
    assert ip == struct.pack(
        "!IHBB16s16s", (6 << 28) | (0x2E << 20), plen, 17, 64, SRC6.packed, BACKENDS[4].addr.packed
    )
    assert gue == bytes([1 + 4, 41, 0, 0, 0, 0, 0, 1]) + BACKENDS[4].addr.packed
    assert udp[4:6] == (plen).to_bytes(2, "big")


def test_outer_family_is_the_backends() -> None:
    """IPv4 inner over an IPv6 backend: GUE byte 1 names the inner family."""
    tables = {**TABLES, 1: LookupTable(cycle([4]))}
    d = m.decide(state(tables=tables), frames.frame(flow()))
    assert d.packet is not None
    ip, _udp, gue, inner = split_gue(d.packet, 6)
    assert ip[0] >> 4 == 6 and gue[1] == 4 and inner[0] >> 4 == 4


def test_ipip() -> None:
    f = flow(dport=53, proto=UDP)
    fr = frames.frame(f, b"q")
    d = m.decide(S, fr)
    assert d.packet is not None and d.backend_id == 3
    assert d.packet[9] == 4  # IPPROTO_IPIP
    assert d.packet[20:] == fr[14:]
    assert int.from_bytes(d.packet[2:4], "big") == 20 + len(fr) - 14
    assert d.gue_sport is not None  # the hash still exists, only no UDP header carries it


def test_ipip_6in4_protocol() -> None:
    vips = {**VIPS, Vip(VIP6, 443, TCP): VipParams(4, table_size=SIZE, encap=abi.Encap.IPIP)}
    tables = {**TABLES, 4: LookupTable(cycle([1]))}
    d = m.decide(state(vips=vips, tables=tables), frames.frame(flow(VIP6, 443)))
    assert d.packet is not None and d.packet[0] == 0x45 and d.packet[9] == 41


def test_beamer_hop_list() -> None:
    for sport in range(40000, 40040):
        d = m.decide(S, frames.frame(flow(VIP4_BEAMER, sport=sport)))
        if d.hops == (1, 2):
            break
    assert d.packet is not None
    _ip, udp, gue, _inner = split_gue(d.packet, 4)
    addrs = BACKENDS[1].addr.packed + BACKENDS[2].addr.packed
    assert gue == bytes([3, 4, 0, 0, 0, 0, 0, 2]) + addrs
    assert int.from_bytes(udp[4:6], "big") == 8 + 4 + 4 + 8 + 40


@pytest.mark.parametrize("missing", ["src4", "src6"])
def test_no_outer_source_drops_after_choosing(missing: str) -> None:
    cfg = LbConfig(
        None if missing == "src4" else SRC4, None if missing == "src6" else SRC6, seed=CONFIG.seed
    )
    f = flow() if missing == "src4" else flow(VIP6, 443)
    d = m.decide(state(config=cfg), frames.frame(f))
    assert (d.outcome, d.drop) == (m.Outcome.DROP, abi.DropReason.NO_CONFIG)
    # Stats and the connection entry moved before the encapsulation failed (step 10).
    assert d.events == (abi.Event.CONN_MISS, abi.Event.CONN_INSERT)
    assert d.conn_insert is not None and d.stats_bytes == 40 + (20 if f.dst.version == 6 else 0)
    assert d.packet is None


def test_zero_address_is_no_config() -> None:
    cfg = LbConfig(V4(0), SRC6, seed=CONFIG.seed)
    assert m.decide(state(config=cfg), frames.frame(flow())).drop is abi.DropReason.NO_CONFIG


def test_scapy_reads_the_outer_packet() -> None:
    """An independent parser agrees on lengths and the checksum."""
    from scapy.layers.inet import IP
    from scapy.layers.inet import UDP as SUDP

    d = m.decide(S, frames.frame(flow(), b"x" * 33))
    assert d.packet is not None
    pkt = IP(d.packet)
    assert pkt.len == len(d.packet) and pkt.flags == "DF" and pkt.ttl == 64
    assert pkt[SUDP].len == len(d.packet) - 20 and pkt[SUDP].dport == abi.GUE_PORT
    fresh = pkt.copy()
    del fresh.chksum  # scapy recomputes it on build
    assert IP(bytes(fresh)).chksum == pkt.chksum


# --- Decision helpers, predict_backend, predict_many ------------------------------------------


def test_allows() -> None:
    fwd = m.decide(S, frames.frame(flow()))
    assert fwd.allows(m.XdpAction.TX) and fwd.allows(m.XdpAction.REDIRECT)
    assert not fwd.allows(m.XdpAction.ABORTED)
    passed = m.decide(S, frames.frame(flow(OTHER4)))
    assert passed.allows(m.XdpAction.PASS) and not passed.allows(m.XdpAction.TX)
    assert "backend=" in fwd.describe()


def test_config_abi_value_is_network_order() -> None:
    raw = CONFIG.abi_value().pack()
    assert raw[:4] == SRC4.packed and raw[4:20] == SRC6.packed
    assert raw[20:22] == abi.GUE_PORT.to_bytes(2, "big")
    assert int.from_bytes(raw[24:28], "little") == CONFIG.seed


def test_lookup_table_buckets_layout() -> None:
    t = LookupTable(np.array([1, 2], dtype=np.uint32), np.array([0, 3], dtype=np.uint32))
    assert t.buckets() == struct.pack("<8I", 1, 0, 0, 0, 2, 3, 0, 0)
    assert t.rest is not None and t.rest.shape == (2, abi.MAX_HOPS - 1)
    assert t.hops(0) == (1,) and t.hops(1) == (2, 3)
    full = LookupTable(np.array([1], dtype=np.uint32), np.array([[4, 0, 6]], dtype=np.uint32))
    assert full.buckets() == struct.pack("<4I", 1, 4, 0, 6)
    assert full.hop_ids() == {1, 4, 6} and full.hops(0) == (1, 4, 6)
    assert LookupTable.from_buckets(np.array([[1, 4, 0, 6]], dtype=np.uint32)) == full
    # No later hop anywhere is no later hops at all: equal to a table without them.
    assert LookupTable(np.array([1]), np.zeros((1, 3), np.uint32)) == LookupTable(np.array([1]))
    with pytest.raises(ValueError, match="later hops"):
        LookupTable(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError, match="later hops"):
        LookupTable(np.array([1]), np.array([[1, 2, 3, 4]]))


def test_lookup_table_contents_per_kind() -> None:
    maglev = LookupTable(np.array([1, 2, 3], dtype=np.uint32))
    beamer = LookupTable(np.array([1, 2], dtype=np.uint32), np.array([0, 3], dtype=np.uint32))
    # Maglev (lb_tables): one __u32 per bucket; Beamer (lb_btables): struct xdplb_bucket.
    assert maglev.first_hops() == struct.pack("<3I", 1, 2, 3)
    assert maglev.contents(abi.TableKind.MAGLEV) == maglev.first_hops()
    assert beamer.contents(abi.TableKind.BEAMER) == beamer.buckets()
    assert maglev.contents(abi.TableKind.BEAMER) == struct.pack(
        "<12I", 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0
    )
    for t, kind in (
        (maglev, abi.TableKind.MAGLEV),
        (maglev, abi.TableKind.BEAMER),
        (beamer, abi.TableKind.BEAMER),
    ):
        assert LookupTable.from_contents(kind, t.contents(kind)) == t
    with pytest.raises(ValueError, match="no later hops"):
        beamer.contents(abi.TableKind.MAGLEV)


def test_predict_backend_matches_decide() -> None:
    for f in [flow(), flow(VIP6, 443), flow(dport=9, proto=UDP), flow(OTHER4), flow(VIP4_NOTABLE)]:
        d = m.decide(S, frames.frame(f))
        want = d.backend_id if d.outcome is m.Outcome.FORWARD else None
        assert m.predict_backend(S, f) == want


SRCS: dict[int, list[IPAddress]] = {
    4: [CLIENT4, V4("198.19.200.1")],
    6: [CLIENT6, V6("fd78:6470:6c62:2::99")],
}


@st.composite
def flows_strategy(draw: st.DrawFn) -> m.Flow:
    dsts: list[IPAddress] = [VIP4, VIP4_NOTABLE, VIP4_BEAMER, OTHER4, VIP6]
    dst = draw(st.sampled_from(dsts))
    return m.Flow(
        draw(st.sampled_from(SRCS[dst.version])),
        dst,
        draw(st.integers(0, 65535)),
        draw(st.sampled_from([0, 53, 80, 443, 9999])),
        draw(st.sampled_from([TCP, UDP])),
    )


@settings(max_examples=60, deadline=None)
@given(flows=st.lists(flows_strategy(), max_size=60), with_conns=st.booleans())
def test_predict_many_matches_predict_backend(flows: list[m.Flow], with_conns: bool) -> None:
    s = S
    if with_conns and flows:
        s = state(conns={flows[0].key(): ConnEntry(2, 99), flows[-1].key(): ConnEntry(5, 1)})
    got = m.predict_many(s, flows)
    for i, f in enumerate(flows):
        want = m.predict_backend(s, f)
        assert int(got.backend[i]) == (want or 0), f
        if want is not None:
            d = m.decide(s, ack(f))
            assert int(got.flow_hash[i]) == d.flow_hash
            assert int(got.gue_sport[i]) == d.gue_sport


def test_predict_many_at_scale() -> None:
    rng = np.random.default_rng(7)
    n = 20000
    src = np.zeros((n, 4), dtype=np.uint32)
    src[:, 0] = rng.integers(0, 2**32, n, dtype=np.uint32)
    dst = np.zeros((n, 4), dtype=np.uint32)
    dst[:, 0] = abi.addr_words(VIP4)[0]
    batch = m.FlowBatch(
        src,
        dst,
        rng.integers(0, 65536, n).astype(np.uint16),
        np.full(n, 80, dtype=np.uint16),
        np.full(n, TCP, dtype=np.uint8),
        np.full(n, 4, dtype=np.uint8),
    )
    got = m.predict_many(S, batch)
    assert set(np.unique(got.backend).tolist()) == {1, 2, 3}
    for i in range(0, n, 997):
        f = m.Flow(V4(int(src[i, 0]).to_bytes(4, "little")), VIP4, int(batch.sport[i]), 80, TCP)
        assert int(got.backend[i]) == m.predict_backend(S, f)


def test_an_incremental_checksum_is_never_0x0000() -> None:
    """lb_icmp.h's csum_replace16: the echo reply to an all-zero request (type 8 -> 0,
    checksum 0xf7ff) sums all-zero data, whose checksum is 0xffff; 0x0000 is rejected."""
    assert csum_replace16(0xF7FF, 0x0800, 0x0000) == 0xFFFF
    assert csum_replace16(0xF7FE, 0x0800, 0x0000) == 0xFFFE  # other results unchanged
    words = (0x0000, 0xFFFF, 0x0000, 0x0000)  # the reply: sums to all ones, verifies
    assert sum(words) & 0xFFFF == 0xFFFF
