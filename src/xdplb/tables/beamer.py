"""Beamer lookup tables (Olteanu et al., NSDI 2018), as Unimog and Nickel use them.

lb_xdp hashes a flow to one of B buckets (``hash % B``, any B >= 1) and sends it to
the bucket's first hop, with the bucket's previous first hops as later hops in the
GUE hop list; a backend that gets a packet of a connection it does not have passes it
on to the next hop in the list (daisy chaining, docs/design.md §1).  When a bucket moves
from backend a to backend b, a becomes its most recent previous hop, so a's
established connections survive the move -- and up to ``MAX_HOPS - 1`` moves of the
same bucket, since the table keeps that many distinct previous owners per bucket.

The table is a function of its history only: :func:`build` and every :func:`adjust`
are deterministic (no randomness, no dependence on dict order, ties broken by id or
bucket index), so every LB node that applies the same weights in the same order holds
the same table.

The adjustment policy (docs/design.md §3), in order of precedence:

1. swaps: a bucket with first hop a over target whose most recent previous hop b is
   under target gets b back as first hop (and a as most recent previous hop);
2. of a donor's buckets, those changed least recently move first;
3. runs stay contiguous: a donor gives from the ends of its runs, first to a receiver
   that borders the run, and the shortest runs go first;

and over time: a minimum interval between two changes (:class:`Scheduler`), and at
most ``max_step`` of the buckets per change (small steps toward a far target).
Buckets only ever move from a backend over its target to one under it, so reaching
a fixed target moves the minimum number of buckets, none of them twice.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from xdplb.core.abi import MAX_HOPS
from xdplb.core.state import LookupTable

#: 2**16 buckets: < 1% imbalance for up to ~650 equal backends; need not be prime.
DEFAULT_SIZE = 65536
#: Backend ids, weights and the table size are __u32 in C.
_U32_MAX = 0xFFFFFFFF

U32Array = npt.NDArray[np.uint32]
U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class BeamerTable:
    """B buckets of (first hop, previous first hops), and when each bucket last changed.

    Compared with ``==`` by content (every array and the generation).  The arrays are
    made read-only: an adjustment makes a new table, the old one may still be in use.
    """

    #: Backend id (>= 1) of each bucket: where its new flows go.
    first: U32Array
    #: ``(B, MAX_HOPS - 1)``: the distinct backend ids that owned the bucket before
    #: ``first``, most recent first, 0-padded at the end; never equal to ``first``.  They
    #: keep serving the connections they already have (daisy chaining).
    hops: U32Array
    #: Generation at which each bucket last changed hands; 0 = the initial build.
    changed: U64Array
    #: Adjustments applied since :func:`build`; the next one stamps ``generation + 1``.
    generation: int = 0

    def __post_init__(self) -> None:
        first = np.ascontiguousarray(self.first, dtype=np.uint32)
        hops = np.ascontiguousarray(self.hops, dtype=np.uint32)
        changed = np.ascontiguousarray(self.changed, dtype=np.uint64)
        if first.ndim != 1 or len(first) < 1:
            raise ValueError(f"a Beamer table needs a 1-d array of >= 1 buckets, got {first.shape}")
        if hops.shape != (len(first), MAX_HOPS - 1) or changed.shape != first.shape:
            raise ValueError(
                f"first {first.shape}, hops {hops.shape} and changed {changed.shape} "
                f"must have one entry (hops: {MAX_HOPS - 1}) per bucket"
            )
        if not first.all():
            raise ValueError(f"bucket {int(np.argmin(first))} has no first hop (0)")
        # A previous hop equal to the first would send a packet back where it came from.
        same = np.flatnonzero((hops == first[:, None]).any(axis=1))
        if len(same):
            raise ValueError(f"bucket {int(same[0])} has a previous hop equal to its first hop")
        gap = np.flatnonzero(((hops[:, :-1] == 0) & (hops[:, 1:] != 0)).any(axis=1))
        if len(gap):
            raise ValueError(f"bucket {int(gap[0])} has a previous hop after a 0 (none)")
        for j in range(1, MAX_HOPS - 1):
            dup = np.flatnonzero(
                ((hops[:, j : j + 1] == hops[:, :j]) & (hops[:, j : j + 1] != 0)).any(axis=1)
            )
            if len(dup):
                raise ValueError(f"bucket {int(dup[0])} names a previous hop twice")
        generation = operator.index(self.generation)
        if generation < 0:
            raise ValueError(f"generation must be >= 0, got {generation}")
        for name, arr in (("first", first), ("hops", hops), ("changed", changed)):
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "generation", generation)

    @property
    def size(self) -> int:
        """B, the number of buckets."""
        return len(self.first)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BeamerTable):
            return NotImplemented
        return (
            self.generation == other.generation
            and bool(np.array_equal(self.first, other.first))
            and bool(np.array_equal(self.hops, other.hops))
            and bool(np.array_equal(self.changed, other.changed))
        )

    __hash__ = None  # type: ignore[assignment]

    def counts(self) -> dict[int, int]:
        """Buckets per first hop, by ascending id: each backend's share of new flows."""
        ids, counts = np.unique(self.first, return_counts=True)
        return {int(i): int(c) for i, c in zip(ids, counts, strict=True)}

    def to_lookup_table(self) -> LookupTable:
        """The hops as the inner map holds them: ``rest`` is the previous hops (None
        when no bucket has one, as :meth:`LookupTable.from_buckets` reads it back)."""
        return LookupTable(self.first, self.hops)


