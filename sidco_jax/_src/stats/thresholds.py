"""SIDCo's multi-stage magnitude thresholds with static shapes.

Stage 1 fits the chosen law to all magnitudes and takes the threshold that a
fraction ``first_ratio`` exceeds; each later stage fits the excesses over the
previous threshold (peak over threshold: a generalized Pareto law, or the
exponential for SIDCo-E) and moves the threshold further into the tail. Every
statistic is a masked reduction over a fixed set of entries (all of them, or a
fixed sample; :mod:`sidco_jax._src.ops.passes`), so shapes never depend on the
data, and the stage count may be a traced integer.

Three choices differ from the reference code, all on purpose:

* The excesses of a stage are measured from the previous threshold rather
  than from the smallest exceedance. This is the textbook peak-over-threshold
  form, saves a min-reduction pass, and differs from ``min(E)`` by one gap
  between order statistics.
* Each later stage aims at the final count it is responsible for: it keeps
  ``n * ratio_i / count`` of the current exceedances (``ratio_i`` the target
  density after stage ``i``) instead of a fixed fraction ``ds``, so an error
  of an earlier stage is corrected rather than compounded.
* That correction lets every later stage but the last fit a fixed sample of
  the entries (one block in eight of each long vector, see
  :func:`block_sample`): the last stage reads every entry and aims at the
  target from the exact count, so ten stages cost about four passes, not ten.
  Where a later stage follows, the first stage's extra statistics (SIDCo-P's
  squares, SIDCo-GP's count and logs) read that sample too.
"""

import contextlib
import math
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from sidco_jax._src.base import (
    Estimator,
    check_estimator,
    check_integer,
    check_ratio,
    cond_on_device,
    float_vectors,
)
from sidco_jax._src.ops import passes
from sidco_jax._src.stats import fits


def max_stages(ratio: float) -> int:
    """The paper's stage-count ceiling ``ceil(log2(1 / ratio))``, at least 1.

    Raises:
      TypeError: unless ``ratio`` is a real scalar.
      ValueError: for ``ratio`` outside (0, 1].

    Examples:
      >>> max_stages(0.001), max_stages(0.01), max_stages(0.6)
      (10, 7, 1)
    """
    return stage_limit(check_ratio(ratio))


def stage_limit(ratio: float) -> int:
    """:func:`max_stages` of a ``ratio`` already checked."""
    return max(1, math.ceil(math.log2(1.0 / ratio)))


def check_stages(stages, ratio):
    """``stages`` as an int in ``[1, max_stages(ratio)]``, or a traced integer unchanged.

    With a traced ``ratio`` only ``stages >= 1`` is checked here; the ceiling
    is applied on device by :func:`threshold`.

    Raises:
      TypeError: unless ``stages`` is an integer scalar (never a bool).
      ValueError: for a concrete ``stages`` out of range.
    """
    if isinstance(ratio, jax.core.Tracer):
        return check_integer("stages", stages, 1)
    return check_integer("stages", stages, 1, stage_limit(ratio), f" for ratio {ratio}")


def _magnitude(v, zero, inv_scale):
    return jnp.abs(v.astype(jnp.float32)) * inv_scale + zero


def _excess(v, zero, inv_scale, eta):
    return jnp.maximum(jnp.abs(v.astype(jnp.float32)) * inv_scale - eta, zero)


def _first_exponential(parts, n, mean, inv_scale, q, after):
    del parts, n, inv_scale, after
    return fits.exponential_isf(fits.ExponentialFit(mean), q)


def _weighted(parts, reduce):
    """``sum(weight * reduce(array))`` over ``(array, weight)`` parts, in order, as float32."""
    total = jnp.zeros((), jnp.float32)
    for part, weight in parts:
        total = total + weight * reduce(part, total).astype(jnp.float32)
    return total


