"""The flow hash, in Python, bit for bit equal to ``xdplb_flow_hash()`` in bpf/lib/hash.h.

The BPF program hashes a flow's 40-byte ``struct xdplb_flow_key`` to pick a
lookup-table bucket; the control plane's reference model must pick the same
bucket, so this is Bob Jenkins' lookup3 ``hashword()`` (the kernel's jhash2)
over the key's ten little-endian 32-bit words, with the same seed handling.
tests/unit/test_hashing.py compiles the C header and compares.

Two forms: :func:`flow_hash` for one key, and :func:`flow_hash_many` over an
``(n, 10)`` uint32 array, so that checking a model against millions of flows
does not cost a Python loop per flow.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from xdplb.core import abi

#: lookup3's initial value (``JHASH_INITVAL`` in the kernel).
JHASH_INITVAL = 0xDEADBEEF
#: A flow key is this many 32-bit words (``XDPLB_FLOW_WORDS``).
FLOW_WORDS = 10
#: ... and this many bytes (``sizeof(struct xdplb_flow_key)``).
FLOW_KEY_SIZE = 4 * FLOW_WORDS

_MASK = 0xFFFFFFFF
_INIT = (JHASH_INITVAL + (FLOW_WORDS << 2)) & _MASK

U32Array = npt.NDArray[np.uint32]


def _rol(w: int, s: int) -> int:
    return ((w << s) | (w >> (32 - s))) & _MASK


def _check_seed(seed: int) -> int:
    # The C seed is a __u32; a value that does not fit would silently differ.
    if not 0 <= seed <= _MASK:
        raise ValueError(f"seed must fit in 32 bits (0..{_MASK:#x}), got {seed}")
    return seed


def _key_bytes(key: bytes | abi.FlowKey) -> bytes:
    raw = bytes(key)
    if len(raw) != FLOW_KEY_SIZE:
        raise ValueError(f"a flow key is {FLOW_KEY_SIZE} bytes, got {len(raw)}")
    return raw


def flow_hash(key: bytes | abi.FlowKey, seed: int = 0) -> int:
    """Hash one flow key (40 bytes, or an :class:`abi.FlowKey`) as lb_xdp does."""
    raw = _key_bytes(key)
    k = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, FLOW_KEY_SIZE, 4)]
    a = b = c = (_INIT + _check_seed(seed)) & _MASK

    # Three lookup3 mix() rounds over words 0-8 (the macro's statements, in order).
    for i in (0, 3, 6):
        a = (a + k[i]) & _MASK
        b = (b + k[i + 1]) & _MASK
        c = (c + k[i + 2]) & _MASK
        a = ((a - c) & _MASK) ^ _rol(c, 4)
        c = (c + b) & _MASK
        b = ((b - a) & _MASK) ^ _rol(a, 6)
        a = (a + c) & _MASK
        c = ((c - b) & _MASK) ^ _rol(b, 8)
        b = (b + a) & _MASK
        a = ((a - c) & _MASK) ^ _rol(c, 16)
        c = (c + b) & _MASK
        b = ((b - a) & _MASK) ^ _rol(a, 19)
        a = (a + c) & _MASK
        c = ((c - b) & _MASK) ^ _rol(b, 4)
        b = (b + a) & _MASK

    # The tenth word, then lookup3 final().
    a = (a + k[9]) & _MASK
    c = ((c ^ b) - _rol(b, 14)) & _MASK
    a = ((a ^ c) - _rol(c, 11)) & _MASK
    b = ((b ^ a) - _rol(a, 25)) & _MASK
    c = ((c ^ b) - _rol(b, 16)) & _MASK
    a = ((a ^ c) - _rol(c, 4)) & _MASK
    b = ((b ^ a) - _rol(a, 14)) & _MASK
    c = ((c ^ b) - _rol(b, 24)) & _MASK
    return c


def flow_words(keys: Iterable[bytes | abi.FlowKey]) -> U32Array:
    """Turn flow keys into the ``(n, 10)`` uint32 array :func:`flow_hash_many` takes.

    Words are read little-endian whatever the host, because that is how the C
    hash reads them on the (little-endian) machines lb_xdp runs on.
    """
    raw = b"".join(_key_bytes(k) for k in keys)
    words = np.frombuffer(raw, dtype="<u4").astype(np.uint32)
    return words.reshape(-1, FLOW_WORDS)


def _vrol(w: U32Array, s: int) -> U32Array:
    return (w << np.uint32(s)) | (w >> np.uint32(32 - s))


def flow_hash_many(words: U32Array, seed: int = 0) -> U32Array:
    """Hash every row of an ``(n, 10)`` uint32 array; row i gives ``flow_hash(key_i)``.

    numpy uint32 arithmetic wraps modulo 2**32 exactly like C's ``__u32``, so the
    statements are the C macros verbatim, each applied to whole columns.
    """
    if words.ndim != 2 or words.shape[1] != FLOW_WORDS:
        raise ValueError(f"expected an (n, {FLOW_WORDS}) array, got shape {words.shape}")
    if words.dtype != np.uint32:
        raise ValueError(f"expected a uint32 array, got {words.dtype}")
    k = words.T
    init = np.uint32((_INIT + _check_seed(seed)) & _MASK)
    a = np.full(words.shape[0], init, dtype=np.uint32)
    b = a.copy()
    c = a.copy()

    for i in (0, 3, 6):
        a += k[i]
        b += k[i + 1]
        c += k[i + 2]
        a -= c
        a ^= _vrol(c, 4)
        c += b
        b -= a
        b ^= _vrol(a, 6)
        a += c
        c -= b
        c ^= _vrol(b, 8)
        b += a
        a -= c
        a ^= _vrol(c, 16)
        c += b
        b -= a
        b ^= _vrol(a, 19)
        a += c
        c -= b
        c ^= _vrol(b, 4)
        b += a

    a += k[9]
    c ^= b
    c -= _vrol(b, 14)
    a ^= c
    a -= _vrol(c, 11)
    b ^= a
    b -= _vrol(a, 25)
    c ^= b
    c -= _vrol(b, 16)
    a ^= c
    a -= _vrol(c, 4)
    b ^= a
    b -= _vrol(a, 14)
    c ^= b
    c -= _vrol(b, 24)
    return c


def addr_filter_bit(addr: bytes) -> int:
    """The ``lb_vip_filter`` bit of an address (4 or 16 bytes, network order), as
    ``xdplb_addr_filter_bit()`` computes it from the address's little-endian words."""
    raw = addr.ljust(16, b"\0")
    x = 0
    for i in range(0, 16, 4):
        x ^= int.from_bytes(raw[i : i + 4], "little")
    return ((x * 0x9E3779B1) & _MASK) >> (32 - abi.VIP_FILTER_BITS)


