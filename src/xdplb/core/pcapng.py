"""pcapng blocks as bytes (the IETF draft "PCAP Next Generation Dump File Format").

This module owns the three blocks ``xdplb capture`` writes: a section header, one
interface description per ingress device (link type Ethernet, nanosecond timestamps)
and an enhanced packet block per record, whose ``opt_comment`` carries what lb_xdp did
with the packet. Pure: each function returns the block; the caller writes it.
Little-endian, as the byte-order magic says; every block and option is padded to 4 bytes.
"""

from __future__ import annotations

import struct

SHB = 0x0A0D0D0A
IDB = 0x00000001
EPB = 0x00000006
BYTE_ORDER_MAGIC = 0x1A2B3C4D
LINKTYPE_ETHERNET = 1

OPT_ENDOFOPT = 0
OPT_COMMENT = 1
SHB_USERAPPL = 4
IF_NAME = 2
IF_TSRESOL = 9
TSRESOL_NS = 9  # 10^-9 s units


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 4)


def _option(code: int, value: bytes) -> bytes:
    return struct.pack("<HH", code, len(value)) + _pad(value)


def _options(opts: list[tuple[int, bytes]]) -> bytes:
    if not opts:
        return b""
    return b"".join(_option(c, v) for c, v in opts) + struct.pack("<HH", OPT_ENDOFOPT, 0)


def _block(block_type: int, body: bytes) -> bytes:
    total = 12 + len(body)
    return struct.pack("<II", block_type, total) + body + struct.pack("<I", total)


def section_header(application: str = "xdplb capture") -> bytes:
    """The SHB: version 1.0, section length unknown (-1)."""
    body = struct.pack("<IHHq", BYTE_ORDER_MAGIC, 1, 0, -1)
    return _block(SHB, body + _options([(SHB_USERAPPL, application.encode())]))


def interface(name: str, snaplen: int, linktype: int = LINKTYPE_ETHERNET) -> bytes:
    """An IDB; interfaces are numbered from 0 in the order their IDBs come."""
    body = struct.pack("<HHI", linktype, 0, snaplen)
    opts = [(IF_NAME, name.encode()), (IF_TSRESOL, bytes([TSRESOL_NS]))]
    return _block(IDB, body + _options(opts))


def packet(iface: int, ts_ns: int, data: bytes, orig_len: int, comment: str = "") -> bytes:
    """An EPB: ``data`` is what was captured of a frame of ``orig_len`` bytes, ``ts_ns``
    nanoseconds since the epoch."""
    body = struct.pack(
        "<IIIII", iface, (ts_ns >> 32) & 0xFFFFFFFF, ts_ns & 0xFFFFFFFF, len(data), orig_len
    )
    opts = [(OPT_COMMENT, comment.encode())] if comment else []
    return _block(EPB, body + _pad(data) + _options(opts))
