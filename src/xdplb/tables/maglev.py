"""Weighted Maglev lookup tables (Eisenbud et al., NSDI 2016, §3.4).

lb_xdp hashes a flow to one of M buckets and forwards it to that bucket's
backend; this module computes the buckets.  Two properties matter (docs/design.md §3):

- balance: each backend owns a share of the M buckets proportional to its
  weight, within 1% when M > 100 * N;
- consistency: the table is a function of the *set* of (identity, weight)
  pairs and M only.  Every LB node of a cluster computes the same table from
  the same set, whatever order its backends were added in, on any machine and
  Python version; and removing a backend moves few buckets besides its own.

So a backend's permutation comes from BLAKE2b of its identity (not Python's
salted ``hash()``), and backends take turns in sorted identity order.
Weights follow Envoy's MaglevTable: a backend takes a turn in round r only when
``r * w >= target``, and each turn raises its target by the largest weight.

The population loop lives in C (``xdplb.tables._maglev_c``, built by maglev_build.py);
:func:`_populate_reference` is the same algorithm in Python, for the tests.
"""

from __future__ import annotations

import hashlib
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xdplb.tables.primes import is_prime

try:
    import xdplb.tables._maglev_c as _maglev_c
except ImportError as exc:  # pragma: no cover - depends on the build, not on the code
    raise ImportError(
        "xdplb.tables._maglev_c is not built: run `make build` "
        "(or .venv/bin/python src/xdplb/tables/maglev_build.py)"
    ) from exc

#: The paper's table size: prime, and > 100 * N for N up to 655 backends.
DEFAULT_SIZE = 65537
#: Slots and weights are __u32 in C.
_U32_MAX = 0xFFFFFFFF
#: Domain separation, so that these hashes never collide by design with another use.
_PERSON = b"xdplb-maglev"

U32Array = npt.NDArray[np.uint32]


@dataclass(frozen=True, eq=False)
class MaglevTable:
    """A built table: bucket i goes to ``names[slots[i]]``.

    Compared with ``==`` by content (``names`` and every slot), which is how
    tests and the planner tell whether a rebuild changed anything.
    """

    #: Identities of the backends in the table (weight > 0), sorted: the canonical order.
    names: tuple[str, ...]
    #: One entry per bucket (length M, prime), an index into ``names``; read-only.
    slots: U32Array

    def __post_init__(self) -> None:
        # Frozen should mean frozen: a table may be shared by the planner and the model.
        self.slots.flags.writeable = False

    @property
    def size(self) -> int:
        """M, the number of buckets."""
        return len(self.slots)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MaglevTable):
            return NotImplemented
        return self.names == other.names and bool(np.array_equal(self.slots, other.slots))

    def counts(self) -> dict[str, int]:
        """Buckets owned by each backend: its actual share, to compare with its weight."""
        owned = np.bincount(self.slots, minlength=len(self.names))
        return {name: int(c) for name, c in zip(self.names, owned, strict=True)}

    def map_ids(self, ids: Mapping[str, int]) -> U32Array:
        """The table as backend ids (what the BPF inner map holds), ids given by identity.

        ``ids`` may hold more backends than the table (e.g. ones of weight 0);
        every name of the table must be in it.
        """
        missing = [name for name in self.names if name not in ids]
        if missing:
            raise KeyError(f"no backend id for {', '.join(map(repr, missing))}")
        by_index = np.empty(len(self.names), dtype=np.uint32)
        for i, name in enumerate(self.names):
            backend_id = operator.index(ids[name])
            if not 0 <= backend_id <= _U32_MAX:
                raise ValueError(f"backend id of {name!r} does not fit in 32 bits: {backend_id}")
            by_index[i] = backend_id
        return by_index[self.slots]


