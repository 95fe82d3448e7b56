"""Inverse of the regularised incomplete gamma function, in graph.

``jax.scipy.special`` has ``gammainc``/``gammaincc`` but no inverse. The gamma
threshold needs ``x`` with ``Q(a, x) = q`` for small ``q``; this solves it by
safeguarded Newton steps on ``y = log x`` against ``log Q`` (or ``log P`` when
``P`` is the smaller tail, which keeps precision on both sides), starting from
Wilson-Hilferty or the tail asymptotes and falling back to bisection whenever
a step leaves the bracket. It stops once every step is below float32 noise (at
most ``_ITERATIONS``): each evaluation of ``Q`` or ``P`` is a data-dependent
loop of its own, which on a GPU costs a kernel launch and a host round trip
per iteration (docs/design.md). Jittable and vectorised.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.scipy import special

_ITERATIONS = 24
_TOLERANCE = 2e-6  # on log x, relative to 1 + |log x|: float32 noise


def _initial_log_x(a, p, q):
    """A starting point for log x: Wilson-Hilferty, or a tail asymptote where it fails."""
    # The upper-tail normal quantile, by erfinv: ndtri's coefficient tables are a
    # copy-start and a slice each on a TPU, and a starting point needs no more.
    z = jnp.sqrt(2.0) * lax.erf_inv(1.0 - 2.0 * q)
    c = 1.0 / (9.0 * a)
    wh = a * (1.0 - c + z * jnp.sqrt(c)) ** 3
    # Small x: P(a, x) ~ x^a / Gamma(a + 1).
    small = (jnp.log(p) + special.gammaln(a + 1.0)) / a
    # Large x: Q(a, x) ~ x^(a-1) e^-x / Gamma(a); two fixed-point steps.
    big = -jnp.log(q) - special.gammaln(a)
    big = jnp.maximum(big, 1.0)
    for _ in range(2):
        big = jnp.maximum(-jnp.log(q) - special.gammaln(a) + (a - 1.0) * jnp.log(big), 1e-3)
    guess = jnp.where(wh > 0.05 * a, jnp.log(wh), jnp.where(p < 0.5, small, jnp.log(big)))
    return guess


def gammainccinv(a: jax.Array, q: jax.Array) -> jax.Array:
    """``x`` such that the upper regularised incomplete gamma ``Q(a, x) = q``.

    Args:
      a: shape parameter, > 0.
      q: upper tail probability in (0, 1).

    Returns:
      ``x`` in the dtype of the inputs (at least float32); ``0`` for ``q >= 1``,
      ``inf`` for ``q <= 0``, NaN for ``a <= 0`` or NaN inputs.

    Examples:
      >>> import jax.numpy as jnp
      >>> float(gammainccinv(jnp.float32(1.0), jnp.float32(0.01)))  # -log(0.01)
      4.60517...
    """
    a, q = jnp.broadcast_arrays(jnp.asarray(a), jnp.asarray(q))
    dtype = jnp.result_type(a.dtype, q.dtype, jnp.float32)
    a, q = a.astype(dtype), q.astype(dtype)
    qc = jnp.clip(q, jnp.finfo(dtype).tiny, 1.0)
    p = 1.0 - qc
    upper = qc < 0.5  # solve on the smaller tail
    target = jnp.log(jnp.where(upper, qc, p))
    lgam = special.gammaln(a)
    lo = jnp.full_like(a, jnp.log(jnp.finfo(dtype).tiny))
    hi = jnp.log(2.0 * a + 2.0 * (-jnp.log(qc)) + 50.0)
    y = jnp.clip(_initial_log_x(a, jnp.maximum(p, jnp.finfo(dtype).tiny), qc), lo, hi)

    def tail_of(x):
        if upper.ndim == 0:  # one solve (a threshold): evaluate only the tail it needs
            return lax.cond(upper, special.gammaincc, special.gammainc, a, x)
        return jnp.where(upper, special.gammaincc(a, x), special.gammainc(a, x))

    def step(carry):
        i, y, lo, hi, done = carry
        x = jnp.exp(y)
        tail = tail_of(x)
        f = jnp.log(tail) - target
        # d log(tail) / dy = -+ x^a e^-x / (Gamma(a) tail)
        slope = jnp.exp(a * y - x - lgam) / tail
        slope = jnp.where(upper, -slope, slope)
        too_small = jnp.where(upper, f > 0, f < 0)
        lo = jnp.where(too_small, y, lo)
        hi = jnp.where(too_small, hi, y)
        new = y - f / slope
        # A Newton step within float32 noise ends the solve. Without this test
        # the bracket, just moved onto y, made such a step look like leaving
        # it, and the next bisection threw a converged y far away again.
        converged = (f == 0) | (jnp.abs(new - y) <= _TOLERANCE * (1.0 + jnp.abs(y)))
        inside = jnp.isfinite(new) & (new > lo) & (new < hi)
        moved = jnp.where(inside, new, 0.5 * (lo + hi))
        y = jnp.where(done, y, jnp.where(converged, jnp.where(f == 0, y, new), moved))
        return i + 1, y, lo, hi, done | converged

    def searching(carry):
        i, *_, done = carry
        return (i < _ITERATIONS) & ~jnp.all(done)

    # The counter and flags derive from y, so they vary across devices as y
    # does under shard_map (a constant carry would not). A NaN y is done.
    done = jnp.isnan(y)
    start = (jnp.sum(done & ~done, dtype=jnp.int32), y, lo, hi, done)
    _, y, _, _, _ = lax.while_loop(searching, step, start)
    x = jnp.exp(y)
    x = jnp.where(q >= 1.0, 0.0, jnp.where(q <= 0.0, jnp.inf, x))
    return jnp.where((a > 0) & ~jnp.isnan(q), x, jnp.nan)


def gammaincinv(a: jax.Array, p: jax.Array) -> jax.Array:
    """``x`` such that the lower regularised incomplete gamma ``P(a, x) = p``.

    Same as ``scipy.special.gammaincinv``; see :func:`gammainccinv`.

    Examples:
      >>> import jax.numpy as jnp
      >>> float(gammaincinv(jnp.float32(2.0), jnp.float32(0.5)))
      1.67834...
    """
    return gammainccinv(a, 1.0 - jnp.asarray(p))