def _first_gpareto(parts, n, mean, inv_scale, q, after):
    square = lambda v, z, s: _magnitude(v, z, s) ** 2  # noqa: E731
    squares = _weighted(
        parts, lambda v, prev: passes.reduce_parts([v], square, [inv_scale], after + prev)[0]
    )
    return fits.gpareto_isf(fits.gpareto_from_sums(n, n * mean, squares), q)


def _first_gamma(parts, n, mean, inv_scale, q, after):
    zero = jnp.zeros((), jnp.float32)
    nonzero = _weighted(parts, lambda v, prev: passes.count_above(v, zero, after + prev))

    # Exact zeros join as a point mass, not the fit: their clamped logs are
    # subtracted again (cheaper than masking them inside the pass).
    tiny = jnp.finfo(jnp.float32).tiny
    log_term = lambda v, zero, s: jnp.log(jnp.maximum(_magnitude(v, zero, s), zero + tiny))  # noqa: E731
    logs = _weighted(
        parts, lambda v, prev: passes.reduce_parts([v], log_term, [inv_scale], nonzero + prev)[0]
    )
    logs = logs - (n - nonzero) * jnp.log(tiny)
    fit = fits.gamma_from_sums(nonzero, n * mean, logs)
    q_nonzero = q * n / jnp.maximum(nonzero, 1.0)
    return jnp.where(q_nonzero >= 1.0, 0.0, fits.gamma_isf(fit, jnp.minimum(q_nonzero, 1.0)))


_FIRST: dict[str, Callable] = {
    "exponential": _first_exponential,
    "gpareto": _first_gpareto,
    "gamma": _first_gamma,
}


# Every later stage but the last fits a sample of each long vector: the first
# SAMPLE_BLOCK entries of every SAMPLE_EVERY x SAMPLE_BLOCK (a shorter tail is
# left out). Those stages only choose where the next one starts, and each stage
# aims at the final count from its own count of what passes, so the last stage,
# which reads every entry, puts the result on target, close to where all-whole
# stages land, for a fraction of a pass per stage (measured: docs/design.md).
# The period, 8,064 entries, is no power of two, so in a kernel whose rows are a
# power of two long the blocks fall at many column offsets, not always the same.
# Vectors shorter than SAMPLE_MIN periods are read whole: they cost little, and
# their sample would be small.
SAMPLE_EVERY = 8
SAMPLE_BLOCK = 1008
SAMPLE_MIN = 16


def block_sample(x: list[jax.Array]) -> list[tuple[jax.Array, float]]:
    """``(part, weight)`` for each 1-D vector of ``x``: what a sampled stage reads
    of it, and how many of its entries each entry read stands for."""
    period = SAMPLE_EVERY * SAMPLE_BLOCK
    out = []
    for v in x:
        periods = v.shape[0] // period
        if periods < SAMPLE_MIN:
            out.append((v, 1.0))
        else:
            part = v[: periods * period].reshape(periods, SAMPLE_EVERY, SAMPLE_BLOCK)[:, 0]
            out.append((part, v.shape[0] / part.size))
    return out


@contextlib.contextmanager
def every_stage_whole():
    """Within it, thresholds trace with every stage reading every entry (for
    benchmarks and tests that compare; a function jitted inside keeps it)."""
    global SAMPLE_MIN
    saved, SAMPLE_MIN = SAMPLE_MIN, sys.maxsize
    try:
        yield
    finally:
        SAMPLE_MIN = saved


def _next_stage(parts, eta, scale, q_total, estimator, n):
    """One peak-over-threshold refinement of ``eta`` (in units of ``scale``).

    ``parts``: ``(array, weight)`` pairs whose weighted statistics stand for
    all ``n`` entries (:func:`block_sample`, or every vector with weight 1).
    """
    inv = 1.0 / scale
    terms = [_excess]
    if estimator != "exponential":
        terms.append(lambda v, z, s, e: _excess(v, z, s, e) ** 2)
    # One pass per part: the exceedances' count and sums together.
    count, sums, after = jnp.zeros((), jnp.float32), [0.0] * len(terms), eta
    for part, weight in parts:
        c, ss = passes.count_and_sums(part, eta * scale, terms, [inv, eta], after=after)
        after = ss[-1]
        count = count + weight * c.astype(jnp.float32)
        sums = [a + weight * b for a, b in zip(sums, ss, strict=True)]
    if estimator == "exponential":
        fit, isf = fits.exponential_from_sums(count, sums[0]), fits.exponential_isf
    else:
        fit, isf = fits.gpareto_from_sums(count, *sums), fits.gpareto_isf
    q = jnp.minimum(q_total * n / jnp.maximum(count, 1.0), 1.0)
    new = eta + isf(fit, q)
    keep = (count > 1) & jnp.isfinite(new) & (new >= eta)
    return jnp.where(keep, new, eta)