def from_lookup_table(table: LookupTable) -> BeamerTable:
    """A Beamer table from hops read back from a map, with no history (generation 0).

    What a restarted control plane starts from: it cannot know when buckets changed,
    so all count as changed at the build.  Later hops that a Beamer table cannot hold
    (0 before a hop, a hop equal to the first or named twice) are dropped.
    """
    first = np.asarray(table.first, dtype=np.uint32)
    if table.rest is None:
        hops = np.zeros((len(first), MAX_HOPS - 1), dtype=np.uint32)
    else:
        hops = _previous_hops(first, np.asarray(table.rest, dtype=np.uint32))
    return BeamerTable(first, hops, np.zeros(len(first), dtype=np.uint64), 0)


def _previous_hops(first: U32Array, candidates: U32Array, keep: U32Array | None = None) -> U32Array:
    """Per bucket, ``candidates`` (most recent first) without 0s, without ``first`` and
    without repeats, packed to the front and cut to ``MAX_HOPS - 1`` columns. A bucket
    with one candidate too many drops its oldest not in ``keep`` (backends that may hold
    connections), or its oldest if all are."""
    n = candidates.shape[1]
    keep_c = (candidates != 0) & (candidates != first[:, None])
    for j in range(1, n):
        seen = (candidates[:, j : j + 1] == candidates[:, :j]) & keep_c[:, :j]
        keep_c[:, j] &= ~seen.any(axis=1)
    # Stable sort of "dropped" flags moves the kept ones to the front in order.
    order = np.argsort(~keep_c, axis=1, kind="stable")
    packed = np.take_along_axis(np.where(keep_c, candidates, np.uint32(0)), order, axis=1)
    width = MAX_HOPS - 1
    if n > width and keep is not None:
        rows = np.flatnonzero(packed[:, width] != 0)
        if len(rows):
            sub = packed[rows]
            droppable = (sub != 0) & ~np.isin(sub, keep)
            oldest = n - 1 - np.argmax(droppable[:, ::-1], axis=1)
            drop = np.where(droppable.any(axis=1), oldest, n - 1)
            stay = np.ones(sub.shape, dtype=bool)
            stay[np.arange(len(rows)), drop] = False
            packed[rows, : n - 1] = sub[stay].reshape(len(rows), n - 1)
            packed[rows, n - 1 :] = 0
    out = np.zeros((len(first), width), dtype=np.uint32)
    out[:, : min(n, width)] = packed[:, : min(n, width)]
    return out


@dataclass(frozen=True)
class Policy:
    """How fast a table may change (config: ``vips[].beamer``)."""

    #: Seconds between two changes of one table: time for moved connections to drain.
    min_interval: float = 60.0
    #: Largest fraction of the buckets one adjustment moves (at least one bucket).
    max_step: float = 0.05

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_interval) and self.min_interval >= 0):
            raise ValueError(f"min_interval must be >= 0 seconds, got {self.min_interval}")
        if not 0 < self.max_step <= 1:
            raise ValueError(f"max_step must be in (0, 1], got {self.max_step}")

    def max_moves(self, size: int) -> int:
        """Buckets one adjustment of a ``size``-bucket table may move."""
        return max(1, math.floor(self.max_step * size))


