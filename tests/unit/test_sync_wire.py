"""The wire format of session sync (xdplb.sync.wire, docs/sync.md "The wire"): round trips,
every refusal reason from a crafted frame, splitting sessions into messages, and the
receiver's checks of one subscription."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import struct

import numpy as np
import numpy.typing as npt
import pytest

from xdplb.sync import wire
from xdplb.sync.wire import (
    Begin,
    CopyDigest,
    End,
    Entries,
    Header,
    Keepalive,
    MsgType,
    Op,
    Refused,
    StreamCheck,
    Subscribe,
)

pytestmark = pytest.mark.unit

A = ipaddress.ip_address
KEY = b"k" * 32
OTHER_KEY = b"K" * 32
NODE = "lb-1.fra"


def entries_of(n: int, n_addrs: int, seed: int = 0, op: Op = Op.NEW) -> npt.NDArray[np.void]:
    """``n`` valid entries whose hops index ``n_addrs`` addresses."""
    rng = np.random.default_rng(seed)
    e = np.zeros(n, dtype=wire.ENTRY_DTYPE)
    e["op"] = op
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
    e["age_ms"] = rng.integers(0, 2**32, n)
    return e


ADDRS = (A("10.0.0.1"), A("2001:db8::7"), A("10.0.0.3"))
MESSAGES: list[wire.Message] = [
    Subscribe(full=True),
    Subscribe(full=False),
    Begin(0),
    Begin(1_000_000),
    Begin(2**64 - 1),
    Entries(ADDRS, entries_of(7, 3)),
    Entries(ADDRS, entries_of(wire.MAX_ENTRIES, 3, seed=1, op=Op.COPY)),
    End(12345, hashlib.sha256(b"x").digest()),
    End(0, bytes(32)),
    Keepalive(),
]


def frame_of(msg: wire.Message, epoch: int = 7, seq: int = 1, key: bytes = KEY) -> bytes:
    return wire.encode(key, NODE, epoch, seq, msg)


def reframe(raw: bytes, key: bytes = KEY) -> bytes:
    """``raw``'s header and body with a MAC made for them with ``key``."""
    data = raw[: len(raw) - wire.MAC_SIZE]
    return data + hmac.new(key, data, hashlib.sha256).digest()


def with_header(frame: bytes, **fields: object) -> bytes:
    """``frame`` with header fields rewritten (and its MAC made again)."""
    names = ("magic", "version", "type", "flags", "node", "epoch", "seq", "body_len")
    values = dict(zip(names, wire.HEADER.unpack(frame[: wire.HEADER_SIZE]), strict=True))
    values.update(fields)
    header = wire.HEADER.pack(*(values[n] for n in names))
    return reframe(header + frame[wire.HEADER_SIZE :])


def with_body(frame: bytes, body: bytes) -> bytes:
    """``frame``'s header with ``body`` (its length and MAC made right)."""
    return with_header(frame[: wire.HEADER_SIZE] + body + bytes(32), body_len=len(body))


def refusal(frame: bytes, key: bytes = KEY) -> str:
    with pytest.raises(Refused) as err:
        wire.decode(key, frame)
    assert err.value.reason in wire.REASONS
    return err.value.reason


# -- constants and layout ---------------------------------------------------------------


def test_constants_and_entry_layout() -> None:
    assert (wire.VERSION, wire.MAGIC, wire.HEADER_SIZE, wire.MAC_SIZE) == (1, b"XLBS", 44, 32)
    assert (wire.MAX_BODY, wire.MAX_ENTRIES, wire.NO_HOP) == (65536, 1024, 0xFF)
    assert struct.calcsize("!4sBBH16sQQI") == wire.HEADER_SIZE
    dt = wire.ENTRY_DTYPE
    assert dt.itemsize == 52
    fields = dt.fields
    assert fields is not None
    offsets = {name: f[1] for name, f in fields.items()}
    assert offsets == {
        "op": 0,
        "state": 1,
        "proto": 2,
        "flags": 3,
        "src": 4,
        "dst": 20,
        "sport": 36,
        "dport": 38,
        "hops": 40,
        "hash": 44,
        "age_ms": 48,
    }
    assert [int(t) for t in MsgType] == [1, 2, 3, 4, 5]
    assert [int(o) for o in Op] == [1, 2, 3, 4]


