"""Fuzzing the session-sync decoder (xdplb.sync.wire): over 100,000 frames, each a valid
message of a random kind bent by one of a dozen mutations, and a few thousand mutated
streams through ``read_frame``.

The properties: decoding either gives back a message whose encoding is the input frame
(version 1 has one encoding of each message), or raises :class:`Refused` with one of
``REASONS``, never any other exception; a frame is accepted only if its MAC was made with
the receiver's key over its bytes (only the mutations that make the MAC again may
decode); a frame under another key never is.

Each example draws one message with hypothesis, then runs ``MUTATIONS`` mutations of it
from a seeded ``random.Random``: hypothesis explores the messages, the mutations are
cheap and deterministic. Each test counts the frames it decoded and asserts the count, so
a change of settings cannot silently fuzz less.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import random
import string
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xdplb.core.addresses import IPAddress
from xdplb.sync import wire

pytestmark = pytest.mark.unit

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
EXAMPLES = 200
MUTATIONS = 500
STREAM_EXAMPLES = 150
STREAMS = 20
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NODE_CHARS = string.ascii_letters + string.digits + "._-"
H = wire.HEADER_SIZE
#: Offsets and widths of an entry's one-byte fields, and values worth writing there.
ENTRY_BYTES = {"op": 0, "state": 1, "proto": 2, "flags": 3, **{f"hop{i}": 40 + i for i in range(4)}}
#: A word of each check of entries' fields (what Refused("malformed") says).
ENTRY_RULES = (
    "op is not",
    "state is above",
    "protocol is not",
    "has flags set",
    "has no first hop",
    "hop after no hop",
    "not an index",
    "addresses (at most",
    "entries (1..",
    "SUBSCRIBE body",
)
INTERESTING = (0, 1, 2, 3, 4, 5, 6, 16, 17, 58, 127, 128, 253, 254, 255)


@dataclass
class Counter:
    """Frames decoded and streams read, and how each ended (a reason, or "ok")."""

    frames: int = 0
    streams: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    #: What the ``malformed`` refusals said.
    details: set[str] = field(default_factory=set)

    def note(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


COUNT = Counter()


# -- strategies: one valid message of each kind ----------------------------------------


def random_entries(rng: np.random.Generator, n: int, n_addrs: int) -> npt.NDArray[np.void]:
    e = np.zeros(n, dtype=wire.ENTRY_DTYPE)
    e["op"] = rng.integers(1, 5, n)
    e["state"] = rng.integers(0, 4, n)
    e["proto"] = rng.choice([6, 17], n)
    e["src"] = rng.integers(0, 256, (n, 16))
    e["dst"] = rng.integers(0, 256, (n, 16))
    e["sport"] = rng.integers(0, 65536, n)
    e["dport"] = rng.integers(0, 65536, n)
    hops = rng.integers(0, n_addrs, (n, 4))
    n_hops = rng.integers(1, 5, n)
    hops[np.arange(4) >= n_hops[:, None]] = wire.NO_HOP
    e["hops"] = hops
    e["hash"] = rng.integers(0, 2**32, n)
    e["age_ms"] = rng.choice([0, 1, 2**32 - 1, *rng.integers(0, 2**32, 5)], n)
    return e


def random_addr(rng: np.random.Generator) -> IPAddress:
    if rng.random() < 0.5:
        return ipaddress.IPv4Address(int(rng.integers(0, 2**32)))
    return ipaddress.IPv6Address(bytes(rng.integers(0, 256, 16, dtype=np.uint8)))


@st.composite
def entries_messages(draw: st.DrawFn) -> wire.Entries:
    n = draw(st.one_of(st.integers(1, 8), st.integers(1, wire.MAX_ENTRIES)))
    n_addrs = draw(st.one_of(st.integers(1, 4), st.integers(1, wire.MAX_ADDRS)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    addrs = tuple(random_addr(rng) for _ in range(n_addrs))
    return wire.Entries(addrs, random_entries(rng, n, n_addrs))


u64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
MESSAGES = st.one_of(
    st.builds(wire.Subscribe, st.booleans()),
    st.builds(wire.Begin, u64),
    entries_messages(),
    st.builds(wire.End, u64, st.binary(min_size=32, max_size=32)),
    st.just(wire.Keepalive()),
)
NODES = st.text(NODE_CHARS, min_size=1, max_size=16)


# -- mutations --------------------------------------------------------------------------


def remac(data: bytes | bytearray, key: bytes = KEY) -> bytes:
    """``data`` (header and body) with its MAC under ``key``."""
    return bytes(data) + hmac.new(key, bytes(data), hashlib.sha256).digest()


def header_of(frame: bytes) -> list[object]:
    return list(wire.HEADER.unpack(frame[:H]))


def rewrite(frame: bytes, index: int, value: object) -> bytes:
    """``frame`` with header field ``index`` set to ``value``, its MAC made again."""
    fields = header_of(frame)
    fields[index] = value
    return remac(wire.HEADER.pack(*fields) + frame[H:-32])


def with_body(frame: bytes, body: bytes) -> bytes:
    """``frame``'s header over ``body`` (``body_len`` set), its MAC made again."""
    fields = header_of(frame)
    fields[7] = len(body)
    return remac(wire.HEADER.pack(*fields) + body)