def _check_size(size: int) -> int:
    size = operator.index(size)
    if not 1 <= size <= _U32_MAX:
        raise ValueError(f"table size must be in 1..{_U32_MAX}, got {size}")
    return size


def _check_weights(weights: Mapping[int, int]) -> dict[int, int]:
    """Backends of weight > 0, by ascending id, after checking every id and weight."""
    kept = {}
    for backend, weight in sorted(
        (operator.index(b), operator.index(w)) for b, w in weights.items()
    ):
        if not 1 <= backend <= _U32_MAX:
            raise ValueError(f"backend id must be in 1..{_U32_MAX} (0 means none), got {backend}")
        if weight < 0:
            raise ValueError(f"weight of backend {backend} is negative: {weight}")
        if weight > _U32_MAX:
            raise ValueError(f"weight of backend {backend} does not fit in 32 bits: {weight}")
        if weight:
            kept[backend] = weight
    if not kept:
        raise ValueError("no backend with a weight above 0: a Beamer table needs at least one")
    return kept


def targets(weights: Mapping[int, int], size: int) -> dict[int, int]:
    """Buckets each backend of weight > 0 should own, by ascending id; they sum to ``size``.

    Largest remainder (Hamilton): each gets ``floor(size * w / total)``, and the buckets
    left over go one each to the largest fractional parts, ties to the lower id.  A
    backend may get 0 when there are more backends than buckets.
    """
    size = _check_size(size)
    kept = _check_weights(weights)
    total = sum(kept.values())
    quotas = {b: divmod(size * w, total) for b, w in kept.items()}
    counts = {b: q for b, (q, _) in quotas.items()}
    left = size - sum(counts.values())
    for b in sorted(kept, key=lambda b: (-quotas[b][1], b))[:left]:
        counts[b] += 1
    return counts


def build(weights: Mapping[int, int], size: int = DEFAULT_SIZE) -> BeamerTable:
    """The initial table: one contiguous run per backend, in ascending id order.

    Run lengths are :func:`targets`; no bucket has a previous hop.  Raises ValueError if
    ``size`` is not in 1..2**32 - 1, an id is not in 1..2**32 - 1, a weight is
    negative or above 2**32 - 1, or no backend has a weight above 0.
    """
    counts = targets(weights, size)
    first = np.repeat(
        np.fromiter(counts, dtype=np.uint32, count=len(counts)),
        np.fromiter(counts.values(), dtype=np.int64, count=len(counts)),
    )
    return BeamerTable(
        first,
        np.zeros((size, MAX_HOPS - 1), dtype=np.uint32),
        np.zeros(size, dtype=np.uint64),
        0,
    )


def moved(old: BeamerTable, new: BeamerTable) -> int:
    """Buckets whose first hop differs between two tables of the same size."""
    if old.size != new.size:
        raise ValueError(f"tables of {old.size} and {new.size} buckets do not compare")
    return int(np.count_nonzero(old.first != new.first))


