"""Maglev tables: balance, minimal disruption, order independence, C == Python."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from xdplb.tables import maglev
from xdplb.tables.primes import is_prime

pytestmark = pytest.mark.unit

SMALL_PRIMES = [13, 101, 1009]


def addresses(n: int) -> list[str]:
    return [f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}" for i in range(n)]


def shares(table: maglev.MaglevTable) -> dict[str, float]:
    return {name: count / table.size for name, count in table.counts().items()}


# --- balance --------------------------------------------------------------------------


def test_equal_weights_balance_within_one_percent() -> None:
    table = maglev.build(dict.fromkeys(addresses(100), 1))  # M = 65537 > 100 * N
    counts = table.counts().values()
    assert max(counts) / min(counts) <= 1.01


@pytest.mark.parametrize(
    "weights",
    [
        {"a": 2, "b": 1, "c": 1},
        {"a": 200, "b": 100, "c": 100},  # scale must not matter
        dict(zip(addresses(50), [random.Random(7).randint(1, 10) for _ in range(50)], strict=True)),
    ],
    ids=["2:1:1", "200:100:100", "50 backends, weights 1-10"],
)
def test_weighted_shares_within_one_percent(weights: dict[str, int]) -> None:
    total = sum(weights.values())
    for name, share in shares(maglev.build(weights)).items():
        expected = weights[name] / total
        assert abs(share - expected) <= 0.01 * expected, name


def test_weight_zero_is_not_in_the_table() -> None:
    table = maglev.build({"a": 1, "drained": 0}, 13)
    assert table.names == ("a",)
    assert table.slots.tolist() == [0] * 13


# --- disruption -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "limit"),
    [(maglev.DEFAULT_SIZE, 0.04), (655373, 0.015)],
)
@pytest.mark.parametrize("percent", [1, 5, 10])
def test_removal_moves_little_besides_the_removed(size: int, limit: float, percent: int) -> None:
    """Paper §5.3: only the removed backends' buckets need to move; Maglev moves a few more."""
    names = addresses(1000)
    ids = {name: i for i, name in enumerate(names)}
    removed = set(random.Random(percent).sample(names, 10 * percent))
    before = maglev.build(dict.fromkeys(names, 1), size).map_ids(ids)
    after = maglev.build({n: 1 for n in names if n not in removed}, size).map_ids(ids)

    theirs = np.isin(before, [ids[n] for n in removed])
    assert not np.isin(after, [ids[n] for n in removed]).any()
    moved_others = np.count_nonzero((before != after) & ~theirs) / size
    assert moved_others <= limit


# --- consistency ----------------------------------------------------------------------


names_st = st.text(min_size=1, max_size=12)
backends_st = st.dictionaries(names_st, st.integers(0, 5), min_size=1, max_size=40).filter(
    lambda b: any(b.values())
)


@settings(max_examples=50, deadline=None)
@given(backends=backends_st, size=st.sampled_from(SMALL_PRIMES), rnd=st.randoms())
def test_insertion_order_does_not_matter(
    backends: dict[str, int], size: int, rnd: random.Random
) -> None:
    assume(sum(1 for w in backends.values() if w) <= size)
    items = list(backends.items())
    rnd.shuffle(items)
    assert maglev.build(dict(items), size) == maglev.build(backends, size)


def test_table_is_pinned() -> None:
    """Identity -> permutation must never change: every LB node must agree, across versions."""
    assert maglev.permutation("10.0.0.1", 65537) == (37033, 64355)
    table = maglev.build({"10.0.0.3": 2, "10.0.0.1": 1, "10.0.0.2": 1}, 13)
    assert table.names == ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    assert table.slots.tolist() == [1, 1, 2, 1, 2, 0, 2, 2, 0, 2, 2, 0, 0]


@st.composite
def population_inputs(draw: st.DrawFn) -> tuple[int, list[int], list[int], list[int]]:
    size = draw(st.sampled_from(SMALL_PRIMES))
    n = draw(st.integers(1, min(size, 60)))
    offset = draw(st.lists(st.integers(0, size - 1), min_size=n, max_size=n))
    skip = draw(st.lists(st.integers(1, size - 1), min_size=n, max_size=n))
    # Large weights exercise the 64-bit round * weight products of the C loop.
    weight_st = st.integers(1, 10) | st.integers(1, 2**32 - 1)
    weight = draw(st.lists(weight_st, min_size=n, max_size=n))
    return size, offset, skip, weight


@settings(max_examples=200, deadline=None)
@given(population_inputs())
def test_c_population_matches_reference(
    inputs: tuple[int, list[int], list[int], list[int]],
) -> None:
    got = maglev._populate(*inputs)
    assert got.dtype == np.uint32
    assert np.array_equal(got, maglev._populate_reference(*inputs))


@settings(max_examples=50, deadline=None)
@given(backends=backends_st, size=st.sampled_from(SMALL_PRIMES))
def test_build_matches_reference(backends: dict[str, int], size: int) -> None:
    names = sorted(n for n, w in backends.items() if w)
    assume(len(names) <= size)
    perms = [maglev.permutation(n, size) for n in names]
    expected = maglev._populate_reference(
        size, [p[0] for p in perms], [p[1] for p in perms], [backends[n] for n in names]
    )
    table = maglev.build(backends, size)
    assert table.names == tuple(names)
    assert np.array_equal(table.slots, expected)


# --- the table object -----------------------------------------------------------------


def test_map_ids() -> None:
    table = maglev.build({"a": 1, "b": 1, "c": 0}, 13)
    ids = {"a": 7, "b": 4000, "c": 9}
    mapped = table.map_ids(ids)
    assert mapped.dtype == np.uint32
    assert mapped.tolist() == [ids[table.names[s]] for s in table.slots]
    with pytest.raises(KeyError, match="no backend id for 'b'"):
        table.map_ids({"a": 1})
    with pytest.raises(ValueError, match="backend id of 'a' does not fit in 32 bits: -1"):
        table.map_ids({"a": -1, "b": 2})


def test_slots_are_read_only() -> None:
    table = maglev.build({"a": 1}, 13)
    with pytest.raises(ValueError, match="read-only"):
        table.slots[0] = 1


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backends", "size", "message"),
    [
        ({"a": 1}, 65536, "table size must be prime, got 65536"),
        ({"a": 1}, 1, r"table size must be a prime in 2\.\.4294967295, got 1"),
        ({"a": 1}, 2**32 + 15, r"table size must be a prime in 2\.\.4294967295"),
        ({"a": 1, "b": -1}, 13, "weight of backend 'b' is negative: -1"),
        ({"a": 2**32}, 13, "weight of backend 'a' does not fit in 32 bits"),
        ({}, 13, "no backend with a weight above 0"),
        ({"a": 0}, 13, "no backend with a weight above 0"),
        (dict.fromkeys(addresses(14), 1), 13, "14 backends do not fit in a table of 13 buckets"),
    ],
)
def test_bad_input(backends: dict[str, int], size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        maglev.build(backends, size)


def test_is_prime() -> None:
    small = [n for n in range(200) if is_prime(n)]
    assert small == [n for n in range(2, 200) if all(n % d for d in range(2, n))]
    assert is_prime(65537) and is_prime(655373) and is_prime(2**31 - 1)
    assert not is_prime(65535) and not is_prime(641 * 6700417)