def random_node(r: random.Random) -> bytes:
    kind = r.randrange(5)
    if kind == 0:
        name = "".join(r.choice(NODE_CHARS) for _ in range(r.randint(1, 16)))
        return name.encode().ljust(16, b"\0")
    if kind == 1:
        return r.randbytes(16)
    if kind == 2:
        return bytes(16)
    if kind == 3:  # a NUL inside the name
        raw = bytearray(b"abcdefgh".ljust(16, b"\0"))
        raw[r.randrange(16)] = 0
        raw[r.randrange(8, 16)] = r.choice(b"a-.Z\xff ")
        return bytes(raw)
    return bytes(r.choice(b"ab/ :\x7f\x80") for _ in range(16))


def header_field(r: random.Random, frame: bytes) -> bytes:
    """One header field rewritten, MAC made again: most refuse, epoch and seq decode."""
    body_len = len(frame) - H - 32
    i = r.randrange(1, 8)
    value: object
    if i == 1:
        value = r.choice([0, 2, 255, r.randrange(256)])
    elif i == 2:
        value = r.choice([0, 6, 255, r.randrange(1, 6), r.randrange(256)])
    elif i == 3:
        value = r.choice([0, 1, 0x8000, r.randrange(65536)])
    elif i == 4:
        value = random_node(r)
    elif i in (5, 6):
        value = r.choice([0, 1, 2**64 - 1, r.getrandbits(64)])
    else:
        near = max(0, body_len + r.choice([-52, -16, -4, -1, 1, 4, 16, 52]))
        value = r.choice([0, near, wire.MAX_BODY, wire.MAX_BODY + 1, 2**32 - 1, r.getrandbits(32)])
    return rewrite(frame, i, value)


def entry_field(r: random.Random, frame: bytes) -> bytes:
    """An ENTRIES frame with one byte of one entry's op, state, proto, flags or hops set
    to a value on or off the edge of what is allowed, MAC made again."""
    if frame[5] != wire.MsgType.ENTRIES:
        return body_byte(r, frame)
    n_addrs, n_entries = struct.unpack_from("!HH", frame, H)
    start = H + 4 + 16 * n_addrs
    at = start + 52 * r.randrange(n_entries) + r.choice(list(ENTRY_BYTES.values()))
    raw = bytearray(frame[:-32])
    raw[at] = r.choice([*INTERESTING, n_addrs - 1, n_addrs, n_addrs + 1]) & 0xFF
    return remac(raw)


def body_byte(r: random.Random, frame: bytes) -> bytes:
    """One byte of the body set to another value, MAC made again."""
    if len(frame) == H + 32:
        return with_body(frame, r.randbytes(r.randint(1, 8)))
    raw = bytearray(frame[:-32])
    raw[r.randrange(H, len(raw))] ^= r.randrange(1, 256)
    return remac(raw)


def body_bit(r: random.Random, frame: bytes) -> bytes:
    if len(frame) == H + 32:
        return with_body(frame, b"\0")
    raw = bytearray(frame[:-32])
    raw[r.randrange(H, len(raw))] ^= 1 << r.randrange(8)
    return remac(raw)


def body_resize(r: random.Random, frame: bytes) -> bytes:
    """The body cut or extended, ``body_len`` following, MAC made again."""
    body = frame[H:-32]
    if body and r.random() < 0.5:
        return with_body(frame, body[: r.randrange(len(body))])
    return with_body(
        frame, body + r.choice([bytes(r.randint(1, 60)), r.randbytes(r.randint(1, 60))])
    )


