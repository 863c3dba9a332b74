"""The wire format of session sync (docs/sync.md, "The wire"), version 1, sans I/O.

Nodes send each other sessions so that a flow the routers move to another node keeps its
backend there. A message is one frame: a fixed header, a body, and an HMAC-SHA256 of both
under the cluster's shared key. The header is checked before the body is read (a frame
announcing more than :data:`MAX_BODY` is refused unread), the MAC before the body is
interpreted, and then every field: version 1 has no free bits, so a frame this module
accepts re-encodes to the same bytes, and anything else is :class:`Refused` with one of
:data:`REASONS` (a receiver counts refusals by reason and imports nothing of the frame).

Sessions travel as records of :data:`ENTRY_DTYPE`, a packed big-endian numpy dtype, and
every operation on them is vectorised: a full copy carries a million of them, which must
never become a million Python objects. A session names its hops by address; each
:class:`Entries` message carries its own table of the addresses its entries use, and the
entries index it (:func:`entries_messages` builds the tables, :func:`resolve_hops` maps
them to the receiver's backend ids).

A subscription is one TCP connection: the subscriber sends :class:`Subscribe` under a
fresh random epoch, and every message the publisher sends on it carries that epoch and
the sequence numbers 1, 2, 3, ... (:class:`StreamCheck` checks them), so a frame
recorded from another connection, or replayed, reordered or dropped on this one, is
refused.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import ipaddress
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from xdplb.core.addresses import IPAddress, unmap

VERSION = 1
MAGIC = b"XLBS"
#: magic, version, type, flags, node, epoch, seq, body_len.
HEADER = struct.Struct("!4sBBH16sQQI")
HEADER_SIZE = 44
MAC_SIZE = 32
#: The largest body a header may announce (an ENTRIES body is at most 57,332 bytes).
MAX_BODY = 65536
#: Entries and addresses of one ENTRIES message.
MAX_ENTRIES = 1024
MAX_ADDRS = 255
#: A hop index meaning "no hop" (so a message's address table has at most 255 entries).
NO_HOP = 0xFF
HOPS = 4
#: The shortest key :func:`encode` and :func:`decode` take.
MIN_KEY = 16
NODE_SIZE = 16
ADDR_SIZE = 16

#: One session on the wire: 52 bytes, packed, multi-byte fields big-endian. ``src`` and
#: ``dst`` are the flow key's address words as the session table holds them (IPv4: its
#: 4 bytes, then 12 zero bytes), ``hops`` index the message's address table.
ENTRY_DTYPE: np.dtype[np.void] = np.dtype(
    [
        ("op", "u1"),
        ("state", "u1"),
        ("proto", "u1"),
        ("flags", "u1"),
        ("src", "u1", (16,)),
        ("dst", "u1", (16,)),
        ("sport", ">u2"),
        ("dport", ">u2"),
        ("hops", "u1", (HOPS,)),
        ("hash", ">u4"),
        ("age_ms", ">u4"),
    ]
)
ENTRY_SIZE = 52
assert ENTRY_DTYPE.itemsize == ENTRY_SIZE
assert HEADER.size == HEADER_SIZE

_SUBSCRIBE = struct.Struct("!B3s")
_BEGIN = struct.Struct("!Q")
_ENTRIES = struct.Struct("!HH")
_END = struct.Struct("!Q32s")
_U64 = 2**64
_NODE = re.compile(rb"[A-Za-z0-9._-]{1,16}")
#: The largest session state (udp, tcp_syn, tcp_est, tcp_fin).
MAX_STATE = 3
PROTOS = (6, 17)


class MsgType(enum.IntEnum):
    """A frame's ``type``."""

    SUBSCRIBE = 1
    BEGIN = 2
    ENTRIES = 3
    END = 4
    KEEPALIVE = 5