def vip_slot_hash(addr_words: Iterable[int], port_proto_family: int) -> int:
    """``xdplb_vip_slot_hash()``: a VIP key's home slot in ``lb_vip_index`` before the
    mask, from its four address words and its last word (port, proto, family)."""
    x = _rol(port_proto_family & _MASK, 7)
    for w in addr_words:
        x ^= w
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK
    x ^= x >> 16
    return x


_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=16)
def sess_keys(seed: int) -> tuple[int, ...]:
    """``xdplb_sess_keys()``: the session hash's ten odd 64-bit multipliers drawn from
    ``seed`` by SplitMix64; ``lb_config.sess_key`` holds them."""
    x = _check_seed(seed)
    keys = []
    for _ in range(FLOW_KEY_SIZE // 4):
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        z = x
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        keys.append((z ^ (z >> 31)) | 1)
    return tuple(keys)


def sess_hash(key: bytes, seed: int) -> int:
    """``xdplb_sess_hash()`` of a 40-byte flow key under the multipliers of ``seed``: the
    session table's hash (its set is this AND ``conn_mask``, its tag this)."""
    if len(key) != FLOW_KEY_SIZE:
        raise ValueError(f"a flow key is {FLOW_KEY_SIZE} bytes, got {len(key)}")
    words = [int.from_bytes(key[i : i + 4], "little") for i in range(0, FLOW_KEY_SIZE, 4)]
    s = 0
    for w, m in zip(words, sess_keys(seed), strict=True):
        s = (s + w * m) & _MASK64
    h = (s >> 32) ^ (s & _MASK)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK
    h ^= h >> 16
    return h
