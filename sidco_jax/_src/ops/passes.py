"""Full-length reductions that each stream their inputs once.

Every function here takes one array or a sequence of arrays (the leaves of a
gradient tree, never concatenated: copying a model's leaves into one vector
costs far more than a pass over them) and reduces over all their entries.

XLA merges identical sub-expressions of several reductions over the same array
and then materialises the shared elementwise producer (``|x|``, a broadcast
zero, ...) as a full-size temporary: on XLA's CPU backend a count plus a sum
then cost several times what each costs alone (docs/design.md, "Thresholds and
passes"). Each reduction here is fed through
``lax.optimization_barrier`` together with the previous result: nothing can
be shared, every pass reads its input directly, and the passes run in order.
Scalars, including the zero used by ``relu``, travel through the barrier too,
so that no broadcast constant is shared between passes.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sidco_jax._src.base import platform_of

Term = Callable[..., jax.Array]
Operands = jax.Array | Sequence[Any]

WORD = 32  # entries per bitmask word (uint32)
_ALIGN = 64  # block_words' main row reduction covers a multiple of this many words


_FORMULATION: str | None = None  # None: by platform; "words" or "blocks" forces one


@contextlib.contextmanager
def formulation(name: str):
    """Within it, passes and payloads trace with one formulation on every backend (for
    tests that check the accelerators' on the CPU): ``"words"`` (XLA:CPU's) or
    ``"blocks"`` (GPU and TPU: plain reductions that XLA fuses as it likes). ``jax.jit``
    caches a function's trace, so jit a function made inside."""
    global _FORMULATION
    saved, _FORMULATION = _FORMULATION, name
    try:
        yield
    finally:
        _FORMULATION = saved


def by_platform(cpu, default, like):
    """``cpu()`` for XLA:CPU, ``default()`` for GPU and TPU, by the platform the arrays
    ``like`` are for (:func:`~sidco_jax._src.base.platform_of`).

    Decided at trace time, so only one formulation is traced: a TPU program
    traced on a CPU host under a TPU mesh (or from TPU-sharded inputs) gets
    the TPU's.
    """
    if _FORMULATION is not None:
        return (cpu if _FORMULATION == "words" else default)()
    return (cpu if platform_of(like) == "cpu" else default)()


def as_list(xs: Operands) -> list:
    """``xs`` as a list of operands (one array becomes a list of one)."""
    return [xs] if isinstance(xs, jax.Array | np.ndarray) else list(xs)


def size(xs: Operands) -> int:
    """Total number of entries of an array or a sequence of arrays."""
    return sum(int(np.prod(jnp.shape(x))) for x in as_list(xs))


def reduce_parts(
    xs: Operands,
    term: Term,
    scalars: Sequence[jax.Array] = (),
    after=None,
    op: Callable[..., jax.Array] = jnp.sum,
) -> list[jax.Array]:
    """``[op(term(x, zero, *scalars)) for x in xs]``, one ordered pass per operand.

    Args:
      xs: an array or a sequence of operands; an operand is an array or a
        tuple of same-shaped arrays that ``term`` combines.
      term: elementwise function ``term(x, zero, *scalars)``; ``zero`` is a
        float32 scalar 0 to use instead of literal constants (see module doc).
      scalars: scalar operands of the term.
      after: optional array the first pass is ordered after.
      op: the reduction, ``jnp.sum`` (default) or ``jnp.max``.

    Returns:
      One float32 scalar per operand.
    """

    def ordered():
        token = jnp.zeros((), jnp.float32) if after is None else after
        out = []
        for x in as_list(xs):
            xb, sb, zero, _ = lax.optimization_barrier(
                (x, tuple(scalars), jnp.zeros((), jnp.float32), token)
            )
            token = op(term(xb, zero, *sb).astype(jnp.float32))
            out.append(token)
        return out

    def plain():
        zero = jnp.zeros((), jnp.float32)
        return [op(term(x, zero, *scalars).astype(jnp.float32)) for x in as_list(xs)]

    return by_platform(ordered, plain, like=xs)