class Op(enum.IntEnum):
    """What an entry tells the receiver: a new session, a state change, a session still
    alive, one session of a full copy."""

    NEW = 1
    UPDATE = 2
    REFRESH = 3
    COPY = 4


#: Why a frame is refused, as :attr:`Refused.reason` says it.
REASONS: tuple[str, ...] = (
    "magic",
    "version",
    "type",
    "flags",
    "oversized",
    "truncated",
    "mac",
    "malformed",
    "node",
    "epoch",
    "replay",
    "gap",
)


class Refused(Exception):
    """A frame the receiver must not import; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"not a refusal reason: {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Header:
    """A frame's header, checked (magic, version, flags and node name already are)."""

    type: MsgType
    node: str
    epoch: int
    seq: int
    body_len: int


@dataclass(frozen=True)
class Subscribe:
    """Subscriber -> publisher, first on a connection: send me your changes (after a
    full copy, if ``full``). Its header's epoch names the subscription, its seq is 0."""

    full: bool


@dataclass(frozen=True)
class Begin:
    """A full copy starts; it will hold ``count`` entries."""

    count: int


@dataclass(frozen=True, eq=False)
class Entries:
    """Sessions: ``entries`` of :data:`ENTRY_DTYPE` whose hops index ``addrs``. Equal to
    another when the addresses and the entries' bytes are."""

    addrs: tuple[IPAddress, ...]
    entries: npt.NDArray[np.void]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entries):
            return NotImplemented
        return (
            self.addrs == other.addrs
            and self.entries.dtype == other.entries.dtype
            and self.entries.tobytes() == other.entries.tobytes()
        )

    def __hash__(self) -> int:
        return hash((self.addrs, len(self.entries)))


@dataclass(frozen=True)
class End:
    """A full copy ends: ``count`` entries were sent, ``digest`` is the SHA-256 of their
    records in the order sent (:class:`CopyDigest`)."""

    count: int
    digest: bytes


@dataclass(frozen=True)
class Keepalive:
    """Nothing to say; the connection is alive."""


Message = Subscribe | Begin | Entries | End | Keepalive

_TYPE_OF: dict[type[Any], MsgType] = {
    Subscribe: MsgType.SUBSCRIBE,
    Begin: MsgType.BEGIN,
    Entries: MsgType.ENTRIES,
    End: MsgType.END,
    Keepalive: MsgType.KEEPALIVE,
}
#: The body length of each type but ENTRIES.
_FIXED_LEN = {
    MsgType.SUBSCRIBE: _SUBSCRIBE.size,
    MsgType.BEGIN: _BEGIN.size,
    MsgType.END: _END.size,
    MsgType.KEEPALIVE: 0,
}


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray):
        raise TypeError(f"the key must be bytes, not {type(key).__name__}")
    if len(key) < MIN_KEY:
        raise ValueError(f"the key must have at least {MIN_KEY} bytes, it has {len(key)}")


def _mac(key: bytes, data: bytes | memoryview) -> bytes:
    return hmac.digest(key, data, "sha256")


