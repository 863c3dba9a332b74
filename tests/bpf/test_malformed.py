"""lb_xdp on >= 100,000 malformed, truncated and mangled frames, against the model.

Two properties, both from docs/datapath.md:
- a malformed packet is never sent on: every frame the program returns with
  XDP_TX / XDP_REDIRECT (or passes encapsulated) is one the model also forwards,
  byte for byte, and its inner packet is structurally valid by the contract's
  rules (checked here by an independent parser, not by the model's);
- every drop is counted under a named reason: the lb_drops deltas sum to the
  drops observed, and equal the model's count reason by reason (and lb_events
  equals the model's count event by event).

The corpus is deterministic (fixed seeds): truncation at every offset of valid
VIP frames, truncation with consistent length fields, every IPv4 IHL, sweeps of
tot_len / IPv6 payload_len / TCP data offset / UDP length, every IP version under
each EtherType, fragments, random frames, random byte mutations of valid frames,
and 802.1Q / 802.1ad / double-tagged variants of a share of all of it.
"""

from __future__ import annotations

import ipaddress
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from lb_harness import FrameRefused
from test_differential import (  # the harness and lab of the differential test
    ModelLb,
    check_forward,
    drop_deltas,
    event_deltas,
    make_state,
    mlb,
    random_flows,
    read_stats,
    record,
    stats_deltas,
    stats_diff,
)

from xdplb import model
from xdplb.core import abi
from xdplb.core.state import ConnEntry
from xdplb.model import frames

pytestmark = pytest.mark.bpf

__all__ = ["mlb"]  # the fixture, re-exported so that pytest finds it here

CORPUS_SEED = 0xBAD5EED
MIN_CORPUS = 100_000
#: The connection table is emptied (here and in the model) every CHUNK frames, so that
#: no eviction (a set of the table holds CONN_WAYS flows) can make them disagree.
CHUNK = 2048

Frame = tuple[str, bytes]  # (category, frame)


# --- the corpus -------------------------------------------------------------------------------


def base_frames(state: model.DataplaneState) -> list[bytes]:
    """Valid frames to every VIP (and some to no VIP), small payloads of several sizes."""
    flows = random_flows(state, 72, CORPUS_SEED)
    others = [model.Flow(f.src, _other(f.dst), f.sport, f.dport, f.proto) for f in flows[:12]]
    out = []
    for i, f in enumerate(flows + others):
        payload = bytes(range(i % 5 * 7))
        out.append(frames.frame(f, payload, tos=i))
    return out


def _other(dst: abi.IPAddress) -> abi.IPAddress:
    """An address in the lab's ranges with no VIP on it."""
    if dst.version == 4:
        return ipaddress.IPv4Address("198.19.9.9")
    return ipaddress.IPv6Address("fd78:6470:6c62:9::9")


def l3(frame: bytes) -> int:
    return 18 if frame[12:14] in (b"\x81\x00", b"\x88\xa8") else 14


def with_len_fields(frame: bytes, ip_len: int) -> bytes:
    """Cut the IP packet to ip_len bytes and make its length field say so."""
    o = l3(frame)
    b = bytearray(frame[: o + ip_len])
    if b[o] >> 4 == 4:
        b[o + 2 : o + 4] = ip_len.to_bytes(2, "big")
    else:
        b[o + 4 : o + 6] = (ip_len - 40).to_bytes(2, "big")
    return bytes(b)


def patch(frame: bytes, off: int, data: bytes) -> bytes:
    return frame[:off] + data + frame[off + len(data) :]


def l4_off(frame: bytes) -> int:
    o = l3(frame)
    return o + ((frame[o] & 0xF) * 4 if frame[o] >> 4 == 4 else 40)


