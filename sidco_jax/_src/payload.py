"""Fixed-capacity sparse payloads: the entries above a threshold, in index order.

``jnp.nonzero(mask, size=k)`` is the obvious way to gather the selected
entries and, on XLA's CPU backend, several times slower than the ``lax.top_k``
that SIDCo sets out to beat. :func:`sparsify` instead

1. counts the selected entries of each block of ``B`` entries (one pass),
2. takes a cumulative sum of those ``n / B`` counts (two small matmuls with a
   triangular matrix, exact in float32 because the partial sums stay small),
3. binary-searches, for every slot ``j < capacity``, the block that holds the
   ``j``-th selected entry, and
4. finds the entry inside the gathered ``capacity x B`` rows.

Work is one pass over ``n`` plus ``O(n / B + capacity * (B + log n))``, and
every step is a dense vector operation that maps to GPU and TPU as well.
Entries past the capacity are not sent and are reported as overflow, so an
error-feedback residual keeps them. Formulations tried and their timings are
in ``docs/benchmarks.md``.
"""

import math

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from sidco_jax._src import passes
from sidco_jax._src.base import MAX_SIZE, Payload, check_capacity_factor, check_ratio

_MIN_BLOCK, _MAX_BLOCK = 4, 32  # wider rows make the counting pass 7x slower on CPU
_TRI = 64  # width of the triangular matmuls of the cumulative sum


def capacity(size: int, ratio: float, capacity_factor: float = 1.0) -> int:
    """Slots for ``ratio`` of ``size`` entries with headroom ``capacity_factor``.

    Returns ``ceil(capacity_factor * ratio * size)`` clipped to ``[1, size]``.

    Raises:
      ValueError: for ``ratio`` outside (0, 1] or ``capacity_factor < 1``.

    Examples:
      >>> capacity(1_000_000, 0.001, capacity_factor=1.5)
      1500
    """
    check_ratio(ratio)
    check_capacity_factor(capacity_factor)
    return int(min(max(math.ceil(capacity_factor * ratio * size), 1), max(size, 1)))


def _block(size: int, slots: int) -> int:
    """Block length balancing the ``n / B`` cumsum against the ``capacity * B`` rows."""
    best = 2 ** round(math.log2(max(math.sqrt(size / slots), 1.0)))
    return int(min(max(best, _MIN_BLOCK), _MAX_BLOCK, max(size, 1)))


def _cumsum(counts: jax.Array, bound: int) -> jax.Array:
    """Inclusive int32 cumsum of non-negative ``counts``, each at most ``bound``.

    Rows of ``_TRI`` entries are summed by a float32 matmul with a triangular
    matrix (exact while ``_TRI * bound < 2**24``), the row totals recursively.
    XLA's own cumsum on CPU is ~5x slower.
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


def sparsify(
    x: jax.Array, threshold: jax.Array, capacity: int, *, block: int | None = None
) -> Payload:
    """The entries of ``x`` with ``|x| > threshold``, packed into ``capacity`` slots.

    Args:
      x: array of any shape; it is flattened (row-major).
      threshold: scalar magnitude threshold (NaN selects nothing).
      capacity: static number of slots.
      block: static block length of the search; by default chosen from
        ``x.size`` and ``capacity``.

    Returns:
      A :class:`Payload`; the first ``capacity`` selected entries in index
      order fill it, the rest count as overflow.

    Raises:
      ValueError: if ``x`` has more than ``2**31 - 1`` entries or ``capacity < 1``.
      TypeError: if ``x`` is not a floating-point array.

    Examples:
      >>> import jax.numpy as jnp
      >>> p = sparsify(jnp.array([0.5, -3.0, 0.1, 2.0, -4.0]), 1.0, capacity=2)
      >>> p.values, p.indices, int(p.count), int(p.overflow)
      (Array([-3.,  2.], dtype=float32), Array([1, 3], dtype=int32), 2, 1)
    """
    x = jnp.ravel(x)
    n = x.shape[0]
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"sparsify needs a floating-point array, got {x.dtype}")
    if n > MAX_SIZE:
        raise ValueError(f"sparsify supports at most 2**31 - 1 entries (int32 indices), got {n}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if n == 0:
        zeros = jnp.zeros((capacity,), x.dtype)
        return Payload(zeros, jnp.zeros((capacity,), jnp.int32), jnp.int32(0), jnp.int32(0))
    block = _block(n, capacity) if block is None else min(int(block), n)
    threshold = jnp.asarray(threshold, jnp.float32).astype(x.dtype)

    counts = passes.block_counts(x, threshold, block)
    cumulative = _cumsum(counts, block)
    selected = cumulative[-1]

    slot = jnp.arange(1, capacity + 1, dtype=jnp.int32)  # 1-based rank of the entry
    row = jnp.minimum(jnp.searchsorted(cumulative, slot, side="left"), counts.shape[0] - 1)
    rank = slot - jnp.where(row > 0, cumulative[row - 1], 0)

    full = n // block
    rows = x[: full * block].reshape(full, block)[jnp.minimum(row, max(full - 1, 0))]
    if n % block:
        # NaN padding never compares above a threshold.
        tail = jnp.pad(x[full * block :], (0, block - n % block), constant_values=jnp.nan)
        rows = jnp.where((row == full)[:, None], tail, rows)
    hits = (jnp.abs(rows) > threshold).astype(jnp.float32)
    hits_before = hits @ jnp.triu(jnp.ones((block, block), jnp.float32))
    column = jnp.minimum(jnp.sum(hits_before < rank[:, None], axis=1, dtype=jnp.int32), block - 1)

    filled = slot <= selected
    values = jnp.take_along_axis(rows, column[:, None], axis=1)[:, 0]
    values = jnp.where(filled, values, jnp.zeros((), x.dtype))
    indices = jnp.where(filled, row * block + column, n).astype(jnp.int32)
    return Payload(values, indices, jnp.minimum(selected, capacity), selected)


def densify(payload: Payload, size: int, dtype: DTypeLike | None = None) -> jax.Array:
    """Scatter-adds one or many payloads into a dense vector of ``size`` entries.

    Args:
      payload: a :class:`Payload`, or one whose arrays carry leading axes (for
        example the payloads of all devices stacked by ``all_gather``).
        Duplicate indices accumulate; padding slots are dropped.
      size: length of the dense vector.
      dtype: result dtype (default: the payload values' dtype).

    Returns:
      ``(size,)`` vector.

    Examples:
      >>> import jax.numpy as jnp
      >>> p = sparsify(jnp.array([0.5, -3.0, 0.1, 2.0]), 1.0, capacity=3)
      >>> densify(p, 4)
      Array([ 0., -3.,  0.,  2.], dtype=float32)
    """
    dtype = payload.values.dtype if dtype is None else dtype
    dense = jnp.zeros((size,), dtype)
    return dense.at[payload.indices.reshape(-1)].add(
        payload.values.reshape(-1).astype(dtype), mode="drop"
    )