def threshold(
    x: jax.Array,
    ratio: ArrayLike,
    *,
    estimator: Estimator = "exponential",
    stages: ArrayLike = 1,
    first_ratio: float = 0.25,
) -> jax.Array:
    """The magnitude threshold that about ``ratio`` of the entries of ``x`` exceed.

    Pure and jittable; costs one pass over ``x`` for the first stage, one for
    the last stage (its count and sums in one variadic reduction) and about a
    quarter of one for each stage in between, which reads one block in eight
    of each vector of at least 129,024 entries. ``"gpareto"`` and ``"gamma"``
    take one and two more for the first stage: whole passes with one stage,
    reads of that sample with several.

    Args:
      x: array of any shape and float dtype, or a pytree of them (a gradient
        tree: one threshold over all its entries, leaves never concatenated);
        statistics are computed in float32. Where ``x`` holds float64 (under
        x64) they are those of ``x`` over a power of two near its mean
        magnitude, so that magnitudes outside float32's range (1e-200, 1e300)
        get a threshold too (one more pass).
      ratio: target density in (0, 1], e.g. 0.001; may be traced.
      estimator: ``"exponential"`` (SIDCo-E), ``"gpareto"`` (SIDCo-P) or
        ``"gamma"`` (SIDCo-GP: gamma first stage, generalized Pareto after).
      stages: number of fitting stages, in ``[1, max_stages(ratio)]``; may be
        a traced integer (changing it does not recompile), then clipped to
        that range on device. Ignored (one stage) when ``ratio >= first_ratio``.
      first_ratio: density targeted by the first of several stages, in
        (0, 1]; may be traced.

    Returns:
      A float32 scalar ``eta >= 0`` (float64 where ``x`` holds float64), to
      select ``|x| > eta``; ``inf`` if ``x`` holds a non-finite value; ``0``
      for an all-zero ``x`` (selects nothing); NaN if a traced ``ratio`` or
      ``first_ratio`` lies outside (0, 1] (NaN selects nothing in
      :func:`sparsify`: errors cannot be raised on device).

    Raises:
      TypeError: if a leaf of ``x`` is not a floating-point array, or
        ``ratio``, ``first_ratio`` or ``stages`` is not a real (for
        ``stages`` integer) scalar; bools are refused.
      ValueError: for an unknown estimator, or a concrete ``ratio`` or
        ``first_ratio`` outside (0, 1] or ``stages`` outside
        ``[1, max_stages(ratio)]``.

    Examples:
      >>> import jax, jax.numpy as jnp, sidco_jax as sidco
      >>> x = jax.random.laplace(jax.random.key(0), (100_000,))
      >>> eta = sidco.threshold(x, 0.01, estimator="gpareto", stages=2)
      >>> round(float(jnp.mean(jnp.abs(x) > eta)), 2)
      0.01
    """
    check_estimator(estimator)
    ratio = check_ratio(ratio)
    first_ratio = check_ratio(first_ratio, "first_ratio")
    stages = check_stages(stages, ratio)
    x = float_vectors(x, "threshold")
    if any(jnp.finfo(v.dtype).bits > 32 for v in x):
        return _wider_than_float32(x, ratio, estimator, stages, first_ratio)
    (total,) = passes.reduce_each(x, [lambda v, z: jnp.abs(v.astype(jnp.float32)) + z])
    return from_abs_sum(x, total, ratio, estimator, stages, first_ratio)