def entries_counts(r: random.Random, frame: bytes) -> bytes:
    """An ENTRIES body's counts rewritten, MAC made again."""
    body = frame[H:-32]
    if frame[5] != wire.MsgType.ENTRIES:
        return with_body(frame, struct.pack("!HH", r.randrange(4), r.randrange(4)) + body)
    n_addrs, n_entries = struct.unpack_from("!HH", body)
    n_addrs = r.choice([n_addrs, n_addrs + 1, max(0, n_addrs - 1), 255, 256, r.randrange(65536)])
    n_entries = r.choice([n_entries, n_entries + 1, n_entries - 1, 1024, 1025, 0])
    return with_body(frame, struct.pack("!HH", n_addrs, n_entries) + body[4:])


def bit_flip(r: random.Random, frame: bytes) -> bytes:
    raw = bytearray(frame)
    raw[r.randrange(len(raw))] ^= 1 << r.randrange(8)
    return bytes(raw)


def byte_set(r: random.Random, frame: bytes) -> bytes:
    raw = bytearray(frame)
    raw[r.randrange(len(raw))] ^= r.randrange(1, 256)
    return bytes(raw)


def many_bytes(r: random.Random, frame: bytes) -> bytes:
    raw = bytearray(frame)
    for _ in range(r.randint(2, 8)):
        raw[r.randrange(len(raw))] ^= r.randrange(1, 256)
    return bytes(raw) if raw != frame else bit_flip(r, frame)


def truncate(r: random.Random, frame: bytes) -> bytes:
    return frame[: r.choice([r.randrange(len(frame)), r.randrange(H + 1), len(frame) - 1])]


def extend(r: random.Random, frame: bytes) -> bytes:
    return frame + r.choice([b"\0", r.randbytes(r.randint(1, 100)), frame])


Mutation = Callable[[random.Random, bytes], bytes]
#: Mutations that leave the MAC as it was: none of these may decode.
BLIND: tuple[Mutation, ...] = (bit_flip, byte_set, many_bytes, truncate, extend)
#: Mutations that make the MAC again with the key, so the body's checks are reached.
REMAC: tuple[Mutation, ...] = (
    header_field,
    entry_field,
    entry_field,
    body_byte,
    body_bit,
    body_resize,
    entries_counts,
)
MUTATORS = [(m, False) for m in BLIND] + [(m, True) for m in REMAC]


def decode_checked(frame: bytes, mac_ok: bool, key: bytes = KEY) -> str:
    """Decode ``frame`` and check the properties; how it ended."""
    COUNT.frames += 1
    try:
        h, msg = wire.decode(key, frame)
    except wire.Refused as e:
        assert e.reason in wire.REASONS
        assert str(e).startswith(e.reason + ": ")
        COUNT.note(e.reason)
        if e.reason == "malformed":
            COUNT.details.add(e.detail)
        return e.reason
    assert mac_ok, "a frame decoded whose MAC was not made for it"
    assert key == KEY, "a frame under another key decoded"
    assert wire.encode(key, h.node, h.epoch, h.seq, msg) == frame
    assert h.body_len == len(frame) - H - 32
    COUNT.note("ok")
    return "ok"


@FUZZ
@given(MESSAGES, NODES, u64, u64, st.integers(0, 2**32 - 1))
def fuzz_decode(msg: wire.Message, node: str, epoch: int, seq: int, seed: int) -> None:
    frame = wire.encode(KEY, node, epoch, seq, msg)
    assert decode_checked(frame, True) == "ok"
    h, back = wire.decode(KEY, frame)
    assert back == msg and (h.node, h.epoch, h.seq) == (node, epoch, seq)
    # The frame under another key, as sent and as made again under it.
    assert decode_checked(frame, True, OTHER_KEY) == "mac"
    r = random.Random(seed)
    for _ in range(MUTATIONS):
        mutate, mac_ok = r.choice(MUTATORS)
        bent = mutate(r, frame)
        assert mac_ok or bent != frame
        decode_checked(bent, mac_ok)
        if mac_ok and r.random() < 0.05:
            # The same bytes, checked under another key, never decode.
            assert decode_checked(bent, mac_ok, OTHER_KEY) in wire.REASONS