def reduce_each(
    xs: Operands,
    terms: Sequence[Term],
    scalars: Sequence[jax.Array] = (),
    after=None,
    op: Callable[..., jax.Array] = jnp.sum,
) -> list[jax.Array]:
    """Returns ``[op(term(x, zero, *scalars) over all of xs) for term in terms]``.

    One pass per term and operand (see :func:`reduce_parts` for the arguments).

    Returns:
      One float32 scalar per term.
    """
    combine = jnp.maximum if op is jnp.max else jnp.add
    out = []
    for term in terms:
        parts = reduce_parts(xs, term, scalars, after, op)
        total = parts[0]
        for part in parts[1:]:
            total = combine(total, part)
        out.append(total)
        after = total
    return out


def block_words(
    x: jax.Array, threshold: jax.Array, after=None, inclusive: bool = False, multiple: int = 1
) -> jax.Array:
    """Bitmasks of ``|x| > threshold`` over consecutive words of 32 entries.

    Bit ``j`` of word ``w`` is set when entry ``32 w + j`` of the 1-D ``x`` is
    above the threshold; the last word may be partly filled.

    Args:
      x: 1-D array.
      threshold: scalar magnitude threshold (in ``x``'s dtype or float32).
      after: optional array this pass is ordered after.
      inclusive: select ``|x| >= threshold`` instead.
      multiple: zero words are appended up to a multiple of this many words.

    Returns:
      uint32 array of ``ceil(x.size / 32)`` words, padded to ``multiple``.
    """
    n = x.shape[0]
    full = n // WORD
    # XLA's CPU backend runs the row reduction fast only over a row count it can
    # split evenly, so the last few rows are reduced apart (docs/design.md).
    body = full - full % _ALIGN
    count = full + (1 if n % WORD else 0)
    token = jnp.zeros((), jnp.float32) if after is None else after
    x, threshold, _ = lax.optimization_barrier((x, threshold, token))
    bits = jnp.left_shift(jnp.uint32(1), jnp.arange(WORD, dtype=jnp.uint32))
    compare = jnp.greater_equal if inclusive else jnp.greater

    def words(start, stop):  # the words of entries [start, stop)
        above = compare(jnp.abs(x[start:stop]).reshape(-1, WORD), threshold)
        return jnp.sum(jnp.where(above, bits, jnp.uint32(0)), axis=1, dtype=jnp.uint32)

    parts = [words(0, body * WORD)] if body else []
    if body < count or count % multiple:
        # Keep the rest out of the main fusion: fused, it slowed the whole pass.
        parts = list(lax.optimization_barrier(parts))
    if body < full:
        parts.append(words(body * WORD, full * WORD))
    if n % WORD:
        tail = compare(jnp.abs(x[full * WORD :]), threshold)
        parts.append(jnp.sum(jnp.where(tail, bits[: n % WORD], jnp.uint32(0)), dtype=jnp.uint32))
    if count % multiple:
        parts.append(jnp.zeros((multiple - count % multiple,), jnp.uint32))
    parts = [jnp.reshape(p, (-1,)) for p in parts] or [jnp.zeros((0,), jnp.uint32)]
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _add_all(a, b):
    return tuple(x + y for x, y in zip(a, b, strict=True))


def _row_sums(
    xs: Operands, elementwise, scalars: Sequence[jax.Array], after, width: int
) -> list[jax.Array]:
    """Sums of the arrays ``elementwise(v, zero, *scalars)`` returns, in one pass per operand.

    One variadic row reduction over rows of ``width`` entries sums every
    output together (separate passes cost more on XLA's CPU backend), then the
    rows are summed; each output keeps its own dtype. The best width depends on
    the number of outputs: on XLA's CPU backend two outputs run fastest over
    rows of 128, three over rows of 16, nine over rows of 32 (measured:
    docs/design.md).
    """
    return by_platform(
        lambda: _row_sums_ordered(xs, elementwise, scalars, after, width),
        lambda: _sums(xs, elementwise, scalars),
        like=xs,
    )


def _sums(xs: Operands, elementwise, scalars: Sequence[jax.Array]) -> list[jax.Array]:
    """:func:`_row_sums` as plain sums, for GPU and TPU (one fusion per operand)."""
    totals = None
    zero = jnp.zeros((), jnp.float32)
    add = lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True))  # noqa: E731
    for x in as_list(xs):
        terms = tuple(elementwise(jnp.ravel(x), zero, *scalars))
        # One variadic reduction: XLA keeps sums of different dtypes apart otherwise (one
        # kernel each on a TPU).
        part = lax.reduce(terms, tuple(jnp.zeros((), v.dtype) for v in terms), add, (0,))
        totals = part if totals is None else add(totals, part)
    return list(totals)