def _wider_than_float32(x, ratio, estimator, stages, first_ratio) -> jax.Array:
    """:func:`threshold` of 1-D vectors some of which are float64, as a float64 scalar.

    The float32 statistics are those of ``x / s``, ``s`` a power of two near
    the mean magnitude found in float64, and the threshold is scaled back: a
    1e-200 or 1e300 gets its threshold, where cast to float32 it would be 0 or
    an infinity. One more pass and a float32 copy, for float64 inputs only.
    """
    dtype = jnp.result_type(*x)
    total = sum(jnp.sum(jnp.abs(v.astype(dtype))) for v in x)
    scale = fits.unit_scale(total / max(passes.size(x), 1))
    x = [(v / scale).astype(jnp.float32) for v in x]
    (total,) = passes.reduce_each(x, [lambda v, z: jnp.abs(v) + z])
    return from_abs_sum(x, total, ratio, estimator, stages, first_ratio).astype(dtype) * scale


def from_abs_sum(x, total, ratio, estimator, stages, first_ratio) -> jax.Array:
    """:func:`threshold` of 1-D vectors ``x`` whose ``sum(|x|)`` is ``total`` (checked options)."""
    n = passes.size(x)
    if n == 0:
        return jnp.zeros((), jnp.float32)
    traced_ratio = isinstance(ratio, jax.core.Tracer)
    limit = None if traced_ratio else stage_limit(ratio)
    # A traced ratio or first_ratio outside (0, 1] (NaN included) gives NaN,
    # which selects nothing; the stages run on valid stand-ins.
    ratio, first_ratio = jnp.asarray(ratio, jnp.float32), jnp.asarray(first_ratio, jnp.float32)
    valid = (ratio > 0) & (ratio <= 1) & (first_ratio > 0) & (first_ratio <= 1)
    ratio, first_ratio = jnp.where(valid, ratio, 1.0), jnp.where(valid, first_ratio, 1.0)
    if traced_ratio:  # max_stages on device
        limit = jnp.maximum(jnp.ceil(-jnp.log2(ratio)).astype(jnp.int32), 1)
    mean = total / n
    scale = fits.unit_scale(mean)

    stages = jnp.clip(jnp.asarray(stages, jnp.int32), 1, limit)
    single = (stages == 1) | (ratio >= first_ratio)
    later = jnp.where(single, 0, stages - 1)
    q1 = jnp.where(single, ratio, first_ratio)
    sample, whole = block_sample(x), [(v, 1.0) for v in x]

    def first(parts):
        return _FIRST[estimator](parts, n, mean / scale, 1.0 / scale, q1, total)

    # The first stage's extra passes (SIDCo-P, SIDCo-GP) read the sample too
    # where a later stage follows: it only sets where that stage starts.
    eta = (
        first(whole)
        if estimator == "exponential"
        else cond_on_device(later > 0, lambda: first(sample), lambda: first(whole))
    )
    eta = jnp.where(jnp.isfinite(eta) & (eta >= 0), eta, 0.0)

    # Equal density per later stage: ratio_i = first_ratio * ds**i.
    log_ds = jnp.log(ratio / first_ratio) / jnp.maximum(later, 1).astype(jnp.float32)

    def stage(i, eta, parts):
        # i is a Python int where the loop runs in Python (jax.disable_jit()).
        q_total = first_ratio * jnp.exp(log_ds * jnp.asarray(i + 1, jnp.float32))
        return _next_stage(parts, eta, scale, q_total, estimator, n)

    eta = lax.fori_loop(0, later - 1, lambda i, eta: stage(i, eta, sample), eta)
    last = lambda: stage(later - 1, eta, whole)  # noqa: E731
    eta = cond_on_device(later > 0, last, lambda: eta)
    eta = jnp.where(jnp.isfinite(total), eta * scale, jnp.inf)
    return jnp.where(valid, eta, jnp.nan)