def permutation(identity: str, size: int) -> tuple[int, int]:
    """(offset, skip) of a backend's preference list ``(offset + j * skip) % size``.

    Paper §3.4: offset = h1 % M, skip = h2 % (M - 1) + 1.  skip is never 0 and M
    is prime, so the list visits every bucket exactly once.
    """
    digest = hashlib.blake2b(identity.encode("utf-8"), digest_size=16, person=_PERSON).digest()
    h1 = int.from_bytes(digest[:8], "little")
    h2 = int.from_bytes(digest[8:], "little")
    return h1 % size, h2 % (size - 1) + 1


def _check_size(size: int) -> None:
    if not 2 <= size <= _U32_MAX:
        raise ValueError(f"table size must be a prime in 2..{_U32_MAX}, got {size}")
    if not is_prime(size):
        # A composite M lets a skip share a factor with M: that backend's list would
        # cycle through a fraction of the buckets, and the balance proof breaks.
        raise ValueError(f"table size must be prime, got {size}")


def _check_weights(backends: Mapping[str, int]) -> dict[str, int]:
    """The backends that go in the table (weight > 0), after checking every weight."""
    kept = {}
    for name, weight in backends.items():
        w = operator.index(weight)
        if w < 0:
            raise ValueError(f"weight of backend {name!r} is negative: {w}")
        if w > _U32_MAX:
            raise ValueError(f"weight of backend {name!r} does not fit in 32 bits: {w}")
        if w:
            kept[name] = w
    return kept


def build(backends: Mapping[str, int], size: int = DEFAULT_SIZE) -> MaglevTable:
    """Build the Maglev table of ``backends`` (identity -> weight) with ``size`` buckets.

    Weight 0 keeps a backend out of the table (drained).  Raises ValueError if
    ``size`` is not prime, a weight is negative or above 2**32 - 1, no backend
    has a weight above 0 (an empty table has no meaning: the caller decides what
    a VIP without backends does), or there are more backends than buckets.
    """
    _check_size(size)
    weights = _check_weights(backends)
    if not weights:
        raise ValueError("no backend with a weight above 0: a Maglev table needs at least one")
    if len(weights) > size:
        raise ValueError(f"{len(weights)} backends do not fit in a table of {size} buckets")

    names = tuple(sorted(weights))
    perms = [permutation(name, size) for name in names]
    slots = _populate(
        size,
        [offset for offset, _ in perms],
        [skip for _, skip in perms],
        [weights[name] for name in names],
    )
    return MaglevTable(names=names, slots=slots)


def _populate(
    size: int, offset: Sequence[int], skip: Sequence[int], weight: Sequence[int]
) -> U32Array:
    """Fill ``size`` buckets with backend indexes, in C; see maglev_build.py."""
    ffi, lib = _maglev_c.ffi, _maglev_c.lib
    offsets = np.asarray(offset, dtype=np.uint32)
    skips = np.asarray(skip, dtype=np.uint32)
    weights = np.asarray(weight, dtype=np.uint32)
    out = np.empty(size, dtype=np.uint32)
    rc = lib.maglev_populate(
        size,
        len(weights),
        ffi.from_buffer("uint32_t[]", offsets),
        ffi.from_buffer("uint32_t[]", skips),
        ffi.from_buffer("uint32_t[]", weights),
        ffi.from_buffer("uint32_t[]", out, require_writable=True),
    )
    if rc != 0:
        raise OSError(-rc, f"maglev_populate: {os.strerror(-rc)}")
    return out


def _populate_reference(
    size: int, offset: Sequence[int], skip: Sequence[int], weight: Sequence[int]
) -> U32Array:
    """The population loop in plain Python: the specification the C version must match."""
    n = len(weight)
    max_weight = max(weight)
    target = [0] * n
    pos = list(offset)
    table = [-1] * size
    filled = 0
    rnd = 0
    while filled < size:
        for i in range(n):
            if filled == size:
                break
            if rnd * weight[i] < target[i]:
                continue
            target[i] += max_weight
            c = pos[i]
            while table[c] != -1:
                c = (c + skip[i]) % size
            table[c] = i
            pos[i] = (c + skip[i]) % size
            filled += 1
        rnd += 1
    return np.array(table, dtype=np.uint32)