def test_an_entry_is_big_endian_bytes_at_its_offsets() -> None:
    e = np.zeros(1, dtype=wire.ENTRY_DTYPE)
    e["op"], e["state"], e["proto"] = Op.UPDATE, 2, 6
    e["src"] = list(bytes([10, 0, 0, 1]) + bytes(12))
    e["dst"] = list(range(16))
    e["sport"], e["dport"] = 0x1234, 443
    e["hops"] = [0, 1, wire.NO_HOP, wire.NO_HOP]
    e["hash"], e["age_ms"] = 0xDEADBEEF, 1500
    raw = e.tobytes()
    expected = (
        bytes([2, 2, 6, 0])
        + bytes([10, 0, 0, 1])
        + bytes(12)
        + bytes(range(16))
        + b"\x12\x34\x01\xbb"
        + bytes([0, 1, 0xFF, 0xFF])
        + b"\xde\xad\xbe\xef"
        + (1500).to_bytes(4, "big")
    )
    assert raw == expected


def test_the_header_and_mac_are_as_specified() -> None:
    frame = wire.encode(KEY, "n1", 0xABCDEF, 9, Begin(3))
    assert len(frame) == 44 + 8 + 32
    assert frame[:44] == struct.pack(
        "!4sBBH16sQQI", b"XLBS", 1, 2, 0, b"n1" + bytes(14), 0xABCDEF, 9, 8
    )
    assert frame[44:52] == (3).to_bytes(8, "big")
    assert frame[52:] == hmac.new(KEY, frame[:52], hashlib.sha256).digest()


# -- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: wire.Message) -> None:
    frame = wire.encode(KEY, NODE, 2**64 - 1, 123456789, msg)
    h, back = wire.decode(KEY, frame)
    assert h == Header(wire.MsgType(frame[5]), NODE, 2**64 - 1, 123456789, len(frame) - 76)
    assert back == msg
    assert type(back) is type(msg)
    if isinstance(msg, Entries):
        assert isinstance(back, Entries)
        assert back.addrs == msg.addrs
        assert back.entries.tobytes() == msg.entries.tobytes()
    assert wire.encode(KEY, h.node, h.epoch, h.seq, back) == frame


def test_ipv4_addresses_travel_mapped_and_come_back_as_ipv4() -> None:
    frame = frame_of(Entries((A("192.0.2.9"),), entries_of(1, 1)))
    table = frame[44 + 4 : 44 + 4 + 16]
    assert table == bytes(10) + b"\xff\xff" + bytes([192, 0, 2, 9])
    _, msg = wire.decode(KEY, frame)
    assert isinstance(msg, Entries)
    assert msg.addrs == (A("192.0.2.9"),)
    assert isinstance(msg.addrs[0], ipaddress.IPv4Address)


def test_the_largest_entries_message_fits_the_body_limit() -> None:
    msg = Entries(tuple(A(f"10.1.0.{i}") for i in range(255)), entries_of(1024, 255))
    frame = frame_of(msg)
    assert len(frame) == 44 + 4 + 16 * 255 + 52 * 1024 + 32
    assert len(frame) - 76 <= wire.MAX_BODY
    assert wire.decode(KEY, frame)[1] == msg


# -- what encode refuses to send ----------------------------------------------------------


@pytest.mark.parametrize(
    "key, node, epoch, seq, msg",
    [
        (b"short", NODE, 1, 1, Keepalive()),
        (b"x" * 15, NODE, 1, 1, Keepalive()),
        (KEY, "", 1, 1, Keepalive()),
        (KEY, "a" * 17, 1, 1, Keepalive()),
        (KEY, "lb 1", 1, 1, Keepalive()),
        (KEY, "lb/1", 1, 1, Keepalive()),
        (KEY, "nœud", 1, 1, Keepalive()),
        (KEY, NODE, -1, 1, Keepalive()),
        (KEY, NODE, 2**64, 1, Keepalive()),
        (KEY, NODE, 1, 2**64, Keepalive()),
        (KEY, NODE, 1, 1, Begin(-1)),
        (KEY, NODE, 1, 1, End(1, b"short")),
        (KEY, NODE, 1, 1, Entries((), np.zeros(0, dtype=wire.ENTRY_DTYPE))),
        (KEY, NODE, 1, 1, Entries(ADDRS, entries_of(1025, 3))),
        (KEY, NODE, 1, 1, Entries(ADDRS, entries_of(3, 4))),
        (KEY, NODE, 1, 1, Entries(ADDRS * 86, entries_of(3, 3))),
    ],
)
def test_encode_refuses_what_a_receiver_would(
    key: bytes, node: str, epoch: int, seq: int, msg: wire.Message
) -> None:
    with pytest.raises(ValueError):
        wire.encode(key, node, epoch, seq, msg)