def _u64(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64:
        raise ValueError(f"{name} must be an integer in [0, 2**64), not {value!r}")
    return value


def _node_bytes(node: str) -> bytes:
    raw = node.encode("ascii", "replace") if isinstance(node, str) else b""
    if not _NODE.fullmatch(raw):
        raise ValueError(f"a node name has 1..16 of [A-Za-z0-9._-], not {node!r}")
    return raw.ljust(NODE_SIZE, b"\0")


def _bad_entries(entries: npt.NDArray[np.void], n_addrs: int) -> str | None:
    """What is wrong with ``entries`` (of :data:`ENTRY_DTYPE`) whose hops index a table of
    ``n_addrs`` addresses, or None."""
    op = entries["op"]
    if not ((op >= Op.NEW) & (op <= Op.COPY)).all():
        return f"an entry's op is not one of {[int(o) for o in Op]}"
    if not (entries["state"] <= MAX_STATE).all():
        return f"an entry's state is above {MAX_STATE}"
    proto = entries["proto"]
    if not ((proto == PROTOS[0]) | (proto == PROTOS[1])).all():
        return f"an entry's protocol is not one of {PROTOS}"
    if entries["flags"].any():
        return "an entry has flags set"
    hops = entries["hops"]
    real = hops != NO_HOP
    if not real[:, 0].all():
        return "an entry has no first hop"
    if (real[:, 1:] & ~real[:, :-1]).any():
        return "an entry has a hop after no hop"
    if (hops[real] >= n_addrs).any():
        return f"an entry's hop is not an index of the {n_addrs} addresses"
    return None


def _check_entries(msg: Entries) -> None:
    """ValueError unless ``msg`` can go on the wire."""
    e = msg.entries
    if not isinstance(e, np.ndarray) or e.dtype != ENTRY_DTYPE or e.ndim != 1:
        raise ValueError("entries must be a 1-d array of ENTRY_DTYPE")
    if not 1 <= len(e) <= MAX_ENTRIES:
        raise ValueError(f"a message has 1..{MAX_ENTRIES} entries, not {len(e)}")
    if len(msg.addrs) > MAX_ADDRS:
        raise ValueError(f"a message has at most {MAX_ADDRS} addresses, not {len(msg.addrs)}")
    bad = _bad_entries(e, len(msg.addrs))
    if bad is not None:
        raise ValueError(bad)


def _addr_bytes(addr: IPAddress) -> bytes:
    if isinstance(addr, ipaddress.IPv4Address):
        return b"\0" * 10 + b"\xff\xff" + addr.packed
    if isinstance(addr, ipaddress.IPv6Address):
        return addr.packed
    raise ValueError(f"not an IP address: {addr!r}")


def _body(msg: Message) -> bytes:
    if isinstance(msg, Subscribe):
        if not isinstance(msg.full, bool):
            raise ValueError(f"Subscribe.full must be a bool, not {msg.full!r}")
        return _SUBSCRIBE.pack(int(msg.full), b"\0\0\0")
    if isinstance(msg, Begin):
        return _BEGIN.pack(_u64("Begin.count", msg.count))
    if isinstance(msg, Entries):
        _check_entries(msg)
        addrs = b"".join(_addr_bytes(a) for a in msg.addrs)
        head = _ENTRIES.pack(len(msg.addrs), len(msg.entries))
        return head + addrs + msg.entries.tobytes()
    if isinstance(msg, End):
        if not isinstance(msg.digest, bytes) or len(msg.digest) != 32:
            raise ValueError("End.digest must be 32 bytes")
        return _END.pack(_u64("End.count", msg.count), msg.digest)
    if isinstance(msg, Keepalive):
        return b""
    raise ValueError(f"not a message: {msg!r}")


def encode(key: bytes, node: str, epoch: int, seq: int, msg: Message) -> bytes:
    """``msg`` as one frame from ``node`` (header, body, MAC). ValueError for a key
    shorter than 16 bytes, a node name that is not 1..16 of ``[A-Za-z0-9._-]``, an epoch
    or seq out of u64, or a message the receiver would refuse."""
    _check_key(key)
    raw_node = _node_bytes(node)
    body = _body(msg)
    header = HEADER.pack(
        MAGIC,
        VERSION,
        _TYPE_OF[type(msg)],
        0,
        raw_node,
        _u64("epoch", epoch),
        _u64("seq", seq),
        len(body),
    )
    data = header + body
    return data + _mac(key, data)


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """The header in ``raw`` (exactly :data:`HEADER_SIZE` bytes). Refused: ``magic``,
    ``version``, ``type``, ``flags`` (nonzero in v1), ``oversized`` (a body above
    :data:`MAX_BODY`), ``node`` (a name that is not 1..16 of ``[A-Za-z0-9._-]``,
    NUL-padded); ``truncated`` for fewer bytes, ``malformed`` for more."""
    if len(raw) < HEADER_SIZE:
        raise Refused("truncated", f"{len(raw)} bytes of a {HEADER_SIZE}-byte header")
    if len(raw) > HEADER_SIZE:
        raise Refused("malformed", f"a header of {len(raw)} bytes, not {HEADER_SIZE}")
    magic, version, mtype, flags, node, epoch, seq, body_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise Refused("magic", f"magic {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise Refused("version", f"version {version}, this node speaks {VERSION}")
    if not MsgType.SUBSCRIBE <= mtype <= MsgType.KEEPALIVE:
        raise Refused("type", f"no message type {mtype}")
    if flags:
        raise Refused("flags", f"flags {flags:#06x} (none defined in version {VERSION})")
    if body_len > MAX_BODY:
        raise Refused("oversized", f"a body of {body_len} bytes (at most {MAX_BODY})")
    name = node.rstrip(b"\0")
    if not _NODE.fullmatch(name):
        raise Refused("node", f"node name {node!r}")
    return Header(MsgType(mtype), name.decode("ascii"), epoch, seq, body_len)


def _entries(body: memoryview) -> Entries:
    if len(body) < _ENTRIES.size:
        raise Refused("malformed", f"an ENTRIES body of {len(body)} bytes")
    n_addrs, n_entries = _ENTRIES.unpack_from(body)
    if n_addrs > MAX_ADDRS:
        raise Refused("malformed", f"{n_addrs} addresses (at most {MAX_ADDRS})")
    if not 1 <= n_entries <= MAX_ENTRIES:
        raise Refused("malformed", f"{n_entries} entries (1..{MAX_ENTRIES})")
    start = _ENTRIES.size + ADDR_SIZE * n_addrs
    if len(body) != start + ENTRY_SIZE * n_entries:
        raise Refused(
            "malformed",
            f"an ENTRIES body of {len(body)} bytes for {n_addrs} addresses, {n_entries} entries",
        )
    entries = np.frombuffer(body, dtype=ENTRY_DTYPE, count=n_entries, offset=start)
    bad = _bad_entries(entries, n_addrs)
    if bad is not None:
        raise Refused("malformed", bad)
    addrs = tuple(
        unmap(ipaddress.IPv6Address(bytes(body[i : i + ADDR_SIZE])))
        for i in range(_ENTRIES.size, start, ADDR_SIZE)
    )
    return Entries(addrs, entries.copy())


def _message(h: Header, body: memoryview) -> Message:
    """The body of a frame whose header is ``h`` and whose MAC is right."""
    if h.type == MsgType.ENTRIES:
        return _entries(body)
    if len(body) != _FIXED_LEN[h.type]:
        raise Refused("malformed", f"a {h.type.name} body of {len(body)} bytes")
    if h.type == MsgType.SUBSCRIBE:
        full, pad = _SUBSCRIBE.unpack(body)
        if full > 1 or pad != b"\0\0\0":
            raise Refused("malformed", f"SUBSCRIBE body {bytes(body).hex()}")
        return Subscribe(bool(full))
    if h.type == MsgType.BEGIN:
        return Begin(_BEGIN.unpack(body)[0])
    if h.type == MsgType.END:
        count, digest = _END.unpack(body)
        return End(count, digest)
    return Keepalive()


def _open(key: bytes, h: Header, data: memoryview, mac: bytes | memoryview) -> Message:
    """The message of header ``h`` once its header and body (``data``) match ``mac``."""
    if not hmac.compare_digest(_mac(key, data), mac):
        raise Refused("mac", f"the MAC of a {h.type.name} frame does not match")
    return _message(h, data[HEADER_SIZE:])


def decode(key: bytes, frame: bytes) -> tuple[Header, Message]:
    """The header and message of one whole frame. Refused as :func:`parse_header` says,
    or ``truncated`` (shorter than its header says), ``malformed`` (longer, or a body
    that breaks a rule), ``mac`` (a wrong key or altered bytes)."""
    _check_key(key)
    view = memoryview(frame)
    h = parse_header(view[:HEADER_SIZE])
    end = HEADER_SIZE + h.body_len
    if len(view) < end + MAC_SIZE:
        raise Refused("truncated", f"{len(view)} bytes of a {end + MAC_SIZE}-byte frame")
    if len(view) > end + MAC_SIZE:
        raise Refused("malformed", f"{len(view)} bytes for a {end + MAC_SIZE}-byte frame")
    return h, _open(key, h, view[:end], view[end:])


async def read_frame(stream: asyncio.StreamReader, key: bytes) -> tuple[Header, Message] | None:
    """The next frame of ``stream``: None at a clean end (before a frame starts), else
    as :func:`decode`; ``truncated`` if the stream ends inside a frame. The header is
    checked before the body is read: an oversized frame is never read into memory."""
    _check_key(key)
    try:
        raw = await stream.readexactly(HEADER_SIZE)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise Refused("truncated", f"the stream ended {len(e.partial)} bytes into a header") from e
    h = parse_header(raw)
    try:
        rest = await stream.readexactly(h.body_len + MAC_SIZE)
    except asyncio.IncompleteReadError as e:
        raise Refused(
            "truncated",
            f"the stream ended {len(e.partial)} bytes into a {h.body_len}-byte body and MAC",
        ) from e
    data = memoryview(raw + rest)
    return h, _open(key, h, data[: HEADER_SIZE + h.body_len], data[HEADER_SIZE + h.body_len :])


def entries_messages(
    addrs: Sequence[IPAddress],
    entries: npt.NDArray[np.void],
    hops: npt.NDArray[np.integer[Any]] | None = None,
) -> Iterator[Entries]:
    """``entries`` (of :data:`ENTRY_DTYPE`, in order) as :class:`Entries` messages of at
    most :data:`MAX_ENTRIES` entries, each with a table of only the addresses its entries
    use (at most 255) and its entries' hops indexing that table.

    The hops index ``addrs``, which may hold any number of addresses: either the entries'
    own ``hops`` (:data:`NO_HOP` for no hop; then ``addrs`` cannot be used past index 254),
    or ``hops``, an ``(n, 4)`` integer array of indexes into ``addrs``, -1 for no hop,
    which replaces them. ValueError for a hop that is not an index of ``addrs``. A message
    ends early where its next entry would need a 256th address."""
    if entries.dtype != ENTRY_DTYPE or entries.ndim != 1:
        raise ValueError("entries must be a 1-d array of ENTRY_DTYPE")
    n = len(entries)
    if hops is None:
        wide = entries["hops"].astype(np.int64)
        wide[wide == NO_HOP] = -1
    else:
        wide = np.asarray(hops).astype(np.int64)
        if wide.shape != (n, HOPS):
            raise ValueError(f"hops must have the shape {(n, HOPS)}, not {wide.shape}")
        wide[wide < 0] = -1
    if (wide >= len(addrs)).any():
        raise ValueError(f"a hop is not an index of the {len(addrs)} addresses")
    pos = 0
    while pos < n:
        chunk = wide[pos : pos + MAX_ENTRIES]
        flat = chunk.ravel()
        real = flat >= 0
        used, first = np.unique(flat[real], return_index=True)
        if len(used) > MAX_ADDRS:
            # Stop before the entry that brings the 256th distinct address (an entry
            # uses at most 4, so the first one always fits).
            cut = np.flatnonzero(real)[np.sort(first)[MAX_ADDRS]] // HOPS
            chunk = chunk[:cut]
            flat = chunk.ravel()
            real = flat >= 0
        used, inverse = np.unique(flat[real], return_inverse=True)
        local = np.full(flat.shape, NO_HOP, dtype=np.uint8)
        local[real] = inverse.ravel()
        out = entries[pos : pos + len(chunk)].copy()
        out["hops"] = local.reshape(-1, HOPS)
        yield Entries(tuple(addrs[int(i)] for i in used), out)
        pos += len(chunk)


def resolve_hops(
    msg: Entries, table: Mapping[IPAddress, int]
) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.bool_]]:
    """The hops of ``msg``'s entries in the receiver's ids: ``(ids, known)``, ``ids`` an
    ``(n, 4)`` uint16 array of ``table[address]`` (0 for no hop, and for an address
    ``table`` lacks), ``known`` whether every hop of an entry has an id. One lookup per
    address of the message, not per entry."""
    lut = np.zeros(NO_HOP + 1, dtype=np.uint16)
    have = np.zeros(NO_HOP + 1, dtype=bool)
    have[NO_HOP] = True
    for i, addr in enumerate(msg.addrs):
        bid = table.get(unmap(addr))
        if bid is not None:
            if not 0 <= bid <= 0xFFFF:
                raise ValueError(f"backend id {bid} of {addr} does not fit 16 bits")
            lut[i] = bid
            have[i] = True
    hops = msg.entries["hops"]
    return lut[hops], have[hops].all(axis=1)