def adjust(
    table: BeamerTable,
    weights: Mapping[int, int],
    policy: Policy = Policy(),
    keep: Collection[int] = (),
) -> BeamerTable:
    """One step toward :func:`targets`: moves at most ``policy.max_moves(B)`` buckets.

    Returns ``table`` itself when every backend is at its target, or when no bucket can
    move yet (below).  A backend in the table but absent from ``weights`` (or of weight
    0) has target 0.  A moved bucket gets the receiver as first hop and, as previous
    hops, its old first hop followed by its old previous hops without the receiver, cut
    to ``MAX_HOPS - 1`` -- even when a backend left ``weights``: it still serves its
    established connections, and whether it is alive is the control plane's business
    (the data path skips an unusable hop).

    ``keep``: backends that may still hold connections (the agents' counts say which).
    A move never pushes one of them off a bucket's hop list: a bucket with a full list
    drops its oldest previous hop not in ``keep``, and one whose previous hops are all
    in ``keep`` does not move -- another of its donor's buckets does, or the move waits
    for a later step -- unless its donor has target 0 (a backend that left must take no
    new flow). Raises ValueError as :func:`targets` does.
    """
    size = table.size
    want = targets(weights, size)
    want_ids = np.fromiter(want, dtype=np.uint32, count=len(want))
    # Dense indexes in ascending id order: iterating them is iterating ids in order.
    ids = np.union1d(table.first, want_ids)
    fix = np.searchsorted(ids, table.first)
    have = np.bincount(fix, minlength=len(ids)).astype(np.int64)
    goal = np.zeros(len(ids), dtype=np.int64)
    goal[np.searchsorted(ids, want_ids)] = np.fromiter(want.values(), np.int64, len(want))
    surplus = np.maximum(have - goal, 0)
    deficit = np.maximum(goal - have, 0)
    total = int(surplus.sum())
    if total == 0:
        return table
    budget = min(policy.max_moves(size), total)
    # 1. Swaps: first hop a over target, most recent previous hop b under target: b
    #    takes the bucket back, reaching both targets, and a becomes its most recent
    #    previous hop -- the bucket's hop list only changes order.
    recent = table.hops[:, 0]
    six = np.searchsorted(ids, recent).clip(max=len(ids) - 1)
    known_recent = ids[six] == recent  # 0 and departed ids are never in ids
    swappable = np.flatnonzero((surplus[fix] > 0) & known_recent & (deficit[six] > 0))
    swapped: list[int] = []
    if len(swappable):
        key = _peel_key(table.first, deficit[fix] > 0)
        order = swappable[
            np.lexsort((swappable, *(k[swappable] for k in key), table.changed[swappable]))
        ]
        sur = surplus.tolist()
        dfc = deficit.tolist()
        for b, a, r in zip(order.tolist(), fix[order].tolist(), six[order].tolist(), strict=True):
            if sur[a] and dfc[r]:
                sur[a] -= 1
                dfc[r] -= 1
                swapped.append(b)
                if len(swapped) == budget:
                    break
        surplus = np.asarray(sur, dtype=np.int64)
        deficit = np.asarray(dfc, dtype=np.int64)

    first = table.first.copy()
    if swapped:
        taken = np.asarray(swapped, dtype=np.int64)
        first[taken] = recent[taken]
        fix = np.searchsorted(ids, first)

    # 2-3. The rest of the budget: donors give and receivers take in ascending id
    #      order, so a partly served backend is the first one served at the next step.
    rest = budget - len(swapped)
    keep_ids = np.fromiter(keep, dtype=np.uint32)
    if rest:
        give = _fill(surplus, rest)
        get = _fill(deficit, rest)
        key = _peel_key(first, get[fix] > 0)
        # A full hop list of kept backends only: moving would push one of them out.
        stuck = (table.hops[:, -1] != 0) & np.isin(table.hops, keep_ids).all(axis=1)
        eligible = np.flatnonzero((give[fix] > 0) & (~stuck | (goal[fix] == 0)))
        owner = fix[eligible]
        order = eligible[
            np.lexsort((eligible, *(k[eligible] for k in key), table.changed[eligible], owner))
        ]
        owner = fix[order]
        # Rank of each bucket among its donor's: the first give[donor] of them move.
        rank = np.arange(len(order)) - np.searchsorted(owner, owner)
        chosen = np.sort(order[rank < give[owner]])
        _deal(first, chosen, {int(ids[i]): int(get[i]) for i in np.flatnonzero(get)})

    old = table.first
    moves = np.flatnonzero(first != old)
    if not len(moves):
        return table  # every bucket that could move is stuck: wait
    generation = table.generation + 1
    hops = table.hops.copy()
    hops[moves] = _previous_hops(
        first[moves], np.concatenate((old[moves, None], table.hops[moves]), axis=1), keep_ids
    )
    changed = table.changed.copy()
    changed[moves] = generation
    return BeamerTable(first, hops, changed, generation)


def _fill(quota: I64Array, budget: int) -> I64Array:
    """Take ``budget`` from ``quota`` in index (= id) order: the first ones in full."""
    before: I64Array = np.cumsum(quota) - quota
    taken: I64Array = np.minimum(np.maximum(budget - before, 0), quota)
    return taken