def test_a_short_key_is_a_value_error_everywhere() -> None:
    frame = frame_of(Keepalive())
    with pytest.raises(ValueError):
        wire.decode(b"x" * 15, frame)

    async def read() -> object:
        return await wire.read_frame(asyncio.StreamReader(), b"")  # a loop runs: 3.11 wants one

    with pytest.raises(ValueError):
        asyncio.run(read())
    assert wire.decode(b"x" * 16, frame_of(Keepalive(), key=b"x" * 16))[1] == Keepalive()


# -- refusals, one crafted frame each --------------------------------------------------


def test_header_refusals() -> None:
    frame = frame_of(Begin(5))
    assert refusal(b"XLBT" + frame[4:]) == "magic"
    assert refusal(with_header(frame, magic=b"SBLX")) == "magic"
    assert refusal(with_header(frame, version=2)) == "version"
    assert refusal(with_header(frame, version=0)) == "version"
    assert refusal(with_header(frame, type=0)) == "type"
    assert refusal(with_header(frame, type=6)) == "type"
    assert refusal(with_header(frame, flags=1)) == "flags"
    assert refusal(with_header(frame, flags=0x8000)) == "flags"
    assert refusal(with_header(frame, body_len=wire.MAX_BODY + 1)) == "oversized"
    assert refusal(with_header(frame, body_len=2**32 - 1)) == "oversized"
    for node in (bytes(16), b"lb 1", b"\0lb1", b"lb\0x", b"lb/1", "nœud".encode(), b"\xff"):
        assert refusal(with_header(frame, node=node)) == "node", node


def test_parse_header_reads_the_fields() -> None:
    frame = wire.encode(KEY, "a" * 16, 0, 2**64 - 1, Keepalive())
    assert wire.parse_header(frame[:44]) == Header(MsgType.KEEPALIVE, "a" * 16, 0, 2**64 - 1, 0)
    with pytest.raises(Refused) as err:
        wire.parse_header(frame[:43])
    assert err.value.reason == "truncated"
    # A header announcing the largest body is still a header.
    big = with_header(frame, body_len=wire.MAX_BODY)
    assert wire.parse_header(big[:44]).body_len == wire.MAX_BODY


def test_a_wrong_key_or_an_altered_bit_is_a_mac_refusal() -> None:
    for msg in MESSAGES:
        frame = frame_of(msg)
        assert refusal(frame, key=OTHER_KEY) == "mac"
        assert refusal(frame, key=KEY[:16]) == "mac"
        body = range(44, len(frame) - 32)
        for pos in {30, 35, len(frame) - 32, len(frame) - 1, *body[:1], *body[-1:]}:
            flipped = bytearray(frame)
            flipped[pos] ^= 0x01
            assert refusal(bytes(flipped)) == "mac", (msg, pos)


def test_a_short_frame_is_truncated_and_a_long_one_malformed() -> None:
    frame = frame_of(Entries(ADDRS, entries_of(3, 3)))
    for n in (0, 1, 43, 44, 45, len(frame) - 33, len(frame) - 1):
        assert refusal(frame[:n]) == "truncated", n
    assert refusal(frame + b"\0") == "malformed"
    assert refusal(frame + frame) == "malformed"


def test_bodies_that_break_a_rule_are_malformed_even_with_a_right_mac() -> None:
    sub = frame_of(Subscribe(True))
    assert refusal(with_body(sub, b"\x02\0\0\0")) == "malformed"
    assert refusal(with_body(sub, b"\x01\0\0\x01")) == "malformed"
    assert refusal(with_body(sub, b"\x01\0\0")) == "malformed"
    assert refusal(with_body(sub, b"\x01\0\0\0\0")) == "malformed"
    assert refusal(with_body(frame_of(Begin(1)), bytes(7))) == "malformed"
    assert refusal(with_body(frame_of(End(1, bytes(32))), bytes(41))) == "malformed"
    assert refusal(with_body(frame_of(Keepalive()), b"\0")) == "malformed"
    # The same body under another type's header.
    assert refusal(with_header(frame_of(Begin(1)), type=MsgType.SUBSCRIBE)) == "malformed"


