"""Internet checksums (RFC 1071, bpf/lib/csum.h): a fresh IPv4 header's, and one
updated in place after a 16-bit word changed (the echo replies of step 4c)."""

from __future__ import annotations

import struct


def ipv4_checksum(header: bytes) -> int:
    """RFC 1071 one's-complement sum of a header whose checksum field is zero."""
    total: int = sum(struct.unpack(f"!{len(header) // 2}H", header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def csum_replace16(csum: int, old: int, new: int) -> int:
    """RFC 1624 eqn. 3: a checksum after one 16-bit word of its data changed. A zero
    result is written 0xffff, as lb_icmp.h does: a sum over all-zero data (an echo
    reply with id, seq and payload zero) is 0xffff, and receivers reject 0x0000."""
    total = (~csum & 0xFFFF) + (~old & 0xFFFF) + new
    total = (total & 0xFFFF) + (total >> 16)
    total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF or 0xFFFF
