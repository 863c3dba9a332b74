"""xdplb.core.hashing against bpf/lib/hash.h itself, compiled for the host.

The data plane and the Python model must pick the same bucket for every flow,
so the reference here is the very header lb_xdp includes, not a transcription.
"""

from __future__ import annotations

import importlib.util
import ipaddress
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import cffi
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from xdplb.core import abi, hashing

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

C_CDEF = """
uint32_t ref_flow_hash(const char *key, uint32_t seed);
void ref_flow_hash_many(const uint32_t *words, size_t n, uint32_t seed, uint32_t *out);
uint32_t ref_sess_hash(const char *key, uint32_t seed);
void ref_sess_keys(uint32_t seed, unsigned long long *keys);
uint32_t ref_addr_filter_bit(const char *addr);
uint32_t ref_vip_slot_hash(const char *key);
"""

# The key is copied into a struct xdplb_flow_key first, as lb_xdp hashes it from
# one on its stack; the static assert ties the header's layout to the word count.
C_SOURCE = r"""
#include <string.h>
#include "xdplb_abi.h"
#include "hash.h"

_Static_assert(sizeof(struct xdplb_flow_key) == 4 * XDPLB_FLOW_WORDS,
               "the flow hash covers the whole key");

uint32_t ref_flow_hash(const char *key, uint32_t seed)
{
	struct xdplb_flow_key k;

	memcpy(&k, key, sizeof(k));
	return xdplb_flow_hash((const __u32 *)&k, seed);
}

void ref_flow_hash_many(const uint32_t *words, size_t n, uint32_t seed, uint32_t *out)
{
	for (size_t i = 0; i < n; i++)
		out[i] = xdplb_flow_hash(words + i * XDPLB_FLOW_WORDS, seed);
}

/* The rest take words, copied out of the bytes (no struct read through a __u32 *). */
uint32_t ref_sess_hash(const char *key, uint32_t seed)
{
	__u32 w[XDPLB_FLOW_WORDS];
	__u64 keys[XDPLB_SESS_KEYS];

	memcpy(w, key, sizeof(w));
	xdplb_sess_keys(seed, keys);
	return xdplb_sess_hash(w, keys);
}

void ref_sess_keys(uint32_t seed, unsigned long long *keys)
{
	xdplb_sess_keys(seed, keys);
}

/* addr: 16 bytes, an IPv4 address in the first 4 (struct xdplb_flow_key's dst). */
uint32_t ref_addr_filter_bit(const char *addr)
{
	__u32 w[4];

	memcpy(w, addr, sizeof(w));
	return xdplb_addr_filter_bit(w);
}

/* key: a struct xdplb_vip_key, 20 bytes: four address words, then port, proto, family. */
_Static_assert(sizeof(struct xdplb_vip_key) == 20, "five words");

uint32_t ref_vip_slot_hash(const char *key)
{
	__u32 w[5];

	memcpy(w, key, sizeof(w));
	return xdplb_vip_slot_hash(w, w[4]);
}
"""


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The C hash as a cffi module: ``ref.lib`` and ``ref.ffi``."""
    tmp = tmp_path_factory.mktemp("hash_ref")
    ffi = cffi.FFI()
    ffi.cdef(C_CDEF)
    ffi.set_source(
        "_xdplb_hash_ref",
        C_SOURCE,
        include_dirs=[str(ROOT / "bpf" / "lib"), str(ROOT / "bpf" / "include")],
        extra_compile_args=["-std=gnu11", "-Wall", "-Werror"],
    )
    so = ffi.compile(tmpdir=str(tmp), verbose=False)
    spec = importlib.util.spec_from_file_location("_xdplb_hash_ref", so)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def c_hash(ref: Any, key: bytes, seed: int) -> int:
    return int(ref.lib.ref_flow_hash(key, seed))


def c_hash_many(ref: Any, words: np.ndarray, seed: int) -> np.ndarray:
    words = np.ascontiguousarray(words, dtype=np.uint32)
    out = np.empty(len(words), dtype=np.uint32)
    ref.lib.ref_flow_hash_many(
        ref.ffi.from_buffer("uint32_t[]", words),
        len(words),
        seed,
        ref.ffi.from_buffer("uint32_t[]", out, require_writable=True),
    )
    return out


seeds = st.integers(0, 2**32 - 1)
raw_keys = st.binary(min_size=40, max_size=40)


def _flow_keys() -> st.SearchStrategy[abi.FlowKey]:
    def make(v: Literal[4, 6]) -> st.SearchStrategy[abi.FlowKey]:
        return st.builds(
            abi.FlowKey.make,
            st.ip_addresses(v=v),
            st.ip_addresses(v=v),
            st.integers(0, 65535),
            st.integers(0, 65535),
            st.sampled_from([abi.IPPROTO_TCP, abi.IPPROTO_UDP]),
        )

    return make(4) | make(6)


# Pinned outputs, so that a change to hash.h and hashing.py together (which
# would move every flow of a live cluster to a new bucket) cannot pass unnoticed.
# Cross-checked, when written, against a generic lookup3 hashword(k, 10, seed).
KNOWN_ANSWERS = [
    (bytes(40), 0, 0xC0FED4B2),
    (bytes(40), 0x12345678, 0x20CAAE95),
    (bytes(range(40)), 0, 0x1C9FA888),
    (
        abi.FlowKey.make(
            ipaddress.ip_address("192.0.2.1"),
            ipaddress.ip_address("198.51.100.10"),
            40000,
            80,
            abi.IPPROTO_TCP,
        ).pack(),
        0,
        0x103D220F,
    ),
    (
        abi.FlowKey.make(
            ipaddress.ip_address("2001:db8::1"),
            ipaddress.ip_address("2001:db8:1::53"),
            5353,
            53,
            abi.IPPROTO_UDP,
        ).pack(),
        0xDEADBEEF,
        0x86128C15,
    ),
]


@pytest.mark.parametrize(
    ("key", "seed", "expected"),
    KNOWN_ANSWERS,
    ids=["zeros", "zeros-seeded", "bytes-0-39", "v4-tcp", "v6-udp-seeded"],
)
def test_known_answers(ref: Any, key: bytes, seed: int, expected: int) -> None:
    assert c_hash(ref, key, seed) == expected
    assert hashing.flow_hash(key, seed) == expected
    assert hashing.flow_hash_many(hashing.flow_words([key]), seed).tolist() == [expected]


@given(key=raw_keys, seed=seeds)
def test_scalar_matches_c_on_raw_keys(ref: Any, key: bytes, seed: int) -> None:
    assert hashing.flow_hash(key, seed) == c_hash(ref, key, seed)


@given(key=_flow_keys(), seed=seeds)
def test_scalar_matches_c_on_flow_keys(ref: Any, key: abi.FlowKey, seed: int) -> None:
    assert hashing.flow_hash(key, seed) == c_hash(ref, key.pack(), seed)


@given(keys=st.lists(raw_keys, min_size=1, max_size=50), seed=seeds)
def test_vectorised_matches_scalar(ref: Any, keys: list[bytes], seed: int) -> None:
    words = hashing.flow_words(keys)
    got = hashing.flow_hash_many(words, seed)
    assert got.dtype == np.uint32
    assert got.tolist() == [hashing.flow_hash(k, seed) for k in keys]
    assert np.array_equal(got, c_hash_many(ref, words, seed))


@pytest.mark.parametrize("seed", [0, 1, 0x9E3779B9, 2**32 - 1])
def test_batch_of_10000_matches_c(ref: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**32, size=(10_000, 10), dtype=np.uint32)
    expected = c_hash_many(ref, words, seed)
    assert np.array_equal(hashing.flow_hash_many(words, seed), expected)
    keys = [row.tobytes() for row in words.astype("<u4")]
    assert [hashing.flow_hash(k, seed) for k in keys] == expected.tolist()
    assert np.array_equal(hashing.flow_words(keys), words)


def test_flow_words_accepts_flow_keys() -> None:
    key = abi.FlowKey.make(
        ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("10.0.0.2"), 1, 2, 6
    )
    assert np.array_equal(hashing.flow_words([key]), hashing.flow_words([key.pack()]))


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="a flow key is 40 bytes, got 39"):
        hashing.flow_hash(bytes(39))
    with pytest.raises(ValueError, match="seed must fit in 32 bits"):
        hashing.flow_hash(bytes(40), 2**32)
    with pytest.raises(ValueError, match="seed must fit in 32 bits"):
        hashing.flow_hash_many(np.zeros((1, 10), dtype=np.uint32), -1)
    with pytest.raises(ValueError, match=r"expected an \(n, 10\) array, got shape \(3, 9\)"):
        hashing.flow_hash_many(np.zeros((3, 9), dtype=np.uint32))
    with pytest.raises(ValueError, match="expected a uint32 array, got int64"):
        hashing.flow_hash_many(np.zeros((3, 10), dtype=np.int64))


# --- the session hash, the VIP filter's bit, the VIP index's slot -------------------------

#: Pinned like KNOWN_ANSWERS: a change to xdplb_sess_hash and sess_hash together would
#: put every session of a running table in another set (a miss each) and break import
#: between nodes of different versions.
SESS_KNOWN_ANSWERS = [
    (bytes(40), 0, 0x00000000),  # a multilinear hash of zero words: 0 whatever the keys
    (bytes(40), 0x12345678, 0x00000000),
    (bytes(range(40)), 0, 0x2890AC5D),
    (KNOWN_ANSWERS[3][0], 0x5EED1234, 0x78A23F48),
]


@pytest.mark.parametrize(
    ("key", "seed", "expected"),
    SESS_KNOWN_ANSWERS,
    ids=["zeros", "zeros-seeded", "bytes-0-39", "v4-tcp-seeded"],
)
def test_sess_hash_known_answers(ref: Any, key: bytes, seed: int, expected: int) -> None:
    assert int(ref.lib.ref_sess_hash(key, seed)) == expected
    assert hashing.sess_hash(key, seed) == expected


@given(key=raw_keys, seed=seeds)
def test_sess_hash_matches_c(ref: Any, key: bytes, seed: int) -> None:
    assert hashing.sess_hash(key, seed) == int(ref.lib.ref_sess_hash(key, seed))


@given(key=_flow_keys(), seed=seeds)
def test_sess_hash_matches_c_on_flow_keys(ref: Any, key: abi.FlowKey, seed: int) -> None:
    raw = key.pack()
    assert hashing.sess_hash(raw, seed) == int(ref.lib.ref_sess_hash(raw, seed))


@given(seed=seeds)
def test_sess_keys_match_c(ref: Any, seed: int) -> None:
    out = ref.ffi.new("unsigned long long[10]")
    ref.lib.ref_sess_keys(seed, out)
    keys = hashing.sess_keys(seed)
    assert list(out) == list(keys)
    assert all(k & 1 for k in keys) and len(set(keys)) == 10


def _short_relation(mults: tuple[int, ...]) -> list[int]:
    """Small integers d (not all 0) with sum(d[i] * mults[i]) = 0 mod 2**64: a short
    vector of the lattice of such relations, by Lenstra-Lenstra-Lovasz reduction."""
    n, weight = len(mults), 1 << 80
    basis = [[int(i == j) for j in range(n)] + [weight * m] for i, m in enumerate(mults)]
    basis.append([0] * n + [weight << 64])
    b = [[Fraction(x) for x in row] for row in basis]

    def dot(u: list[Fraction], v: list[Fraction]) -> Fraction:
        return sum((x * y for x, y in zip(u, v, strict=True)), Fraction(0))

    def gram_schmidt() -> tuple[list[list[Fraction]], list[list[Fraction]]]:
        star: list[list[Fraction]] = []
        mu = [[Fraction(0)] * len(b) for _ in b]
        for i, row in enumerate(b):
            v = list(row)
            for j in range(i):
                mu[i][j] = dot(row, star[j]) / dot(star[j], star[j])
                v = [x - mu[i][j] * y for x, y in zip(v, star[j], strict=True)]
            star.append(v)
        return star, mu

    star, mu = gram_schmidt()
    k = 1
    while k < len(b):
        for j in range(k - 1, -1, -1):
            q = round(mu[k][j])
            if q:
                b[k] = [x - q * y for x, y in zip(b[k], b[j], strict=True)]
                star, mu = gram_schmidt()
        if dot(star[k], star[k]) >= (Fraction(3, 4) - mu[k][k - 1] ** 2) * dot(
            star[k - 1], star[k - 1]
        ):
            k += 1
        else:
            b[k], b[k - 1] = b[k - 1], b[k]
            star, mu = gram_schmidt()
            k = max(k - 1, 1)
    for row in b:
        if row[n] == 0 and any(row[:n]):
            return [int(x) for x in row[:n]]
    raise AssertionError("no relation found")


def test_a_crafted_collision_holds_for_one_seed_only() -> None:
    """Whoever knows the multipliers can make flows that share a set and a tag: from a
    short relation among them, two keys whose multilinear sums are equal. With the
    seed only added to fixed public constants, such a pair collides under every seed
    (the seed cancels out of the difference); with multipliers drawn from the seed, a
    pair crafted for one seed is just two flows under another."""
    seed, other = 0x5EED1234, 0x0BADF00D
    # src, dst and the ports word: a flow can vary those (word 9 is proto and padding)
    d = _short_relation(hashing.sess_keys(seed)[:9])
    assert max(abs(x) for x in d) < 1 << 16
    base = [1 << 31] * 9 + [abi.IPPROTO_TCP]
    moved = [w + x for w, x in zip(base, d, strict=False)] + [abi.IPPROTO_TCP]
    a, b = (b"".join(w.to_bytes(4, "little") for w in words) for words in (base, moved))
    assert a != b
    assert hashing.sess_hash(a, seed) == hashing.sess_hash(b, seed)
    assert hashing.sess_hash(a, other) != hashing.sess_hash(b, other)


def test_sess_hash_moves_with_every_field() -> None:
    """Ports and protocol count: flows between two addresses spread over the sets."""
    a, b = ipaddress.ip_address("198.18.5.1"), ipaddress.ip_address("198.19.1.1")
    keys = [abi.FlowKey.make(a, b, p, 80, abi.IPPROTO_TCP).pack() for p in range(1000, 1064)]
    keys.append(abi.FlowKey.make(a, b, 1000, 80, abi.IPPROTO_UDP).pack())
    keys.append(abi.FlowKey.make(a, b, 1000, 81, abi.IPPROTO_TCP).pack())
    sets = {hashing.sess_hash(k, 7) & 0xFFFF for k in keys}
    assert len(sets) > len(keys) - 3


@given(addr=st.ip_addresses())
def test_addr_filter_bit_matches_c(ref: Any, addr: ipaddress.IPv4Address) -> None:
    raw = addr.packed.ljust(16, b"\0")
    bit = hashing.addr_filter_bit(addr.packed)
    assert bit == int(ref.lib.ref_addr_filter_bit(raw))
    assert 0 <= bit < 1 << abi.VIP_FILTER_BITS


@given(
    addr=st.ip_addresses(),
    port=st.integers(0, 65535),
    proto=st.sampled_from([abi.IPPROTO_TCP, abi.IPPROTO_UDP]),
)
def test_vip_slot_hash_matches_c(
    ref: Any, addr: ipaddress.IPv4Address, port: int, proto: int
) -> None:
    key = abi.VipKey.make(addr, port, proto).pack()
    words = np.frombuffer(key, dtype="<u4")
    got = hashing.vip_slot_hash((int(w) for w in words[:4]), int(words[4]))
    assert got == int(ref.lib.ref_vip_slot_hash(key))