def craft_entries(e: npt.NDArray[np.void], n_addrs: int = 3, n_entries: int | None = None) -> bytes:
    """An ENTRIES frame with ``e``'s bytes as they are, and a right MAC."""
    addrs = b"".join(A(f"::{i + 1}").packed for i in range(n_addrs))
    count = len(e) if n_entries is None else n_entries
    body = struct.pack("!HH", n_addrs, count) + addrs + e.tobytes()
    base = frame_of(Entries(ADDRS, entries_of(1, 3)))
    return with_body(base, body)


@pytest.mark.parametrize(
    "field, value",
    [
        ("op", 0),
        ("op", 5),
        ("op", 255),
        ("state", 4),
        ("state", 255),
        ("proto", 0),
        ("proto", 1),
        ("proto", 58),
        ("flags", 1),
        ("flags", 128),
    ],
)
def test_an_entry_field_out_of_range_is_malformed(field: str, value: int) -> None:
    e = entries_of(10, 3)
    assert wire.decode(KEY, craft_entries(e))[1] == Entries(
        tuple(A(f"::{i + 1}") for i in range(3)), e
    )
    e[field][6] = value
    assert refusal(craft_entries(e)) == "malformed"


@pytest.mark.parametrize(
    "hops",
    [
        [wire.NO_HOP, wire.NO_HOP, wire.NO_HOP, wire.NO_HOP],  # no first hop
        [wire.NO_HOP, 0, wire.NO_HOP, wire.NO_HOP],
        [0, wire.NO_HOP, 1, wire.NO_HOP],  # a hop after no hop
        [0, 1, wire.NO_HOP, 2],
        [3, wire.NO_HOP, wire.NO_HOP, wire.NO_HOP],  # index == n_addrs
        [0, 1, 2, 254],
    ],
)
def test_bad_hops_are_malformed(hops: list[int]) -> None:
    e = entries_of(5, 3)
    e["hops"][2] = hops
    assert refusal(craft_entries(e)) == "malformed"


def test_entry_counts_and_lengths_must_agree() -> None:
    e = entries_of(4, 3)
    assert refusal(craft_entries(e, n_entries=5)) == "malformed"
    assert refusal(craft_entries(e, n_entries=3)) == "malformed"
    assert refusal(craft_entries(e[:0], n_entries=0)) == "malformed"
    assert refusal(craft_entries(entries_of(1025, 3))) == "malformed"
    assert refusal(craft_entries(e, n_addrs=256)) == "malformed"
    base = frame_of(Entries(ADDRS, entries_of(1, 3)))
    assert refusal(with_body(base, b"\0\0\0")) == "malformed"
    assert refusal(with_body(base, b"")) == "malformed"
    assert refusal(with_body(base, struct.pack("!HH", 0, 1) + bytes(52))) == "malformed"
    # 255 addresses (indexes 0..254) is the most a table may have.
    wide = entries_of(4, 255)
    assert isinstance(wire.decode(KEY, craft_entries(wide, n_addrs=255))[1], Entries)


# -- read_frame over a StreamReader -----------------------------------------------------


def reader_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


def test_read_frame_reads_frames_then_none_at_a_clean_end() -> None:
    frames = [frame_of(m, seq=i + 1) for i, m in enumerate(MESSAGES)]

    async def main() -> list[tuple[Header, wire.Message] | None]:
        r = reader_of(b"".join(frames))
        return [await wire.read_frame(r, KEY) for _ in range(len(frames) + 2)]

    got = asyncio.run(main())
    assert got[-2:] == [None, None]
    for (h, msg), sent, frame in zip(got[:-2], MESSAGES, frames, strict=True):  # type: ignore[misc]
        assert msg == sent
        assert wire.encode(KEY, h.node, h.epoch, h.seq, msg) == frame


def test_read_frame_end_inside_a_frame_is_truncated() -> None:
    frame = frame_of(Entries(ADDRS, entries_of(3, 3)))

    async def main(data: bytes) -> str:
        with pytest.raises(Refused) as err:
            await wire.read_frame(reader_of(data), KEY)
        return err.value.reason

    for n in (1, 43, 44, 60, len(frame) - 1):
        assert asyncio.run(main(frame[:n])) == "truncated", n