def corpus(state: model.DataplaneState) -> Iterator[Frame]:
    rng = np.random.default_rng(CORPUS_SEED)
    bases = base_frames(state)
    v4 = [b for b in bases if b[14] >> 4 == 4]
    v6 = [b for b in bases if b[14] >> 4 == 6]
    proto = {b: b[23] if b[14] >> 4 == 4 else b[20] for b in bases}

    for b in bases:
        # Truncation at every offset, length fields untouched.
        for n in range(14, len(b)):
            yield "truncated", b[:n]
        # Truncation at every offset of the IP packet, length fields consistent.
        ip_len = len(b) - 14
        min_hdr = 20 if b[14] >> 4 == 4 else 40
        for n in range(ip_len):
            yield "truncated+len", with_len_fields(b, n) if n >= min_hdr else b[: 14 + n]
        # Every IP version under this EtherType, and the other EtherType.
        for ver in range(16):
            yield "version", patch(b, 14, bytes([(ver << 4) | (b[14] & 0xF)]))
        other = b"\x86\xdd" if b[12:14] == b"\x08\x00" else b"\x08\x00"
        yield "ethertype", patch(b, 12, other)
        # Padding after the IP packet: fine, and not payload.
        yield "padding", b + bytes(int(rng.integers(1, 20)))

    for b in v4:
        for ihl in range(16):
            yield "ihl", patch(b, 14, bytes([0x40 | ihl]))
        for tot in range(0, len(b) - 14 + 9):
            yield "tot_len", patch(b, 16, tot.to_bytes(2, "big"))
        for tot in rng.integers(0, 65536, 40):
            yield "tot_len", patch(b, 16, int(tot).to_bytes(2, "big"))
        for frag in [0x2000, 0x0001, 0x1FFF, 0x2001, 0x4000, 0x8000, 0x6000, 0xA000]:
            yield "fragment", patch(b, 20, frag.to_bytes(2, "big"))
        for frag in rng.integers(0, 65536, 40):
            yield "fragment", patch(b, 20, int(frag).to_bytes(2, "big"))
    for b in v6:
        for plen in range(0, len(b) - 54 + 9):
            yield "payload_len", patch(b, 18, plen.to_bytes(2, "big"))
        for plen in rng.integers(0, 65536, 40):
            yield "payload_len", patch(b, 18, int(plen).to_bytes(2, "big"))
        for nh in [0, 43, 44, 58, 59, 60, 132, 136, 255]:
            yield "next_header", patch(b, 20, bytes([nh]))
    for b in bases:
        o4 = l4_off(b)
        if proto[b] == abi.IPPROTO_TCP:
            for doff in range(16):
                yield "doff", patch(b, o4 + 12, bytes([(doff << 4) | (b[o4 + 12] & 0xF)]))
            # Options that the packet does carry: doff 6..8 with the payload as options.
            yield "doff", patch(b, o4 + 12, b"\x60")
        else:
            for ulen in list(range(0, 40)) + [int(x) for x in rng.integers(0, 65536, 20)]:
                yield "udp_len", patch(b, o4 + 4, ulen.to_bytes(2, "big"))
        # Switch the protocol byte between TCP and UDP: header sizes change under it.
        if b[14] >> 4 == 4:
            yield "proto_swap", patch(b, 23, bytes([23 - proto[b]]))

    # Random frames: EtherType from a biased set, everything else random.
    ethertypes = [b"\x08\x00", b"\x86\xdd", b"\x81\x00", b"\x88\xa8", b"\x08\x06"]
    for _ in range(20_000):
        n = int(rng.integers(14, 160))
        raw = bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        if rng.random() < 0.8:
            raw[12:14] = ethertypes[int(rng.integers(len(ethertypes)))]
        if bytes(raw[12:14]) in (b"\x81\x00", b"\x88\xa8") and n >= 18 and rng.random() < 0.7:
            raw[16:18] = ethertypes[int(rng.integers(2))]
        yield "random", bytes(raw)

    # Valid headers up to the IP addresses, random after that (VIP destinations kept).
    for _ in range(10_000):
        b = bases[int(rng.integers(len(bases)))]
        keep = l4_off(b) + int(rng.integers(0, 4))
        tail = rng.integers(0, 256, len(b) - keep, dtype=np.uint8).tobytes()
        yield "random_l4", b[:keep] + tail

    # Random 1-4 byte mutations of valid frames, biased to the headers.
    for _ in range(40_000):
        mutant = bytearray(bases[int(rng.integers(len(bases)))])
        for _k in range(int(rng.integers(1, 5))):
            pos = int(rng.integers(12, min(len(mutant), 80)))
            mutant[pos] = int(rng.integers(0, 256))
        yield "mutated", bytes(mutant)


