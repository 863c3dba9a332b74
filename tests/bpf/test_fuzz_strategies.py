"""The fuzz's frame strategies and their expansion (pure Python: no program runs)."""

from __future__ import annotations

import ipaddress
import struct

import fuzz_strategies as fs
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from test_differential import make_state

from xdplb import model
from xdplb.model import frames

pytestmark = pytest.mark.unit

STATE = make_state()
TARGETS = fs.Targets.of(STATE)


def _udp_frame() -> bytes:
    flow = model.Flow(
        ipaddress.IPv4Address("198.18.128.7"), ipaddress.IPv4Address("198.19.1.1"), 5000, 443, 17
    )
    return frames.frame(flow, b"payload!")


def test_expand_is_deterministic_and_complete() -> None:
    fr = _udp_frame()
    d = fs.Drawn(fr, 7)
    frames = list(fs.expand(d))
    assert frames == list(fs.expand(d))
    assert frames[0] == fr
    # Every cut, from a bare Ethernet header to one byte short.
    assert {fr[:n] for n in range(14, len(fr))} <= set(frames)
    # tot_len and the UDP length, each one off in both directions, and zero.
    for off in (16, 14 + 20 + 4):
        old = struct.unpack_from("!H", fr, off)[0]
        for v in (old - 1, old + 1, 0):
            assert fr[:off] + struct.pack("!H", v) + fr[off + 2 :] in frames
    # Every IHL.
    assert {fr[:14] + bytes([0x40 | i]) + fr[15:] for i in range(16)} - {fr} <= set(frames)
    assert len(set(frames)) > 100


def test_ipv6_extension_chain_links_up() -> None:
    """Each extension header names the next, the last names the L4 protocol, and the
    lengths add up to payload_len."""
    # Bodies after next-header (and length): 6, 7 (fragment: no length byte) and 6 bytes.
    chain = [(fs.HOPOPT, b"\x01\x04" + bytes(4)), (fs.FRAGMENT, bytes(7)), (fs.DSTOPTS, bytes(6))]
    src, dst = ipaddress.IPv6Address("fd78::1"), ipaddress.IPv6Address("fd78::2")
    pkt = fs.ipv6(src, dst, fs.TCP, b"t" * 20, chain)
    assert pkt[6] == fs.HOPOPT and struct.unpack_from("!H", pkt, 4)[0] == len(pkt) - 40
    assert pkt[40] == fs.FRAGMENT and pkt[48] == fs.DSTOPTS and pkt[56] == fs.TCP
    assert pkt[64:] == b"t" * 20


def test_drawn_frames_reach_every_layer() -> None:
    """300 draws (fixed seed) hold what the strategies promise: tags, IPv4 options and
    fragments, IPv6 extension headers, TCP options, ICMP errors quoting a packet, GUE and
    IPIP; and the model forwards some of them unmutated."""
    seen: set[str] = set()

    @seed(1234)
    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[Phase.generate],
    )
    @given(fs.drawn(TARGETS))
    def draw(d: fs.Drawn) -> None:
        fr = d.frame
        l3 = fs.l3_offset(fr)
        seen.add(f"tags{(l3 - 14) // 4}")
        decision = model.decide(STATE, fr)
        seen.add(decision.outcome.value)
        if len(fr) < l3 + 40:
            return
        if fr[l3] >> 4 == 4:
            ihl, proto = (fr[l3] & 0xF) * 4, fr[l3 + 9]
            seen.add("v4options" if ihl > 20 else "v4")
            if int.from_bytes(fr[l3 + 6 : l3 + 8], "big") & 0x3FFF:
                seen.add("v4fragment")
        elif fr[l3] >> 4 == 6:
            ihl, proto = 40, fr[l3 + 6]
            if proto in fs.EXT_HEADERS:
                seen.add("v6ext")
        else:
            return
        l4 = l3 + ihl
        if proto == fs.TCP and len(fr) > l4 + 13 and fr[l4 + 12] >> 4 > 5:
            seen.add("tcpoptions")
        if proto in (fs.ICMP, fs.ICMP6) and len(fr) > l4 + 8 and fr[l4] in (3, 11, 1, 2):
            seen.add("icmperror")
        if proto in (fs.IPIP, fs.IPV6):
            seen.add("ipip")
        if proto == fs.UDP and len(fr) > l4 + 4 and fr[l4 + 2 : l4 + 4] == b"\x17\xc0":
            seen.add("gue")  # to the state's GUE port, 6080

    draw()
    want = {"tags0", "tags1", "tags2", "v4", "v4options", "v4fragment", "v6ext", "tcpoptions"}
    want |= {"icmperror", "ipip", "gue", "forward", "pass", "drop"}
    assert want <= seen, want - seen