def test_an_oversized_header_is_refused_before_the_body_is_read() -> None:
    header = with_header(frame_of(Keepalive()), body_len=wire.MAX_BODY + 1)[:44]

    async def main() -> tuple[str, bytes]:
        # Only the header and a few bytes, no EOF: a reader that waited for the body
        # would block here forever.
        r = reader_of(header + b"body", eof=False)
        with pytest.raises(Refused) as err:
            await asyncio.wait_for(wire.read_frame(r, KEY), timeout=1)
        return err.value.reason, await r.read(4)

    reason, left = asyncio.run(main())
    assert reason == "oversized"
    assert left == b"body"  # not one byte of the body was read


def test_read_frame_refuses_a_bad_header_or_mac() -> None:
    frame = frame_of(Begin(1))

    async def main(data: bytes) -> str:
        with pytest.raises(Refused) as err:
            await wire.read_frame(reader_of(data, eof=False), KEY)
        return err.value.reason

    assert asyncio.run(main(with_header(frame, version=9))) == "version"
    assert asyncio.run(main(frame_of(Begin(1), key=OTHER_KEY))) == "mac"


# -- a subscription's sequence ----------------------------------------------------------


def header(node: str = NODE, epoch: int = 99, seq: int = 1) -> Header:
    return Header(MsgType.KEEPALIVE, node, epoch, seq, 0)


def test_stream_check_takes_the_next_seq_only() -> None:
    check = StreamCheck(NODE, 99)
    for seq in (1, 2, 3):
        check.check(header(seq=seq))
    assert check.next_seq == 4

    def reason(h: Header) -> str:
        with pytest.raises(Refused) as err:
            check.check(h)
        return err.value.reason

    assert reason(header(seq=3)) == "replay"  # replayed
    assert reason(header(seq=1)) == "replay"
    assert reason(header(seq=5)) == "gap"  # reordered: 5 before 4
    assert reason(header(epoch=98, seq=4)) == "epoch"  # another subscription's
    assert reason(header(node="lb-2", seq=4)) == "node"
    assert check.next_seq == 4  # a refusal does not advance
    check.check(header(seq=4))
    check.check(header(seq=5))
    assert check.next_seq == 6


def test_stream_check_of_decoded_frames() -> None:
    frames = [frame_of(Keepalive(), epoch=5, seq=s) for s in (1, 2, 2, 4)]
    check = StreamCheck(NODE, 5)
    reasons = []
    for f in frames:
        try:
            check.check(wire.decode(KEY, f)[0])
            reasons.append("ok")
        except Refused as e:
            reasons.append(e.reason)
    assert reasons == ["ok", "ok", "replay", "gap"]


def test_stream_check_needs_a_real_subscription() -> None:
    with pytest.raises(ValueError):
        StreamCheck(NODE, 0)
    with pytest.raises(ValueError):
        StreamCheck("", 1)


def test_check_subscribe() -> None:
    wire.check_subscribe(Header(MsgType.SUBSCRIBE, NODE, 1, 0, 4))
    for h, why in (
        (Header(MsgType.SUBSCRIBE, NODE, 0, 0, 4), "epoch"),
        (Header(MsgType.SUBSCRIBE, NODE, 1, 1, 4), "gap"),
    ):
        with pytest.raises(Refused) as err:
            wire.check_subscribe(h)
        assert err.value.reason == why


def test_refused_says_why() -> None:
    err = Refused("gap", "seq 5, 4 expected")
    assert err.reason == "gap"
    assert str(err) == "gap: seq 5, 4 expected"
    with pytest.raises(ValueError):
        Refused("nonsense", "")


# -- entries_messages, resolve_hops, CopyDigest -----------------------------------------


def test_entries_messages_split_over_many_addresses() -> None:
    addrs = [A(f"10.2.{i // 256}.{i % 256}") for i in range(300)]
    rng = np.random.default_rng(3)
    n = 5000
    e = entries_of(n, 1, seed=3, op=Op.COPY)
    wide = rng.integers(0, 300, (n, 4))
    n_hops = rng.integers(1, 5, n)
    wide[np.arange(4) >= n_hops[:, None]] = -1
    msgs = list(wire.entries_messages(addrs, e, hops=wide))
    assert len(msgs) >= 5
    got_addrs: list[list[object]] = []
    sent = []
    for i, m in enumerate(msgs):
        assert 1 <= len(m.entries) <= wire.MAX_ENTRIES
        assert len(m.addrs) <= 255
        assert len(set(m.addrs)) == len(m.addrs)
        frame = wire.encode(KEY, NODE, 1, i + 1, m)
        h, back = wire.decode(KEY, frame)
        assert back == m and h.seq == i + 1
        assert isinstance(back, Entries)
        sent.append(back.entries)
        for row in back.entries["hops"]:
            got_addrs.append([back.addrs[j] for j in row if j != wire.NO_HOP])
    assert sum(len(m.entries) for m in msgs) == n
    want = [[addrs[j] for j in row if j >= 0] for row in wide]
    assert got_addrs == want
    # Everything else of every entry is as given, in order.
    joined = np.concatenate(sent)
    for name in ("op", "state", "proto", "src", "dst", "sport", "dport", "hash", "age_ms"):
        assert np.array_equal(joined[name], e[name]), name