def _peel_key(first: U32Array, receiving: npt.NDArray[np.bool_]) -> tuple[I64Array, ...]:
    """Sort keys (most significant first) that order a donor's buckets for contiguity.

    Runs are maximal stretches of one first hop.  A run that borders a receiver goes
    first (giving there extends the receiver's run), then shorter runs (giving a whole
    run away removes a fragment); within a run, buckets go from the receiver's end
    (both ends alternately if both border one), else from the highest index.
    """
    size = len(first)
    cut = np.flatnonzero(first[1:] != first[:-1]) + 1
    starts = np.concatenate(([0], cut)).astype(np.int64)
    ends = np.concatenate((cut, [size])).astype(np.int64)
    lengths = ends - starts
    lo_open = np.zeros(len(starts), dtype=bool)
    lo_open[1:] = receiving[starts[1:] - 1]
    hi_open = np.zeros(len(starts), dtype=bool)
    hi_open[:-1] = receiving[ends[:-1]]
    run = np.repeat(np.arange(len(starts)), lengths)
    index = np.arange(size, dtype=np.int64)
    from_lo = index - starts[run]
    from_hi = ends[run] - 1 - index
    lo, hi = lo_open[run], hi_open[run]
    dist = np.where(lo & hi, np.minimum(from_lo, from_hi), np.where(lo & ~hi, from_lo, from_hi))
    closed = (~(lo | hi)).astype(np.int64)
    return closed, lengths[run], starts[run], dist


def _deal(first: U32Array, chosen: I64Array, get: dict[int, int]) -> None:
    """Hand the ``chosen`` buckets (ascending) to receivers, ``get[id]`` each, in place.

    First to a receiver that borders a block of chosen buckets (its run grows; no new
    run), from the left and then from the right; the rest from the highest bucket down
    to receivers in ascending id order, so each gets a few contiguous stretches.
    """
    if not len(chosen):
        return
    size = len(first)
    cut = np.flatnonzero((np.diff(chosen) != 1) | (first[chosen[1:]] != first[chosen[:-1]])) + 1
    blocks = [
        [int(chosen[s]), int(chosen[e - 1]) + 1]
        for s, e in zip(
            np.concatenate(([0], cut)), np.concatenate((cut, [len(chosen)])), strict=True
        )
    ]
    for block in blocks:  # grow left neighbours rightwards, chaining across blocks
        lo, hi = block
        if lo > 0 and get.get(left := int(first[lo - 1]), 0):
            k = min(get[left], hi - lo)
            first[lo : lo + k] = left
            get[left] -= k
            block[0] += k
    for block in reversed(blocks):  # grow right neighbours leftwards
        lo, hi = block
        if lo < hi < size and get.get(right := int(first[hi]), 0):
            k = min(get[right], hi - lo)
            first[hi - k : hi] = right
            get[right] -= k
            block[1] -= k
    # From the highest index down: a donor run closed on both sides is peeled from its
    # high end, so the last receiver -- the one that may be only partly served and go on
    # at the next step -- ends up bordering what is left of the donor's run.
    receivers = iter([r for r in sorted(get) if get[r]])
    receiver = next(receivers, 0)
    for lo, hi in reversed(blocks):
        while lo < hi:
            while not get[receiver]:
                receiver = next(receivers)
            k = min(get[receiver], hi - lo)
            first[hi - k : hi] = receiver
            get[receiver] -= k
            hi -= k


class Scheduler:
    """When a table may change, sans-I/O: the caller passes the clock and remembers
    when the table last changed; each due step is one :func:`adjust`.
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def due(self, now: float, last_change: float | None) -> bool:
        """Whether ``min_interval`` has passed since the last change (or there was none)."""
        return last_change is None or now - last_change >= self.policy.min_interval

    def step(
        self,
        table: BeamerTable,
        weights: Mapping[int, int],
        now: float,
        last_change: float | None,
        keep: Collection[int] = (),
    ) -> BeamerTable | None:
        """The next table, or None: too early, every backend at its target, or no bucket
        can move yet (``keep``: see :func:`adjust`)."""
        if not self.due(now, last_change):
            return None
        new = adjust(table, weights, self.policy, keep)
        return None if new is table else new
