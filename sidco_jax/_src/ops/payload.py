"""Fixed-capacity sparse payloads: the entries above a threshold, in index order.

``jnp.nonzero(mask, size=k)`` is the obvious way to gather the selected
entries and, on XLA's CPU backend, several times slower than the ``lax.top_k``
that SIDCo sets out to beat. :func:`sparsify` instead

1. writes, in one pass over each vector, a uint32 bitmask word per 32 entries
   (bit ``j``: entry ``j`` of the word is above the threshold);
2. takes a cumulative sum of the bit counts of groups of 16 words over all
   vectors (two small matmuls with a triangular matrix, exact in float32
   because the partial sums stay small): the global prefix over the blocks;
3. binary-searches, for every slot ``j < capacity``, the group that holds the
   ``j``-th selected entry, finds its word from the group's 16 bit counts and
   the entry inside that one word from its bits (``capacity x 48`` integer
   operations, no gather of data rows);
4. gathers the ``capacity`` values from the vectors.

A model's leaves are never concatenated (on XLA's CPU backend, copying them
into one vector costs many passes): only the ``n / 32`` words are. Work is one
pass over ``n`` plus ``O(n / 32 + capacity * (48 + log n + leaves))``, and
every step is a dense vector operation that maps to GPU and TPU as well.
Entries past the capacity are not sent and are reported as overflow, so an
error-feedback residual keeps them. Formulations tried and their timings are
in ``docs/design.md``.

That is XLA:CPU's formulation. On GPU and TPU its binary searches and bit
tricks become hundreds of small kernels, so there a payload is formed from
per-block counts in a few dense kernels instead (:func:`_by_blocks`), chosen
as the program is lowered; both give the same payload.
"""

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from sidco_jax._src.base import (
    MAX_SIZE,
    check_capacity_factor,
    check_integer,
    check_ratio,
    check_scalar,
    cond_on_device,
    float_vectors,
    static,
)
from sidco_jax._src.ops import passes


class Payload(NamedTuple):
    """A fixed-size sparse representation of the entries above a threshold.

    The filled slots come first, in ascending index order, then the padding:
    every compressor's payload keeps that order, which compact index formats
    rely on (``indices="chunked"``).

    Attributes:
      values: ``(capacity,)`` selected values in index order, then zeros.
      indices: ``(capacity,)`` int32 positions in the flattened input; padding
        slots hold the input size (out of range, dropped by :func:`densify`).
      count: int32 number of filled slots, ``min(selected, capacity)``.
      selected: int32 number of entries above the threshold.
    """

    values: jax.Array
    indices: jax.Array
    count: jax.Array
    selected: jax.Array

    @property
    def overflow(self) -> jax.Array:
        """Entries above the threshold that did not fit (left for the residual)."""
        return self.selected - self.count


_TRI = 64  # width of the triangular matmuls of the cumulative sum
# Words per group of the global prefix: the prefix and its search run over n / 512
# groups, not n / 32 words (a cheaper payload on XLA's CPU backend, docs/design.md);
# each slot then finds its word among its group's 16.
_GROUP = 16


# Profiles (and benchmarks.overhead's phases) attribute what these functions
# run to the update's payload phase: see loop.py.
in_payload_phase = functools.partial(jax.named_call, name="payload")


def capacity(size: int, ratio: float, capacity_factor: float = 1.0) -> int:
    """Slots for ``ratio`` of ``size`` entries with headroom ``capacity_factor``.

    Returns ``ceil(capacity_factor * ratio * size)`` clipped to ``[1, size]``.

    Raises:
      TypeError: unless ``size`` is an integer and ``ratio`` and
        ``capacity_factor`` are real numbers (bools refused).
      ValueError: for ``size < 0``, ``ratio`` outside (0, 1], a
        ``capacity_factor`` below 1 or not finite, or a traced argument.

    Examples:
      >>> capacity(1_000_000, 0.001, capacity_factor=1.5)
      1500
    """
    size = check_integer("size", static("size", size), 0)
    ratio = check_ratio(static("ratio", ratio))
    return slots_for(size, ratio, check_capacity_factor(capacity_factor))


def slots_for(size: int, ratio: float, capacity_factor: float) -> int:
    """:func:`capacity` of arguments already checked (the compressors' own)."""
    return int(min(max(math.ceil(capacity_factor * ratio * size), 1), max(size, 1)))