def _row_sums_ordered(xs, elementwise, scalars, after, width: int) -> list[jax.Array]:
    """:func:`_row_sums` on XLA:CPU: ordered passes over rows of ``width``."""
    token = jnp.zeros((), jnp.float32) if after is None else after
    totals = None
    for x in as_list(xs):
        x = jnp.ravel(x)
        xb, sb, zero, _ = lax.optimization_barrier(
            (x, tuple(scalars), jnp.zeros((), jnp.float32), token)
        )
        full = xb.shape[0] // width
        for v, axis in ((xb[: full * width].reshape(full, width), 1), (xb[full * width :], 0)):
            if v.size == 0:
                continue
            values = tuple(elementwise(v, zero, *sb))
            inits = tuple(jnp.zeros((), value.dtype) for value in values)
            rows = lax.reduce(values, inits, _add_all, (axis,))
            part = [jnp.sum(r, dtype=r.dtype) for r in rows]
            if axis == 1:  # keep the tail out of the main fusion
                part = list(lax.optimization_barrier(part))
            totals = part if totals is None else [a + b for a, b in zip(totals, part, strict=True)]
        token = totals[-1].astype(jnp.float32)
    return totals


def count_and_sums(
    xs: Operands,
    threshold: jax.Array,
    terms: Sequence[Term],
    scalars: Sequence[jax.Array] = (),
    after=None,
) -> tuple[jax.Array, list[jax.Array]]:
    """Count of ``|x| > threshold`` and the sum of each term, in one pass per array.

    Args:
      xs: an array or a sequence of arrays (each reduced over all entries).
      threshold: scalar magnitude threshold of the count.
      terms: elementwise functions ``term(x, zero, *scalars)`` to sum.
      scalars: scalar operands of the terms.
      after: optional array the first pass is ordered after.

    Returns:
      ``(count, sums)``: the int32 count and one float32 sum per term.
    """

    def elementwise(v, zero, threshold, *scalars):
        above = (jnp.abs(v) > threshold).astype(jnp.int32)
        return (above, *[term(v, zero, *scalars).astype(jnp.float32) for term in terms])

    width = 128 if len(terms) == 1 else 16
    count, *sums = _row_sums(xs, elementwise, [threshold, *scalars], after, width)
    return count, sums


def counts_above(xs: Operands, thresholds: jax.Array, after=None) -> jax.Array:
    """int32 counts of ``|x| > t`` for each ``t`` of the 1-D ``thresholds``, one pass per array.

    A handful of thresholds cost about one pass (docs/design.md).
    """

    def elementwise(v, zero, *ts):
        del zero
        return tuple((jnp.abs(v) > t).astype(jnp.int32) for t in ts)

    def ordered():
        ts = [thresholds[i] for i in range(thresholds.shape[0])]
        return jnp.stack(_row_sums(xs, elementwise, ts, after, width=32))

    def plain():  # every count in one reduction per operand
        # Two-sided, with no |x| that XLA would share between passes and so write out.
        counts = [
            jnp.sum(_outside(jnp.ravel(x)[:, None], thresholds), axis=0, dtype=jnp.int32)
            for x in as_list(xs)
        ]
        return sum(counts[1:], counts[0])

    return by_platform(ordered, plain, like=xs)


def _outside(x: jax.Array, t: jax.Array) -> jax.Array:
    """``|x| > t``."""
    return (x > t) | (x < -t)


def count_above(xs: Operands, threshold: jax.Array, after=None) -> jax.Array:
    """Exact int32 count of ``|x| > threshold`` over all of ``xs``, one pass each."""

    def by_words(after=after):
        total = jnp.zeros((), jnp.int32)
        for x in as_list(xs):
            words = block_words(jnp.ravel(x), threshold, after)
            after = jnp.sum(lax.optimization_barrier(lax.population_count(words)), dtype=jnp.int32)
            total = total + after
        return total

    def plain():
        return sum(
            (jnp.sum(jnp.abs(x) > threshold, dtype=jnp.int32) for x in as_list(xs)),
            jnp.zeros((), jnp.int32),
        )

    return by_platform(by_words, plain, like=xs)