def test_entries_messages_fill_messages_when_addresses_are_few() -> None:
    addrs = [A(f"fd00::{i + 1:x}") for i in range(40)]
    e = entries_of(2500, 40)
    msgs = list(wire.entries_messages(addrs, e))
    assert [len(m.entries) for m in msgs] == [1024, 1024, 452]
    for m, part in zip(msgs, (e[:1024], e[1024:2048], e[2048:]), strict=True):
        hops = m.entries["hops"]
        real = hops != wire.NO_HOP
        assert np.array_equal(real, part["hops"] != wire.NO_HOP)
        lut = np.array([addrs.index(a) for a in m.addrs])
        assert np.array_equal(lut[hops[real]], part["hops"][real])
    assert list(wire.entries_messages(addrs, e[:0])) == []


def test_entries_messages_refuse_a_hop_outside_the_addresses() -> None:
    with pytest.raises(ValueError):
        list(wire.entries_messages([A("10.0.0.1")], entries_of(4, 3)))
    with pytest.raises(ValueError):
        list(wire.entries_messages(ADDRS, entries_of(4, 3), hops=np.full((4, 4), 3)))


def test_resolve_hops_to_local_ids() -> None:
    e = entries_of(4, 3)
    e["hops"] = [[0, 1, 2, 255], [1, 255, 255, 255], [2, 0, 255, 255], [0, 255, 255, 255]]
    msg = Entries((A("10.0.0.1"), A("2001:db8::7"), A("::ffff:10.0.0.3")), e)
    table = {A("10.0.0.1"): 17, A("10.0.0.3"): 4000}  # 2001:db8::7 is no backend here
    ids, known = wire.resolve_hops(msg, table)
    assert ids.dtype == np.uint16 and ids.shape == (4, 4)
    assert ids.tolist() == [[17, 0, 4000, 0], [0, 0, 0, 0], [4000, 17, 0, 0], [17, 0, 0, 0]]
    assert known.tolist() == [False, False, True, True]


def test_copy_digest_is_the_sha256_of_the_copy_entries() -> None:
    parts = [entries_of(n, 3, seed=n, op=Op.COPY) for n in (1, 1024, 77)]
    d = CopyDigest()
    assert d.count == 0 and d.digest() == hashlib.sha256().digest()
    for p in parts:
        d.update(p)
    assert d.count == 1102
    assert d.digest() == hashlib.sha256(b"".join(p.tobytes() for p in parts)).digest()
    assert d.end() == End(1102, d.digest())
    # A change sent during the copy is not part of it.
    mixed = entries_of(10, 3, seed=9, op=Op.COPY)
    mixed["op"][[2, 5]] = [Op.NEW, Op.UPDATE]
    d2 = CopyDigest()
    d2.update(mixed)
    assert d2.count == 8
    assert d2.digest() == hashlib.sha256(mixed[mixed["op"] == Op.COPY].tobytes()).digest()


def test_copy_digest_over_the_wire_matches_the_end() -> None:
    e = entries_of(3000, 3, seed=4, op=Op.COPY)
    sent = CopyDigest()
    frames = [frame_of(Begin(len(e)), seq=1)]
    for m in wire.entries_messages(ADDRS, e):
        sent.update(m.entries)
        frames.append(frame_of(m, seq=len(frames) + 1))
    frames.append(frame_of(sent.end(), seq=len(frames) + 1))
    got = CopyDigest()
    check = StreamCheck(NODE, 7)
    end = None
    for f in frames:
        h, msg = wire.decode(KEY, f)
        check.check(h)
        if isinstance(msg, Entries):
            got.update(msg.entries)
        elif isinstance(msg, End):
            end = msg
    assert end == End(3000, hashlib.sha256(e.tobytes()).digest()) == got.end()
