"""Full-length reductions that each stream the input once.

XLA merges identical sub-expressions of several reductions over the same array
and then materialises the shared elementwise producer (``|x|``, a broadcast
zero, ...) as a full-size temporary. On the CPU backend of jax 0.10 a count
plus a sum over 2^24 floats then took ~25 ms where each alone takes ~2-4 ms
(docs/benchmarks.md). Each reduction here is fed through
``lax.optimization_barrier`` together with the previous result: nothing can
be shared, every pass reads the input directly, and the passes run in order.
Scalars, including the zero used by ``relu``, travel through the barrier too,
so that no broadcast constant is shared between passes.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

Term = Callable[..., jax.Array]

# Rows of this many entries are counted with an int32 row reduction, which XLA's
# CPU backend streams at about one-pass speed (wider rows were 7x slower).
COUNT_BLOCK = 32


def reduce_each(
    x: jax.Array,
    terms: Sequence[Term],
    scalars: Sequence[jax.Array] = (),
    after=None,
    op: Callable[..., jax.Array] = jnp.sum,
) -> list[jax.Array]:
    """Returns ``[op(term(x, zero, *scalars)) for term in terms]``, one pass each.

    Args:
      x: the array to reduce (any shape; reduced over all entries).
      terms: elementwise functions ``term(x, zero, *scalars)``; ``zero`` is a
        float32 scalar 0 to use instead of literal constants (see module doc).
      scalars: scalar operands of the terms.
      after: optional array the first pass is ordered after.
      op: the reduction, ``jnp.sum`` (default) or ``jnp.max``.

    Returns:
      One float32 scalar per term.
    """
    token = jnp.zeros((), jnp.float32) if after is None else after
    out = []
    for term in terms:
        xb, sb, zero, _ = lax.optimization_barrier(
            (x, tuple(scalars), jnp.zeros((), jnp.float32), token)
        )
        token = op(term(xb, zero, *sb).astype(jnp.float32))
        out.append(token)
    return out


def block_counts(x: jax.Array, threshold: jax.Array, block: int, after=None) -> jax.Array:
    """Counts ``|x| > threshold`` in consecutive blocks of ``block`` entries.

    Args:
      x: 1-D array.
      threshold: scalar magnitude threshold.
      block: static block length; the last block may be shorter.
      after: optional array this pass is ordered after.

    Returns:
      int32 array of ``ceil(x.size / block)`` counts.
    """
    n = x.shape[0]
    full = n // block
    token = jnp.zeros((), jnp.float32) if after is None else after
    x, threshold, _ = lax.optimization_barrier((x, threshold, token))
    mags = jnp.abs(x)
    counts = jnp.sum(
        (mags[: full * block] > threshold).reshape(full, block), axis=1, dtype=jnp.int32
    )
    if n % block:
        # Keep the tail reduction out of the main fusion (it would slow it down).
        counts = lax.optimization_barrier(counts)
        tail = jnp.sum(mags[full * block :] > threshold, dtype=jnp.int32)
        counts = jnp.concatenate([counts, tail[None]])
    return counts


def count_above(x: jax.Array, threshold: jax.Array, after=None) -> jax.Array:
    """Exact int32 count of ``|x| > threshold`` in one pass."""
    counts = block_counts(x.reshape(-1), threshold, COUNT_BLOCK, after)
    return jnp.sum(lax.optimization_barrier(counts))