class CopyDigest:
    """The running SHA-256 of a full copy's entries, as :class:`End` carries it: the
    records of the entries whose op is COPY, in the order sent (an entry of another op
    on the way is a change, not part of the copy). ``count`` is how many there were."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.count = 0

    def update(self, entries: npt.NDArray[np.void]) -> None:
        """Add the COPY entries of ``entries`` (of :data:`ENTRY_DTYPE`, as sent)."""
        if entries.dtype != ENTRY_DTYPE:
            raise ValueError("entries must be of ENTRY_DTYPE")
        copy = entries["op"] == Op.COPY
        part = entries if copy.all() else entries[copy]
        self._sha.update(np.ascontiguousarray(part).data)
        self.count += len(part)

    def digest(self) -> bytes:
        """The SHA-256 of the COPY entries so far."""
        return self._sha.digest()

    def end(self) -> End:
        """The :class:`End` of the copy so far."""
        return End(self.count, self.digest())


class StreamCheck:
    """The receiving side of one subscription: the publisher's messages come from
    ``node``, under the subscription's ``epoch``, with seq 1, 2, 3, ..."""

    def __init__(self, node: str, epoch: int) -> None:
        _node_bytes(node)
        if _u64("epoch", epoch) == 0:
            raise ValueError("a subscription's epoch is never 0")
        self.node = node
        self.epoch = epoch
        #: The seq the next message must carry.
        self.next_seq = 1

    def check(self, h: Header) -> None:
        """Refused ``node`` (another sender), ``epoch`` (another subscription),
        ``replay`` (a seq already seen) or ``gap`` (a message missing before it);
        otherwise the next message is expected."""
        if h.node != self.node:
            raise Refused("node", f"a frame from {h.node!r}, not {self.node!r}")
        if h.epoch != self.epoch:
            raise Refused("epoch", f"epoch {h.epoch:#x}, not {self.epoch:#x}")
        if h.seq < self.next_seq:
            raise Refused("replay", f"seq {h.seq}, {self.next_seq} expected")
        if h.seq > self.next_seq:
            raise Refused("gap", f"seq {h.seq}, {self.next_seq} expected")
        self.next_seq += 1


def check_subscribe(h: Header) -> None:
    """The publisher's check of a SUBSCRIBE header: Refused ``epoch`` for epoch 0 (a
    subscriber always picks a random nonzero one), ``gap`` for a seq other than 0."""
    if h.epoch == 0:
        raise Refused("epoch", "a SUBSCRIBE under epoch 0")
    if h.seq != 0:
        raise Refused("gap", f"a SUBSCRIBE with seq {h.seq}, not 0")