def _cumsum(counts: jax.Array, bound: int) -> jax.Array:
    """Inclusive int32 cumsum of non-negative ``counts``, each at most ``bound``.

    Rows of ``_TRI`` entries are summed by a float32 matmul with a triangular
    matrix (exact while ``_TRI * bound < 2**24``), the row totals recursively.
    XLA's own cumsum on CPU is several times slower (docs/design.md).
    """
    m = counts.shape[0]
    if m <= 4 * _TRI or _TRI * bound >= 2**24:
        return jnp.cumsum(counts, dtype=jnp.int32)
    rows = -(-m // _TRI)
    padded = jnp.pad(counts, (0, rows * _TRI - m)).reshape(rows, _TRI)
    tri = jnp.triu(jnp.ones((_TRI, _TRI), jnp.float32))
    within = (padded.astype(jnp.float32) @ tri).astype(jnp.int32)
    totals = _cumsum(within[:, -1], _TRI * bound)
    return (within + (totals - within[:, -1])[:, None]).reshape(-1)[:m]


def _offsets(sizes: Sequence[int]) -> np.ndarray:
    return np.cumsum([0, *sizes]).astype(np.int64)


def gather(vectors: Sequence[jax.Array], indices: jax.Array) -> jax.Array:
    """Entries of the concatenated 1-D ``vectors`` at ``indices`` (0 out of range).

    Each vector is read at the indices that fall into it, without building the
    concatenation: ``O(len(vectors) x indices.size)``.
    """
    offsets = _offsets([v.shape[0] for v in vectors])
    out = None
    for v, start, stop in zip(vectors, offsets[:-1], offsets[1:], strict=True):
        inside = (indices >= start) & (indices < stop)
        local = jnp.clip(indices - int(start), 0, max(int(stop - start) - 1, 0))
        got = jnp.where(inside, v[local] if v.shape[0] else 0, jnp.zeros((), v.dtype))
        out = got if out is None else jnp.where(inside, got, out)
    return out


def draw_strata(key: jax.Array, n: int, k: int) -> tuple[jax.Array, np.ndarray, np.ndarray]:
    """One uniformly random index in each of ``k`` contiguous strata of ``range(n)``.

    The strata hold ``n // k`` entries, the first ``n % k`` one more, so every
    index is drawn with probability about ``k / n`` and none twice, at
    ``O(k)`` cost. Returns the int32 indices and the strata's static starts
    and widths.
    """
    j = np.arange(k, dtype=np.int64)
    start = j * (n // k) + np.minimum(j, n % k)
    width = n // k + (j < n % k)
    offset = jnp.floor(jax.random.uniform(key, (k,)) * width).astype(jnp.int32)
    drawn = jnp.asarray(start, jnp.int32) + jnp.minimum(offset, jnp.asarray(width - 1, jnp.int32))
    return drawn, start, width


def gather_strata(vectors: Sequence[jax.Array], drawn, start, width) -> jax.Array:
    """The entries at ``drawn`` (from :func:`draw_strata`), in some order, read part by part.

    Each vector reads the strata that lie wholly inside it with one gather;
    the few that straddle two vectors go through :func:`gather`. Cheaper than
    :func:`gather` over many vectors, and the same entries whatever the
    vectors' split.
    """
    offsets = _offsets([v.shape[0] for v in vectors])
    pieces, inside = [], np.zeros(len(start), bool)
    for v, a, b in zip(vectors, offsets[:-1], offsets[1:], strict=True):
        (mine,) = np.nonzero((start >= a) & (start + width <= b))
        if mine.size:  # a contiguous run of strata
            lo, hi = int(mine[0]), int(mine[-1]) + 1
            pieces.append(v[drawn[lo:hi] - int(a)])
            inside[lo:hi] = True
    (rest,) = np.nonzero(~inside)
    if rest.size:
        pieces.append(gather(vectors, drawn[rest]))
    return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def local_indices(indices: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """Per vector, ``indices`` made local to it (``size`` where outside: dropped by scatters)."""
    offsets = _offsets(sizes)
    return [
        jnp.where((indices >= start) & (indices < stop), indices - int(start), int(stop - start))
        for start, stop in itertools.pairwise(offsets)
    ]


def _searchsorted(sorted_counts: jax.Array, targets: jax.Array) -> jax.Array:
    """``jnp.searchsorted(..., side="left")``, in the form each backend runs fastest.

    The default form is a ``while`` loop of ``log2 n`` steps: on a GPU each
    step is a launch and a host round trip, so the unrolled form is faster
    there; on XLA's CPU backend the loop is (measured: docs/design.md).
    """
    search = functools.partial(jnp.searchsorted, sorted_counts, targets, side="left")
    return lax.platform_dependent(
        cpu=lambda: search(method="scan"), default=lambda: search(method="scan_unrolled")
    )


def _nth_bit(words: jax.Array, rank: jax.Array) -> jax.Array:
    """Position of the ``rank``-th (1-based) set bit of each uint32 word.

    A binary search on population counts, halves of 16, 8, 4, 2 and 1 bits:
    five elementwise steps. Counting the bits below each of the 32 positions
    instead took far longer on XLA's CPU backend (docs/design.md).
    """
    position = jnp.zeros(words.shape, jnp.int32)
    for width in (16, 8, 4, 2, 1):
        low = lax.population_count(words & jnp.uint32((1 << width) - 1)).astype(jnp.int32)
        beyond = rank > low
        rank = jnp.where(beyond, rank - low, rank)
        words = jnp.where(beyond, jnp.right_shift(words, jnp.uint32(width)), words)
        position = jnp.where(beyond, position + width, position)
    return position


@in_payload_phase
def select_above(
    vectors: Sequence[jax.Array],
    threshold: jax.Array,
    capacity: int,
    inclusive: bool = False,
) -> Payload:
    """:func:`sparsify` of 1-D float vectors, indexed over their concatenation.

    ``inclusive`` selects ``|x| >= threshold`` instead. Bitmask words on
    XLA:CPU, a few dense kernels over blocks elsewhere (:func:`_by_blocks`).
    """
    sizes = [v.shape[0] for v in vectors]
    n = sum(sizes)
    if n > MAX_SIZE:
        raise ValueError(f"sparsify supports at most 2**31 - 1 entries (int32 indices), got {n}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    dtype = jnp.result_type(*vectors) if vectors else jnp.float32
    if n == 0:
        zeros = jnp.zeros((capacity,), dtype)
        return Payload(zeros, jnp.zeros((capacity,), jnp.int32), jnp.int32(0), jnp.int32(0))
    threshold = jnp.asarray(threshold)  # a float64 one is compared in float64 with float64 x
    threshold = threshold.astype(jnp.promote_types(threshold.dtype, jnp.float32))
    vectors = [v for v in vectors if v.shape[0]]
    return passes.by_platform(
        lambda: _by_words(vectors, threshold, capacity, inclusive, dtype),
        lambda: _by_blocks(vectors, threshold, capacity, inclusive, dtype)[0],
        like=vectors,
    )


def fill_starved(
    payload: Payload, threshold, vectors, abs_sum, k: int
) -> tuple[Payload, jax.Array]:
    """``payload``, or where it selected nothing though ``abs_sum > 0``, the exact top-``k``
    (:func:`top_by_count`) in its slots; and the threshold that chose it (float32).

    Ties at the threshold (all-equal magnitudes, which error feedback keeps
    tied) or a threshold over the top would otherwise leave the paid-for
    payload empty step after step.
    """

    def top():
        top, t = top_by_count(vectors, k)
        return _padded(top, payload.values.shape[0], vectors), t

    starved = (payload.selected == 0) & (abs_sum > 0)
    return cond_on_device(starved, top, lambda: (payload, jnp.asarray(threshold, jnp.float32)))


def _padded(payload: Payload, capacity: int, vectors) -> Payload:
    """``payload`` in ``capacity`` slots: zeros and the padding index ``n`` after its own."""
    pad, n = capacity - payload.values.shape[0], sum(v.shape[0] for v in vectors)
    values = jnp.pad(payload.values, (0, pad))
    indices = jnp.pad(payload.indices, (0, pad), constant_values=n)
    return payload._replace(values=values, indices=indices)


@in_payload_phase
def select_or_top(
    vectors: Sequence[jax.Array],
    threshold,
    capacity: int,
    abs_sum,
    k: int | None = None,
    refit: tuple[Callable, Callable] | None = None,
) -> tuple[Payload, jax.Array]:
    """:func:`select_above` of float32 ``vectors``, or where nothing passes though
    ``abs_sum > 0``, their exact top-``k`` (default: ``capacity``) instead.

    The threshold rules' payload (:func:`fill_starved`). ``refit=(holds,
    fit)``: where ``holds(count)`` of the count above ``threshold`` is false,
    ``fit()``'s threshold instead, run only then (SIDCo's fill tries the last
    step's threshold so). On XLA:CPU the threshold's bitmask words give the
    count and the starved test, and only the words kept are compacted; on
    GPU and TPU the blocks' counts decide. Either way one payload is formed.
    Returns it and the float32 threshold that chose it.
    """
    k = capacity if k is None else k
    threshold = jnp.asarray(threshold, jnp.float32)
    live = [v for v in vectors if v.shape[0]]
    holds, fit = refit or (None, None)

    def refitted():
        return jnp.asarray(fit(), jnp.float32)

    def by_words():
        def words_refitted():
            eta = refitted()
            return _words(live, eta, False), eta

        words, eta = _words(live, threshold, False), threshold
        if refit is not None:
            count = jnp.sum(lax.population_count(words).astype(jnp.int32))
            words, eta = cond_on_device(holds(count), lambda: (words, eta), words_refitted)
        return _marked_or_top(live, words, eta, capacity, abs_sum, k)

    def by_blocks():
        eta = threshold
        if refit is not None:
            eta = cond_on_device(holds(passes.count_above(live, eta)), lambda: eta, refitted)
        return _by_blocks(live, eta, capacity, False, jnp.float32, fill=(abs_sum, k))

    return passes.by_platform(by_words, by_blocks, like=vectors)


def _marked_or_top(live, words, threshold, capacity: int, abs_sum, k: int):
    """The entries ``words`` mark, or where they mark none though ``abs_sum > 0``, the
    exact top-``k``'s (:func:`_top_words`), compacted (XLA:CPU); and the threshold.

    Each branch compacts its own words: compacted after the conditional, XLA:CPU fused
    the slots' index arithmetic into every leaf's gather (docs/design.md).
    """

    def top():
        t = kth_magnitude(live, k)
        return _top_words(live, k, t), t

    def compacted(words_and_threshold):
        words, threshold = words_and_threshold
        return _compact(words, _word_sizes(live), live, capacity, jnp.result_type(*live)), threshold

    starved = (jnp.sum(lax.population_count(words).astype(jnp.int32)) == 0) & (abs_sum > 0)
    return cond_on_device(starved, lambda: compacted(top()), lambda: compacted((words, threshold)))


_BLOCK = 128  # entries per block of _by_blocks (a TPU vector register's lanes)
_SUPER = 128  # blocks per superblock


def _prefix(counts: jax.Array) -> jax.Array:
    """Inclusive int32 prefix sums along the last (short) axis, as one compare-and-sum."""
    k = counts.shape[-1]
    upto = lax.broadcasted_iota(jnp.int32, (k, k), 0) <= lax.broadcasted_iota(jnp.int32, (k, k), 1)
    return jnp.sum(jnp.where(upto, counts[..., :, None], 0), axis=-2, dtype=jnp.int32)


def _rank_in(prefix: jax.Array, rank: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each ``rank``, the position in the inclusive ``prefix`` rows that reaches it,
    and the rank left inside that position: two reductions over the same compare."""
    before = prefix < rank[:, None]
    at = jnp.sum(before, axis=-1, dtype=jnp.int32)
    return at, rank - jnp.max(jnp.where(before, prefix, 0), axis=-1)


def _by_blocks(
    vectors, threshold, capacity: int, inclusive: bool, dtype, cutoff=None, fill=None
) -> tuple[Payload, jax.Array]:
    """The payload from per-block counts, for GPU and TPU: a few dense kernels, no sort.

    One pass counts the selected entries of every block of :data:`_BLOCK`;
    each slot then finds its block by comparing its rank with the blocks'
    prefix sums, superblock first (``capacity x (n / 2**14 + 128)``
    comparisons; the superblock's prefixes taken by a one-hot matmul, where
    a gather costs a TPU index kernels of its own), gathers that block's row
    and finds its entry from the row's prefix (a matmul with a triangular
    matrix, exact on 0/1 values).
    ``cutoff``: also the entries equal to the threshold below that index
    (:func:`_kth_entry`). ``fill``: ``(abs_sum, k)``: where nothing passes the
    threshold though ``abs_sum > 0``, the exact top-``k`` instead
    (:func:`select_or_top`), decided from the blocks' counts. Returns the
    payload and the threshold.
    """
    compare = jnp.greater_equal if inclusive else jnp.greater
    # NaN padding is never chosen.
    rows = [jnp.pad(v, (0, -v.shape[0] % _BLOCK), constant_values=jnp.nan) for v in vectors]
    rows = [row.reshape(-1, _BLOCK) for row in rows]
    starts = _offsets([v.shape[0] for v in vectors])
    columns = np.arange(_BLOCK, dtype=np.int32)

    def chosen(magnitudes, index, t, cutoff):
        t = t.astype(magnitudes.dtype)
        passing = compare(magnitudes, t)
        return passing if cutoff is None else passing | ((magnitudes == t) & (index < cutoff))

    def count(t, cutoff):  # entries chosen per block
        counts = []
        for start, r in zip(starts, rows, strict=False):
            index = int(start) + _BLOCK * lax.broadcasted_iota(jnp.int32, r.shape, 0) + columns
            counts.append(jnp.sum(chosen(jnp.abs(r), index, t, cutoff), 1, jnp.int32))
        return jnp.concatenate(counts) if len(counts) > 1 else counts[0]

    counts = count(threshold, cutoff)
    if fill is not None:
        threshold, cutoff, counts = _top_where_starved(vectors, threshold, counts, count, *fill)
    firsts = np.cumsum([0, *(r.shape[0] for r in rows)])
    blocks = int(firsts[-1])
    supers = -(-blocks // _SUPER)
    within = _prefix(jnp.pad(counts, (0, supers * _SUPER - blocks)).reshape(supers, _SUPER))
    upto = _prefix(within[:, -1])
    selected = upto[-1]

    rank = jnp.arange(1, capacity + 1, dtype=jnp.int32)
    top, rank = _rank_in(upto[None, :], rank)
    pick = lax.broadcasted_iota(jnp.int32, (capacity, supers), 1) == top[:, None]
    row = lax.dot(pick.astype(jnp.float32), within.astype(jnp.float32), precision="highest")
    inner, rank = _rank_in(row.astype(jnp.int32), rank)
    block = jnp.minimum(top * _SUPER + inner, blocks - 1)
    values, base = _rows_of(rows, firsts, vectors, block)
    square = (_BLOCK, _BLOCK)
    tri = lax.broadcasted_iota(jnp.int32, square, 0) <= lax.broadcasted_iota(jnp.int32, square, 1)
    picked = chosen(jnp.abs(values), base[:, None] + columns, threshold, cutoff)
    # Inclusive prefix counts along each row: exact for 0/1 in bfloat16.
    reach = lax.dot(
        picked.astype(jnp.bfloat16), tri.astype(jnp.bfloat16), preferred_element_type=jnp.float32
    )
    hit = picked & (reach.astype(jnp.int32) == rank[:, None])
    value = jnp.sum(jnp.where(hit, values, jnp.zeros((), values.dtype)), axis=1)
    column = jnp.sum(jnp.where(hit, columns, 0), axis=1)
    filled = jnp.arange(capacity) < selected
    indices = jnp.where(filled, base + column, int(starts[-1]))  # the entry count n
    values = jnp.where(filled, value, jnp.zeros((), dtype)).astype(dtype)
    payload = Payload(values, indices.astype(jnp.int32), jnp.minimum(selected, capacity), selected)
    return payload, threshold


def _top_where_starved(vectors, threshold, counts, count, abs_sum, k: int):
    """``threshold`` and its blocks' counts, or where nothing passes it though ``abs_sum > 0``,
    the ``k``-th magnitude's and the index cutoff of its ties (:func:`select_or_top`)."""

    def top():
        t, cutoff = _kth_entry(vectors, k)
        t = t.astype(threshold.dtype)
        return t, cutoff, count(t, cutoff)

    starved = (jnp.sum(counts) == 0) & (abs_sum > 0)
    keep = lambda: (threshold, jnp.zeros((), jnp.int32), counts)  # noqa: E731
    return cond_on_device(starved, top, keep)


def _rows_of(rows, firsts, vectors, block: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each slot's block row, and the index of the row's first entry over the concatenation."""
    values, base, start = None, None, 0
    for row, first, last, v in zip(rows, firsts[:-1], firsts[1:], vectors, strict=True):
        local = jnp.clip(block - int(first), 0, int(last - first) - 1)
        got, at = row.at[local].get(mode="promise_in_bounds"), start + local * _BLOCK
        inside = block >= first
        values = got if values is None else jnp.where(inside[:, None], got, values)
        base = at if base is None else jnp.where(inside, at, base)
        start += v.shape[0]
    return values, base


def _words(vectors, threshold, inclusive: bool, after=None) -> jax.Array:
    """Each non-empty vector's bitmask words (:func:`passes.block_words`), zero words
    up to a whole group after each (each vector starts a group), concatenated."""
    words = []
    for v in vectors:
        if v.shape[0]:
            after = passes.block_words(v, threshold.astype(v.dtype), after, inclusive, _GROUP)
            words.append(after)
    return jnp.concatenate(words) if len(words) > 1 else words[0]


def _word_sizes(vectors) -> list[int]:
    """Each non-empty vector's word count in :func:`_words`: whole groups of words."""
    words = [-(-v.shape[0] // passes.WORD) for v in vectors if v.shape[0]]
    return [-(-w // _GROUP) * _GROUP for w in words]


def _by_words(vectors, threshold, capacity: int, inclusive: bool, dtype) -> Payload:
    """The payload from bitmask words, for XLA:CPU (the module's docstring)."""
    words = _words(vectors, threshold, inclusive)
    return _compact(words, _word_sizes(vectors), vectors, capacity, dtype)


def _compact(words, word_sizes, vectors, capacity: int, dtype) -> Payload:
    """The entries whose bits ``words`` (:func:`_words` of ``vectors``) set, in index
    order, in ``capacity`` slots."""
    sizes = [v.shape[0] for v in vectors]
    n = sum(sizes)
    groups = words.reshape(-1, _GROUP)
    # Bits set in each group's words up to each word (exact in float32: at most 512).
    upto = lax.population_count(groups).astype(jnp.float32) @ jnp.triu(
        jnp.ones((_GROUP, _GROUP), jnp.float32)
    )
    upto = upto.astype(jnp.int32)
    cumulative = _cumsum(upto[:, -1], _GROUP * passes.WORD)
    selected = cumulative[-1]

    slot = jnp.arange(1, capacity + 1, dtype=jnp.int32)  # 1-based rank of the entry
    group_at = jnp.minimum(_searchsorted(cumulative, slot), groups.shape[0] - 1)
    rank = slot - jnp.where(group_at > 0, cumulative[group_at - 1], 0)
    # The word of the group that holds it: a binary search on the group's ``upto``.
    upto = upto.reshape(-1)
    first_word = group_at * _GROUP
    inner, half = jnp.zeros_like(group_at), _GROUP // 2
    while half:
        inner = jnp.where(rank > upto[first_word + inner + half - 1], inner + half, inner)
        half //= 2
    word_at = first_word + inner
    rank = rank - jnp.where(inner > 0, upto[jnp.maximum(word_at - 1, 0)], 0)
    word = groups.reshape(-1)[word_at]
    column = _nth_bit(word, rank)

    # Word -> first entry it covers: vector i's words start at word_offsets[i].
    entry_offsets = _offsets([s for s in sizes if s])
    word_offsets = _offsets(word_sizes)
    vector = jnp.searchsorted(jnp.asarray(word_offsets[1:-1], jnp.int32), word_at, side="right")
    first = jnp.asarray(entry_offsets[:-1], jnp.int32)[vector] + passes.WORD * (
        word_at - jnp.asarray(word_offsets[:-1], jnp.int32)[vector]
    )

    filled = slot <= selected
    indices = jnp.where(filled, first + column, n).astype(jnp.int32)
    values = jnp.where(filled, gather(vectors, indices), jnp.zeros((), dtype))
    return Payload(values, indices, jnp.minimum(selected, capacity), selected)


_PAST = np.iinfo(np.int32).max  # after every index


@in_payload_phase
def strongest(payload: Payload, capacity: int) -> Payload:
    """The ``capacity`` largest magnitudes of a wider payload, as a payload of ``capacity`` slots.

    Work on the payload's slots only, nothing of size ``n``: a selection that
    overflows keeps its largest entries rather than its first ones in index
    order, ties going to the lower index. On XLA's CPU backend they are found
    by counting (:func:`top_by_count`, faster there than ``lax.top_k``:
    docs/design.md); elsewhere by ``lax.top_k``.
    """
    magnitudes = jnp.abs(payload.values)

    def by_count():  # XLA:CPU
        pick = top_by_count([magnitudes], capacity)[0].indices
        # The picked slots in slot order, so the index order holds.
        picked = jnp.zeros(magnitudes.shape, jnp.int32).at[pick].set(1)
        at = jnp.where(picked > 0, _cumsum(picked, 1) - 1, capacity)
        values = jnp.zeros(capacity, payload.values.dtype).at[at].set(payload.values, mode="drop")
        return values, jnp.zeros(capacity, jnp.int32).at[at].set(payload.indices, mode="drop")

    def by_sort():  # GPU, TPU: two sorts that carry the slots along, no gather
        # Largest first, ties in slot order (the lower index), as lax.top_k; then the
        # first capacity back in index order.
        keys = (-magnitudes, payload.indices, payload.values)
        _, indices, values = lax.sort(keys, num_keys=1, is_stable=True)
        # Past the first capacity, past every index: sliced after the sort (one kernel less).
        keep = jnp.arange(indices.shape[0]) < capacity
        indices, values = lax.sort((jnp.where(keep, indices, _PAST), values), num_keys=1)
        return values[:capacity], indices[:capacity]

    values, indices = passes.by_platform(by_count, by_sort, like=magnitudes)
    selected = jnp.asarray(payload.selected, jnp.int32)
    return Payload(values, indices, jnp.minimum(selected, capacity), selected)


TopK = Callable[[jax.Array, int], Sequence[jax.Array]]
"""``top_k(x, k) -> (values, indices)`` of 1-D ``x``, as ``lax.top_k``."""


def exact_top(vectors, k: int, capacity: int, selected) -> tuple[Payload, jax.Array]:
    """:func:`largest`'s payload and k-th magnitude; on GPU and TPU by counting
    (:func:`top_by_count`), where ``lax.top_k`` sorts the whole gradient."""

    def by_count():
        top, t = top_by_count(vectors, k)
        chosen = jnp.asarray(selected, jnp.int32)
        top = _padded(top, capacity, vectors)
        return top._replace(count=jnp.minimum(chosen, k), selected=chosen), t

    return passes.by_platform(
        lambda: largest(vectors, k, capacity, selected), by_count, like=vectors
    )


@in_payload_phase
def largest(
    vectors: Sequence[jax.Array], k: int, capacity: int, selected, top_k: TopK = lax.top_k
) -> tuple[Payload, jax.Array]:
    """Top-k over 1-D ``vectors`` as a payload of ``capacity >= k`` slots.

    Each vector's own top-k, then the top-k of those candidates: exact with
    the default ``top_k`` (``lax.top_k``), and nothing of size ``n`` is
    concatenated. Another ``top_k`` with its signature (``lax.approx_max_k``)
    picks both the candidates and the final ``k``. Returns the payload and the
    k-th magnitude (the least of those picked).
    """
    n = sum(v.shape[0] for v in vectors)
    offset, mags, idx = 0, [], []
    for v in vectors:
        if v.shape[0]:
            m, i = top_k(jnp.abs(v), min(k, v.shape[0]))
            mags.append(m)
            idx.append(i.astype(jnp.int32) + offset)
        offset += v.shape[0]
    if len(mags) == 1:
        (mags,), (idx,) = mags, idx
    else:
        mags, pick = top_k(jnp.concatenate(mags), k)
        idx = jnp.concatenate(idx)[pick]
    idx = jnp.sort(idx)  # top_k's order is by magnitude; a payload's is by index
    pad = capacity - k
    values = jnp.pad(gather(vectors, idx), (0, pad))
    indices = jnp.pad(idx, (0, pad), constant_values=n)
    # jnp.min, not mags[-1]: slicing top_k's output sent XLA's CPU backend down a
    # far slower path (docs/design.md).
    # count from ``selected`` (data), not a constant: under shard_map a constant
    # is device-invariant and lax.cond in dgc needs both branches to vary alike.
    selected = jnp.asarray(selected, jnp.int32)
    payload = Payload(values, indices, jnp.minimum(selected, k), selected)
    return payload, jnp.min(mags)


_WAYS = 8  # candidates per counting pass of kth_magnitude (7 counts cost about one pass)


def kth_magnitude(vectors: Sequence[jax.Array], k: int) -> jax.Array:
    """The exact ``k``-th largest ``|x|`` over 1-D ``vectors``, by counting passes only.

    Non-negative float32 values order as their bit patterns, so a search over
    the patterns below ``max |x|`` narrows to the one value ``t`` with fewer
    than ``k`` entries above it and at least ``k`` at or above it: each pass
    counts ``|x| > c`` for ``_WAYS - 1`` candidates ``c`` and keeps the gap
    that holds ``t``, 11 passes in all. Unlike ``lax.top_k``, which sorts on a
    GPU (temporaries of the gradient's size, even for a rarely taken branch),
    it needs nothing of size ``n``. ``0`` where fewer than ``k`` are nonzero.
    """
    vectors = [v for v in vectors if v.shape[0]]
    (top,) = passes.reduce_each(vectors, [lambda v, z: jnp.abs(v.astype(jnp.float32))], op=jnp.max)

    def narrow(_, bounds):
        # Invariant: count(|x| > lo) >= k > count(|x| > hi), lo = -1 standing below 0.
        lo, hi = bounds
        candidates = _between(lo, hi)
        counts = passes.counts_above(vectors, lax.bitcast_convert_type(candidates, jnp.float32), hi)
        filled = counts >= k
        lo = jnp.max(jnp.where(filled, candidates, lo))
        hi = jnp.min(jnp.where(filled, hi, candidates))
        return lo, hi

    hi = lax.bitcast_convert_type(top, jnp.int32)
    _, hi = lax.fori_loop(0, _passes(2**31), narrow, (hi * 0 - 1, hi))  # lo varies like the data
    return lax.bitcast_convert_type(hi, jnp.float32)


def _kth_entry(vectors, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k``-th magnitude ``t`` (:func:`kth_magnitude`) and the least index ``c`` at
    which the entries above ``t``, with those equal to it below ``c``, number ``k``: the
    top-``k``, ties going to the lower index (GPU and TPU).

    One loop of counting passes narrows ``t``'s bit pattern, then ``c``: a pass
    counts ``|x| > a`` or ``|x| == a`` below ``d`` for ``_WAYS - 1`` candidates.
    """
    starts = _offsets([v.shape[0] for v in vectors])
    n = int(starts[-1])
    (top,) = passes.reduce_each(vectors, [lambda v, z: jnp.abs(v.astype(jnp.float32))], op=jnp.max)
    magnitude_passes = _passes(2**31)

    def narrow(i, bounds):
        # Invariants: count(|x| > lo) >= k > count(|x| > hi), lo = -1 standing below 0;
        # then, t = hi, count(below) < k <= count(upto), counting ties below the cutoff.
        lo, hi, below, upto = bounds
        cutting = i >= magnitude_passes
        at = jnp.where(cutting, hi, _between(lo, hi))
        cut = jnp.where(cutting, _between(below, upto), 0)
        a = lax.bitcast_convert_type(at, jnp.float32)
        counts = jnp.zeros_like(at)
        for start, v in zip(starts, vectors, strict=False):
            m = jnp.abs(v.astype(jnp.float32))[:, None]
            index = int(start) + lax.broadcasted_iota(jnp.int32, m.shape, 0)
            counts += jnp.sum((m > a) | ((m == a) & (index < cut)), 0, jnp.int32)
        filled = counts >= k
        lo = jnp.where(cutting, lo, jnp.max(jnp.where(filled, at, lo)))
        hi = jnp.where(cutting, hi, jnp.min(jnp.where(filled, hi, at)))
        below = jnp.where(cutting, jnp.max(jnp.where(filled, below, cut)), below)
        upto = jnp.where(cutting, jnp.min(jnp.where(filled, cut, upto)), upto)
        return lo, hi, below, upto

    hi = lax.bitcast_convert_type(top, jnp.int32)
    zero = hi * 0  # varies like the data
    iterations = magnitude_passes + _passes(n)
    _, hi, _, cutoff = lax.fori_loop(0, iterations, narrow, (zero - 1, hi, zero, zero + n))
    return lax.bitcast_convert_type(hi, jnp.float32), cutoff


def _between(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """``_WAYS - 1`` integers that cut ``(lo, hi)`` into ``_WAYS`` gaps of near-equal width."""
    ways = jnp.arange(1, _WAYS, dtype=jnp.int32)
    width = hi - lo
    return lo + (width // _WAYS) * ways + jnp.minimum(ways, width % _WAYS)


def _passes(width: int) -> int:
    """Counting passes that narrow a gap of ``width`` to one: ``gap // _WAYS + 1`` after each."""
    passes_ = 0
    while width > 1:
        width, passes_ = width // _WAYS + 1, passes_ + 1
    return passes_


@in_payload_phase
def top_by_count(vectors: Sequence[jax.Array], k: int) -> tuple[Payload, jax.Array]:
    """Exact top-``k`` magnitudes of 1-D ``vectors`` as a payload of ``k`` slots, and the k-th.

    The same entries as ``lax.top_k`` over the concatenation (ties go to the
    lower index), found with :func:`kth_magnitude` and one compaction instead
    of a sort: every entry above the k-th magnitude ``t``, and the first of
    those equal to ``t``, in index order.
    """
    return passes.by_platform(
        lambda: _top_by_words(vectors, k), lambda: _top_by_blocks(vectors, k), like=vectors
    )


def _top_by_blocks(vectors, k: int) -> tuple[Payload, jax.Array]:
    """:func:`top_by_count`'s payload in one compaction with ties (GPU and TPU)."""
    live = [v for v in vectors if v.shape[0]]
    t, cutoff = _kth_entry(live, k)
    payload, _ = _by_blocks(live, t, k, False, jnp.result_type(*live), cutoff)
    count = jnp.minimum(payload.selected, k)  # k, from data (it varies like the rest)
    return payload._replace(count=count, selected=count), t


def _top_by_words(vectors, k: int) -> tuple[Payload, jax.Array]:
    """:func:`top_by_count`'s payload in one compaction of bitmask words (XLA:CPU): the
    words of the entries above the k-th magnitude, and of the first ties at it."""
    t = kth_magnitude(vectors, k)
    live = [v for v in vectors if v.shape[0]]
    payload = _compact(_top_words(live, k, t), _word_sizes(live), live, k, jnp.result_type(*live))
    count = jnp.minimum(payload.selected, k)  # k, from data (it varies like the rest)
    return payload._replace(count=count, selected=count), t


def _top_words(live, k: int, t: jax.Array) -> jax.Array:
    """The bitmask words of the top-``k`` magnitudes, ``t`` the k-th: every entry above
    ``t``, and the first of those equal to it."""
    above = _words(live, t, False)
    at_least = _words(live, t, True, after=above)
    ties = k - jnp.sum(lax.population_count(above).astype(jnp.int32))
    return above | _first_bits(at_least & ~above, ties)


def _first_bits(words: jax.Array, count: jax.Array) -> jax.Array:
    """``words`` with only their first ``count`` set bits (in entry order) left set."""
    bits = lax.population_count(words).astype(jnp.int32)
    left = count - (_cumsum(bits, passes.WORD) - bits)  # still to take at each word
    # Cut inside a word (0 < left < bits): the last bit taken is below bit 31.
    last = _nth_bit(words, jnp.clip(left, 1, passes.WORD - 1))
    upto = jnp.left_shift(jnp.uint32(1), (last + 1).astype(jnp.uint32)) - jnp.uint32(1)
    return jnp.where(left >= bits, words, jnp.where(left > 0, words & upto, jnp.uint32(0)))


def sparsify(x: Any, threshold: jax.Array, capacity: int) -> Payload:
    """The entries of ``x`` with ``|x| > threshold``, packed into ``capacity`` slots.

    Args:
      x: a float array of any shape, or a pytree of them (a gradient tree):
        indices run over the concatenation of its leaves, each flattened
        row-major, in ``jax.tree.leaves`` order. Nothing is concatenated.
      threshold: scalar magnitude threshold, may be traced (NaN selects nothing);
        a float64 one (under x64) is compared in float64 with float64 leaves.
      capacity: static number of slots, an int ``>= 1``.

    Returns:
      A :class:`Payload`; the first ``capacity`` selected entries in index
      order fill it, the rest count as overflow.

    Raises:
      ValueError: if ``x`` has more than ``2**31 - 1`` entries, ``capacity < 1``
        or ``capacity`` is traced.
      TypeError: if a leaf of ``x`` is not a floating-point array, ``threshold``
        is not a real scalar or ``capacity`` not an integer (bools refused).

    Examples:
      >>> import jax.numpy as jnp
      >>> p = sparsify(jnp.array([0.5, -3.0, 0.1, 2.0, -4.0]), 1.0, capacity=2)
      >>> p.values, p.indices, int(p.count), int(p.overflow)
      (Array([-3.,  2.], dtype=float32), Array([1, 3], dtype=int32), 2, 1)
    """
    check_scalar("threshold", threshold)
    capacity = check_integer("capacity", static("capacity", capacity))  # its range: select_above
    return select_above(float_vectors(x, "sparsify"), threshold, capacity)


def scatter(values: jax.Array, indices: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
    """Scatter-adds ``values`` at global ``indices`` into one zero vector per size.

    Duplicate indices accumulate; indices outside every vector are dropped.
    """
    values, indices = values.reshape(-1), indices.reshape(-1)
    out = []
    for size, local in zip(sizes, local_indices(indices, sizes), strict=True):
        # A zero that XLA cannot fold (local indices are >= 0): constant zero
        # vectors of equal sizes would be merged into one buffer and copied for
        # each in-place scatter.
        zero = jnp.minimum(local[0], 0).astype(values.dtype)
        out.append(jnp.broadcast_to(zero, (size,)).at[local].add(values, mode="drop"))
    return out


def _check_fits(payload: Payload, size: int) -> None:
    """Refuses a ``size`` that would drop an entry of a filled slot, where the indices are known."""
    indices, count = payload.indices, payload.count
    if isinstance(indices, jax.core.Tracer) or isinstance(count, jax.core.Tracer):
        return
    indices, count = np.asarray(indices), np.asarray(count)
    filled = np.arange(indices.shape[-1]) < count[..., None]
    top = int(indices[filled].max()) if filled.any() else -1
    if top >= size:
        raise ValueError(
            f"densify: size {size} would drop the payload's entry {top} (and any above "
            f"it): size must be at least {top + 1}, the size of what was sparsified"
        )


def densify(payload: Payload, size: int, dtype: DTypeLike | None = None) -> jax.Array:
    """Scatter-adds one or many payloads into a dense vector of ``size`` entries.

    Args:
      payload: a :class:`Payload`, or one whose arrays carry leading axes (for
        example the payloads of all devices stacked by ``all_gather``).
        Duplicate indices accumulate; padding slots are dropped.
      size: length of the dense vector, an int ``>= 0``: at least the size of
        what was sparsified.
      dtype: result dtype (default: the payload values' dtype).

    Returns:
      ``(size,)`` vector.

    Raises:
      ValueError: for a ``size`` below 0, traced, or below an index of a
        filled slot (checked where the payload is concrete; under ``jit``,
        where the indices are not known, such an entry would be dropped).
      TypeError: for a ``size`` that is not an integer (bools refused).

    Examples:
      >>> import jax.numpy as jnp
      >>> p = sparsify(jnp.array([0.5, -3.0, 0.1, 2.0]), 1.0, capacity=3)
      >>> densify(p, 4)
      Array([ 0., -3.,  0.,  2.], dtype=float32)
    """
    size = check_integer("size", static("size", size), 0)
    _check_fits(payload, size)
    dtype = payload.values.dtype if dtype is None else dtype
    (dense,) = scatter(payload.values.astype(dtype), payload.indices, [size])
    return dense