def tagged(frame: bytes, rng: np.random.Generator) -> Iterator[Frame]:
    """802.1Q, 802.1ad and double-tagged copies of a frame."""
    vid = int(rng.integers(1, 4095)).to_bytes(2, "big")
    yield "vlan", frame[:12] + b"\x81\x00" + vid + frame[12:]
    yield "qinq", frame[:12] + b"\x88\xa8" + vid + frame[12:]
    yield "double", frame[:12] + b"\x88\xa8" + vid + b"\x81\x00" + vid + frame[12:]


def full_corpus(state: model.DataplaneState) -> list[Frame]:
    rng = np.random.default_rng(CORPUS_SEED + 1)
    out: list[Frame] = []
    for cat, fr in corpus(state):
        out.append((cat, fr))
        if len(fr) >= 14 and rng.random() < 0.15:
            for tcat, tfr in tagged(fr, rng):
                out.append((f"{cat}+{tcat}", tfr))
    return out


# --- an independent structural check of what leaves ------------------------------------------


def inner_is_valid(out: bytes) -> str | None:
    """None if ``out`` (a whole output frame) carries a contract-valid inner packet."""
    ethertype = out[12:14]
    p = out[14:]
    if ethertype == b"\x08\x00":
        if p[0] != 0x45:
            return "outer IPv4 header is not version 4 / IHL 5"
        olen, onext, ohl = int.from_bytes(p[2:4], "big"), p[9], 20
    elif ethertype == b"\x86\xdd":
        if p[0] >> 4 != 6:
            return "outer IPv6 version"
        olen, onext, ohl = 40 + int.from_bytes(p[4:6], "big"), p[6], 40
    else:
        return f"outer EtherType {ethertype.hex()}"
    if onext == abi.IPPROTO_UDP:
        gue = ohl + 8
        inner_off = gue + 4 + 4 * (p[gue] & 0x1F)
        inner_family = p[gue + 1]
    else:
        inner_off, inner_family = ohl, onext
    inner = p[inner_off:]
    if inner_family == 4:
        if len(inner) < 20 or inner[0] >> 4 != 4 or inner[0] & 0xF < 5:
            return "inner IPv4 header"
        ihl = (inner[0] & 0xF) * 4
        ip_len = int.from_bytes(inner[2:4], "big")
        if not (ihl <= ip_len <= len(inner) and ihl <= len(inner)):
            return "inner IPv4 lengths"
        proto, l4, l4_len = inner[9], ihl, ip_len - ihl
        if int.from_bytes(inner[6:8], "big") & 0x3FFF:
            # Fragments are balanced by addresses: no L4 header to check.
            return None if proto in (abi.IPPROTO_TCP, abi.IPPROTO_UDP) else "inner fragment"
    elif inner_family == 41:
        if len(inner) < 40 or inner[0] >> 4 != 6:
            return "inner IPv6 header"
        ip_len = 40 + int.from_bytes(inner[4:6], "big")
        if ip_len > len(inner):
            return "inner IPv6 payload_len"
        proto, l4, l4_len = inner[6], 40, ip_len - 40
        for _ in range(abi.MAX_EXTHDRS):  # hop-by-hop, routing, destination options, fragment
            if proto not in (0, 43, 60, 44):
                break
            hlen = 8 if proto == 44 else (inner[l4 + 1] + 1) * 8
            if l4_len < 8 or hlen > l4_len:
                return "inner IPv6 extension header"
            frag = proto == 44 and int.from_bytes(inner[l4 + 2 : l4 + 4], "big") & 0xFFF9
            proto, l4, l4_len = inner[l4], l4 + hlen, l4_len - hlen
            if frag:
                ok = proto in (abi.IPPROTO_TCP, abi.IPPROTO_UDP)
                return None if ok else "inner fragment"
    else:
        return f"inner family {inner_family}"
    if olen != inner_off + ip_len:
        return f"outer length {olen} != {inner_off} + inner {ip_len}"
    if proto == abi.IPPROTO_TCP:
        if l4_len < 20 or not 5 <= inner[l4 + 12] >> 4 <= l4_len // 4:
            return "inner TCP header"
    elif proto == abi.IPPROTO_UDP:
        if l4_len < 8:
            return "inner UDP header"
    elif proto == (1 if inner_family == 4 else 58):
        if l4_len < 8 + (20 if inner_family == 4 else 40) + 4:
            return "inner ICMP error without a quote"
    else:
        return f"inner protocol {proto}"
    return None


