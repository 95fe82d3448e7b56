"""Closed-form fits of the sparsity-inducing distributions and their tail quantiles.

Each fit is computed from a few sums (count, total, total of squares or of
logs), so the same estimator serves the masked public fits here and the
one-pass-per-sum stages of :mod:`sidco_jax._src.stats.thresholds`. Every fit returns
finite parameters for any finite input; degenerate data (no entries, zero
variance, zero mean) gives parameters whose tail quantile is finite and >= 0.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from sidco_jax._src.stats.special import gammainccinv

# Shape parameters are kept in a range where the quantile functions stay finite
# in float32 (|xi| below this is treated as the exponential limit).
_XI_EPS = 1e-6
_GAMMA_SHAPE = (1e-3, 1e4)


class ExponentialFit(NamedTuple):
    """Exponential law of magnitudes (Laplace law of signed values).

    Attributes:
      scale: mean magnitude ``b``.
    """

    scale: jax.Array


class GammaFit(NamedTuple):
    """Gamma law of magnitudes.

    Attributes:
      shape: ``k``.
      scale: ``theta``; the mean is ``k * theta``.
    """

    shape: jax.Array
    scale: jax.Array


class GParetoFit(NamedTuple):
    """Generalized Pareto law of magnitudes with location 0.

    Attributes:
      shape: ``xi`` (0 is the exponential, > 0 heavier tails).
      scale: ``sigma``.
    """

    shape: jax.Array
    scale: jax.Array


def unit_scale(mean: jax.Array) -> jax.Array:
    """A power of two near ``mean`` (1 where ``mean`` is 0 or not finite), in its dtype.

    Statistics of ``x / unit_scale(mean(|x|))`` stay near 1 in float32: no
    square overflows at 1e20 nor a difference falls into denormals at 1e-20,
    and the rescaling itself is exact (``ldexp``: XLA's CPU ``exp2`` missed
    the powers beyond ``2**±12`` by up to 4e-6). A float64 ``mean`` (under
    x64) gets a float64 power of two, up to ``2**±996``: it brings float64
    magnitudes that float32 cannot hold into its range.
    """
    mean = jnp.asarray(mean)
    bound = jnp.finfo(mean.dtype).maxexp - 28  # 2**±100 in float32
    exponent = jnp.round(jnp.log2(jnp.where(mean > 0, mean, 1.0)))
    exponent = jnp.where(jnp.isfinite(exponent), jnp.clip(exponent, -bound, bound), 0)
    return jnp.ldexp(jnp.ones((), mean.dtype), exponent.astype(jnp.int32))


def _safe_div(num, den):
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1), 0.0)


def exponential_from_sums(count: ArrayLike, total: ArrayLike) -> ExponentialFit:
    """Maximum-likelihood exponential fit from ``count`` values summing to ``total``."""
    return ExponentialFit(scale=_safe_div(jnp.asarray(total, jnp.float32), count))


def gamma_from_sums(count: ArrayLike, total: ArrayLike, log_total: ArrayLike) -> GammaFit:
    """Approximate maximum-likelihood gamma fit (Minka's closed form).

    Args:
      count: number of (positive) values.
      total: their sum.
      log_total: the sum of their logs.
    """
    mean = _safe_div(jnp.asarray(total, jnp.float32), count)
    s = jnp.log(jnp.where(mean > 0, mean, 1.0)) - _safe_div(log_total, count)
    s = jnp.maximum(s, 1e-12)  # Jensen gives s >= 0; 0 only for constant data
    shape = (3.0 - s + jnp.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
    shape = jnp.clip(shape, *_GAMMA_SHAPE)
    return GammaFit(shape=shape, scale=mean / shape)


def gpareto_from_sums(count: ArrayLike, total: ArrayLike, square_total: ArrayLike) -> GParetoFit:
    """Method-of-moments generalized Pareto fit (unbiased variance).

    ``r = m^2 / v``, ``xi = (1 - r) / 2``, ``sigma = m (1 + r) / 2``. Zero or
    undefined variance falls back to the exponential (``xi = 0``, ``sigma = m``).
    """
    count = jnp.asarray(count, jnp.float32)
    mean = _safe_div(jnp.asarray(total, jnp.float32), count)
    var = _safe_div(square_total - count * mean**2, count - 1.0)
    ok = (var > 0) & (count > 1)
    r = jnp.where(ok, mean**2 / jnp.where(ok, var, 1.0), 1.0)
    return GParetoFit(shape=(1.0 - r) / 2.0, scale=mean * (1.0 + r) / 2.0)


def _sums(x, mask):
    x = jnp.asarray(x, jnp.float32)
    mask = jnp.ones(x.shape, bool) if mask is None else jnp.broadcast_to(mask, x.shape)
    return x, mask, jnp.sum(mask, dtype=jnp.float32), jnp.sum(jnp.where(mask, x, 0.0))


def fit_exponential(x: jax.Array, mask: jax.Array | None = None) -> ExponentialFit:
    """Fits an exponential law to the non-negative values ``x[mask]``.

    Args:
      x: non-negative values (magnitudes), any shape.
      mask: optional boolean array of the same shape selecting the sample.

    Returns:
      The maximum-likelihood :class:`ExponentialFit`.

    Examples:
      >>> import jax.numpy as jnp
      >>> fit_exponential(jnp.array([1.0, 2.0, 3.0, 100.0]), jnp.array([1, 1, 1, 0], bool))
      ExponentialFit(scale=Array(2., dtype=float32))
    """
    _, _, count, total = _sums(x, mask)
    return exponential_from_sums(count, total)


def fit_gamma(x: jax.Array, mask: jax.Array | None = None) -> GammaFit:
    """Fits a gamma law to the positive values of ``x[mask]``.

    Exact zeros carry no information about the shape (their log is ``-inf``)
    and are left out of the sample; callers model them as a point mass.

    Args:
      x: non-negative values, any shape.
      mask: optional boolean sample selector.

    Returns:
      The closed-form approximate maximum-likelihood :class:`GammaFit`.
    """
    x, mask, _, _ = _sums(x, mask)
    mask = mask & (x > 0)
    count = jnp.sum(mask, dtype=jnp.float32)
    total = jnp.sum(jnp.where(mask, x, 0.0))
    log_total = jnp.sum(jnp.where(mask, jnp.log(jnp.where(mask, x, 1.0)), 0.0))
    return gamma_from_sums(count, total, log_total)


def fit_gpareto(x: jax.Array, mask: jax.Array | None = None) -> GParetoFit:
    """Fits a generalized Pareto law (location 0) to ``x[mask]`` by moments.

    Args:
      x: non-negative values (excesses over a location), any shape.
      mask: optional boolean sample selector.

    Returns:
      The method-of-moments :class:`GParetoFit`.
    """
    x, mask, count, total = _sums(x, mask)
    return gpareto_from_sums(count, total, jnp.sum(jnp.where(mask, x * x, 0.0)))


def exponential_isf(fit: ExponentialFit, q: jax.Array) -> jax.Array:
    """Magnitude exceeded with probability ``q``: ``b * log(1/q)``."""
    return fit.scale * -jnp.log(q)


def gamma_isf(fit: GammaFit, q: jax.Array) -> jax.Array:
    """Magnitude exceeded with probability ``q``: ``theta * Q^-1(k, q)``."""
    return fit.scale * gammainccinv(fit.shape, q)


def gpareto_isf(fit: GParetoFit, q: jax.Array) -> jax.Array:
    """Magnitude exceeded with probability ``q``: ``sigma/xi * (q^-xi - 1)``.

    Uses the exponential limit ``sigma * log(1/q)`` for ``|xi| < 1e-6``.
    """
    xi = fit.shape
    small = jnp.abs(xi) < _XI_EPS
    safe = jnp.where(small, 1.0, xi)
    return jnp.where(
        small, fit.scale * -jnp.log(q), fit.scale / safe * jnp.expm1(-safe * jnp.log(q))
    )