def test_decoder_fuzz() -> None:
    before = COUNT.frames
    COUNT.outcomes.clear()
    fuzz_decode()
    decoded = COUNT.frames - before
    assert decoded >= 100_000, decoded
    # The mutations reach every check a single frame can fail, and some still decode.
    frame_reasons = set(wire.REASONS) - {"epoch", "replay", "gap"}
    assert frame_reasons <= set(COUNT.outcomes), COUNT.outcomes
    assert COUNT.outcomes["ok"] > 1000
    assert COUNT.outcomes["malformed"] > 1000
    said = " / ".join(COUNT.details)
    for rule in ENTRY_RULES:
        assert rule in said, rule


# -- read_frame over streams ------------------------------------------------------------


def bend_stream(r: random.Random, frames: list[bytes]) -> bytes:
    """The frames as one stream, bent one way."""
    stream = b"".join(frames)
    kind = r.randrange(8)
    if kind == 0:
        return stream
    if kind == 1:
        return stream[: r.randrange(len(stream))]
    if kind == 2:
        return bit_flip(r, stream)
    if kind == 3:
        return byte_set(r, stream)
    if kind == 4:  # bytes inserted between or inside frames
        at = r.randrange(len(stream) + 1)
        return stream[:at] + r.randbytes(r.randint(1, 50)) + stream[at:]
    if kind == 5:  # a frame dropped (the seq check sees a gap) or repeated (a replay)
        i = r.randrange(len(frames))
        twice = frames[: i + 1] + frames[i:]
        return b"".join(r.choice([frames[:i] + frames[i + 1 :], twice]))
    if kind == 6:  # one frame bent with its MAC made again
        i = r.randrange(len(frames))
        mutate = r.choice(REMAC)
        return b"".join([*frames[:i], mutate(r, frames[i]), *frames[i + 1 :]])
    # An oversized header in the middle, followed by more than it could ever read.
    i = r.randrange(len(frames))
    big = rewrite(frames[i], 7, wire.MAX_BODY + 1 + r.randrange(2**20))
    return b"".join([*frames[:i], big[:H], *frames[i:]])


async def read_stream(stream: bytes, node: str, epoch: int) -> str:
    """Read ``stream`` to its end or first refusal, checking every frame it gives."""
    reader = asyncio.StreamReader()
    reader.feed_data(stream)
    reader.feed_eof()
    check = wire.StreamCheck(node, epoch)
    at = 0
    while True:
        COUNT.frames += 1
        try:
            got = await wire.read_frame(reader, KEY)
            if got is None:
                assert at == len(stream), "None before the end of the stream"
                return "end"
            h, msg = got
            frame = wire.encode(KEY, h.node, h.epoch, h.seq, msg)
            assert stream[at : at + len(frame)] == frame
            at += len(frame)
            check.check(h)
        except wire.Refused as e:
            assert e.reason in wire.REASONS
            if e.reason == "truncated":
                assert reader.at_eof()
            return e.reason


@settings(FUZZ, max_examples=STREAM_EXAMPLES)
@given(
    st.lists(MESSAGES, min_size=1, max_size=6),
    NODES,
    st.integers(1, 2**64 - 1),
    st.integers(0, 2**32 - 1),
)
def fuzz_streams(msgs: list[wire.Message], node: str, epoch: int, seed: int) -> None:
    frames = [wire.encode(KEY, node, epoch, i + 1, m) for i, m in enumerate(msgs)]
    r = random.Random(seed)
    streams = [b"".join(frames)] + [bend_stream(r, frames) for _ in range(STREAMS - 1)]

    async def main() -> list[str]:
        return [await read_stream(s, node, epoch) for s in streams]

    outcomes = asyncio.run(main())
    COUNT.streams += len(streams)
    assert outcomes[0] == "end"  # the stream as sent reads to its end
    for o in outcomes:
        COUNT.note("stream:" + o)


def test_read_frame_fuzz() -> None:
    before = COUNT.streams
    COUNT.outcomes.clear()
    fuzz_streams()
    assert COUNT.streams - before >= 3000
    seen = {k.removeprefix("stream:") for k in COUNT.outcomes}
    assert {"end", "truncated", "mac", "oversized", "gap", "replay"} <= seen, COUNT.outcomes