# --- the run ------------------------------------------------------------------------------------


def clear_conns(mlb: ModelLb, conns: dict[bytes, ConnEntry]) -> None:
    mlb.table.wipe()  # between packets: no program runs on it
    conns.clear()


def test_malformed_corpus(mlb: ModelLb) -> None:
    t0 = time.perf_counter()
    conns: dict[bytes, ConnEntry] = {}
    state = replace(make_state(), conns=conns)
    mlb.load_state(state)
    frames = full_corpus(state)
    assert len(frames) >= MIN_CORPUS
    t_built = time.perf_counter()

    n_ev, n_dr = len(abi.Event), len(abi.DropReason)
    ev0, dr0 = mlb.counters("lb_events", n_ev), mlb.counters("lb_drops", n_dr)
    st0 = read_stats(mlb)
    decisions: list[model.Decision] = []
    problems: list[str] = []
    outcomes: Counter[tuple[str, str]] = Counter()
    observed_drops = 0
    refused = 0
    run = mlb.run
    decide = model.decide
    for i, (cat, fr) in enumerate(frames):
        if i % CHUNK == 0:
            clear_conns(mlb, conns)
        d = decide(state, fr)
        if len(fr) < 14:  # test_run refuses frames shorter than Ethernet (EINVAL)
            assert d.events == (abi.Event.PASS_NOT_IP,)
            continue
        try:
            r = run(fr)
        except FrameRefused:  # lb_tc: no skb test run carries it (the parse is lb_xdp's)
            assert d.outcome is model.Outcome.PASS, d.describe()
            refused += 1
            continue
        decisions.append(d)
        record(conns, d)
        observed_drops += r.retval == model.XdpAction.DROP
        outcomes[(cat.split("+")[0], model.XdpAction(r.retval).name)] += 1
        problem = check_forward(mlb, fr, d, r)
        if problem is None and r.retval in (model.XdpAction.TX, model.XdpAction.REDIRECT):
            problem = inner_is_valid(r.data)
        if problem is not None:
            problems.append(f"[{cat}] {problem}\n  frame {fr.hex()}")
    t_run = time.perf_counter()

    ev = mlb.counters("lb_events", n_ev) - ev0
    dr = mlb.counters("lb_drops", n_dr) - dr0
    summary = (
        f"{len(frames)} frames ({refused} no skb test run carries), built in "
        f"{t_built - t0:.1f} s, run in {t_run - t_built:.1f} s; "
        f"verdicts {dict(sorted(outcomes.items()))}"
    )
    print(summary)
    assert not problems, f"{len(problems)} mismatches; first ones:\n" + "\n".join(problems[:8])
    # Every drop is counted, under the reason the model gives.
    assert int(dr.sum()) == observed_drops
    want_dr = drop_deltas(decisions)
    assert dict(zip(abi.DropReason, dr.tolist(), strict=True)) == dict(
        zip(abi.DropReason, want_dr.tolist(), strict=True)
    )
    want_ev = event_deltas(decisions)
    assert dict(zip(abi.Event, ev.tolist(), strict=True)) == dict(
        zip(abi.Event, want_ev.tolist(), strict=True)
    )
    assert stats_diff(read_stats(mlb), st0) == stats_deltas(decisions)
    # The corpus reaches every parse-level outcome.
    for reason in (abi.DropReason.FRAGMENT, abi.DropReason.MALFORMED_L4):
        assert dr[reason] > 0, reason
    for event in (abi.Event.PASS_NOT_IP, abi.Event.PASS_MALFORMED, abi.Event.PASS_NOT_VIP):
        assert ev[event] > 0, event
