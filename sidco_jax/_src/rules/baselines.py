"""The compressors SIDCo is compared with, in the same interface as :func:`compress`.

Each is a :class:`~sidco_jax.Rule` run inside :func:`sparsifier`, so error
feedback, granularity, non-finite handling and metrics are the same for all,
:func:`dense` included. ``k`` is ``max(floor(n * ratio), 1)`` for a vector of
``n`` entries; at ``k = n`` (ratio 1) every rule sends every entry, so that it
is the dense mean.
"""

import functools
import math
from typing import Unpack

import jax.numpy as jnp
import optax
from jax import lax
from jax.scipy import special

from sidco_jax._src.base import (
    SLOT_BYTES,
    VALUE_BYTES,
    check_capacity_factor,
    check_number,
    check_ratio,
    static,
)
from sidco_jax._src.base import k_of as _k
from sidco_jax._src.loop.options import takes_loop_options
from sidco_jax._src.loop.rule import Rule, Selection, empty_init
from sidco_jax._src.loop.selection import every_entry, everything
from sidco_jax._src.loop.sparsifier import LoopOptions, build
from sidco_jax._src.ops import codecs, passes
from sidco_jax._src.ops import payload as payload_lib
from sidco_jax._src.stats import fits


@takes_loop_options
def topk(
    ratio: float,
    **options: Unpack[LoopOptions],
) -> optax.GradientTransformationExtraArgs:
    """Exact top-k sparsification (``lax.top_k``) with error feedback.

    Args:
      ratio: target density in (0, 1]; ``k = max(floor(n * ratio), 1)``.
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: for an argument of the wrong type, bools where a number is
        expected included (see :func:`compress`).
      ValueError: for a value out of range (NaN and inf included) or an
        unknown name.

    Examples:
      >>> import jax.numpy as jnp, sidco_jax as sidco
      >>> tx = sidco.topk(0.25)
      >>> g = jnp.array([0.1, -5.0, 0.3, 2.0, 0.0, 0.2, -0.4, 0.05])
      >>> tx.update(g, tx.init(g))[0]
      Array([ 0., -5.,  0.,  2.,  0.,  0.,  0.,  0.], dtype=float32)
    """
    return build(_largest(ratio, lax.top_k), ratio, **options)


def _above(vectors, eta, cap: int, abs_sums, k: int) -> Selection:
    """A threshold rule's selection: what passes ``eta``, or the top-``cap`` where nothing does."""
    del k
    payload, eta = payload_lib.select_or_top(vectors, eta, cap, jnp.sum(abs_sums))
    return Selection(payload, eta, cap * SLOT_BYTES, filled=True)


def _threshold_rule(ratio: float, slots, threshold, finish=_above) -> Rule:
    """The rule of a threshold estimated from the data: what passes it, in a fixed payload.

    Args:
      ratio: target density.
      slots: ``slots(n, k)``, the payload's slots for ``n`` entries and target ``k``.
      threshold: ``threshold(vectors, abs_sums, n, k, key)``, the threshold ``eta``.
      finish: ``finish(vectors, eta, cap, abs_sums, k)``, the selection from ``eta``
        (default: what passes it, or the top ``cap`` where nothing does).

    At ``k = n`` the rule sends every entry: an estimated threshold would keep those
    at or below it (:func:`~sidco_jax._src.loop.selection.every_entry`).
    """

    def select(vectors, abs_sums, state, key):
        del state
        n = passes.size(vectors)
        k = _k(n, ratio)
        if k >= n:
            return every_entry(vectors)
        eta = threshold(vectors, abs_sums, n, k, key)
        return finish(vectors, eta, slots(n, k), abs_sums, k)

    return Rule(empty_init, select)


def _slots(ratio: float, capacity_factor: float):
    """``slots`` of :func:`_threshold_rule`: ``capacity_factor`` x the target, clipped to n."""
    return lambda n, k: payload_lib.slots_for(n, ratio, capacity_factor)


def _largest(ratio: float, top_k: payload_lib.TopK) -> Rule:
    """The rule sending the ``k`` entries ``top_k`` picks (top-k and approximate top-k)."""

    def select(vectors, abs_sums, state, key):
        del abs_sums, state, key
        k = _k(passes.size(vectors), ratio)
        payload, kth = payload_lib.largest(vectors, k, k, k, top_k=top_k)
        return Selection(payload, kth, k * SLOT_BYTES)

    return Rule(empty_init, select)


@takes_loop_options
def approxk(
    ratio: float,
    *,
    recall_target: float = 0.95,
    **options: Unpack[LoopOptions],
) -> optax.GradientTransformationExtraArgs:
    """Approximate top-k sparsification (``lax.approx_max_k``) with error feedback.

    The same ``k`` and payload as :func:`topk`, the entries picked by
    ``lax.approx_max_k`` on each vector and then among those candidates. On a
    TPU that is an approximate PartialReduce, a few kernels and no full sort,
    which finds each true top-k entry with probability about
    ``recall_target``; the entries it misses stay in the residual. On CPU and
    GPU, XLA computes it exactly: the update is :func:`topk`'s (among equal
    magnitudes the entry picked may differ).

    Args:
      ratio: target density in (0, 1]; ``k = max(floor(n * ratio), 1)``.
      recall_target: expected fraction of the true top-k found on a TPU, in
        (0, 1] (no effect elsewhere).
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: for an argument of the wrong type, bools where a number is
        expected included (see :func:`compress`).
      ValueError: for a value out of range (NaN and inf included) or an
        unknown name.

    References:
      Chern et al., "TPU-KNN: K Nearest Neighbor Search at Peak FLOP/s", 2022.

    Examples:
      >>> import jax.numpy as jnp, sidco_jax as sidco
      >>> tx = sidco.approxk(0.25)
      >>> g = jnp.array([0.1, -5.0, 0.3, 2.0, 0.0, 0.2, -0.4, 0.05])
      >>> tx.update(g, tx.init(g))[0]
      Array([ 0., -5.,  0.,  2.,  0.,  0.,  0.,  0.], dtype=float32)
    """
    why = "is a compile-time argument of lax.approx_max_k and must be static"
    recall_target = static("recall_target", recall_target, why)
    recall_target = check_number("recall_target", recall_target, 0.0, 1.0, open_low=True)
    top_k = functools.partial(lax.approx_max_k, recall_target=recall_target)
    return build(_largest(ratio, top_k), ratio, **options)


@takes_loop_options
def dgc(
    ratio: float,
    *,
    sample_ratio: float = 0.01,
    **options: Unpack[LoopOptions],
) -> optax.GradientTransformationExtraArgs:
    """Deep Gradient Compression's sampled threshold (Lin et al., 2018).

    The threshold is the k-th largest magnitude of a random sample of
    ``sample_ratio`` of the entries (scaled to the sample). When more than
    ``4k/3`` entries pass it, an exact top-k trims the selection to ``k``.
    The payload holds ``ceil(4k/3)`` slots.

    Args:
      ratio: target density in (0, 1].
      sample_ratio: fraction of the entries sampled, in (0, 1].
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: for an argument of the wrong type, bools where a number is
        expected included (see :func:`compress`).
      ValueError: for a value out of range (NaN and inf included) or an
        unknown name.
    """
    sample_ratio = check_ratio(static("sample_ratio", sample_ratio), "sample_ratio")

    def slots(n, k):
        return min(math.ceil(4 * k / 3), n)

    def threshold(vectors, abs_sums, n, k, key):
        del abs_sums, k
        # A stratified sample over the whole index space: the same entries in every layout.
        size = min(max(math.ceil(sample_ratio * n), 1), n)
        sample = jnp.abs(payload_lib.gather_strata(vectors, *payload_lib.draw_strata(key, n, size)))
        size = sample.shape[0]
        return jnp.min(lax.top_k(sample, min(max(math.ceil(size * ratio), 1), size))[0])

    def trim_or_keep(vectors, eta, cap, abs_sums, k):
        selected = passes.count_above(vectors, eta)

        def trim(_):
            return payload_lib.exact_top(vectors, k, cap, selected)

        def keep(_):
            return payload_lib.select_or_top(vectors, eta, cap, jnp.sum(abs_sums))

        payload, eta = lax.cond(selected > cap, trim, keep, None)
        return Selection(payload, eta, cap * SLOT_BYTES, filled=True)

    rule = _threshold_rule(ratio, slots, threshold, trim_or_keep)
    return build(rule, ratio, **options)


@takes_loop_options
def redsync(
    ratio: float,
    *,
    capacity_factor: float = 2.0,
    tolerance: float = 1e-3,
    **options: Unpack[LoopOptions],
) -> optax.GradientTransformationExtraArgs:
    """RedSync's trimmed threshold (Fang et al., 2019).

    Bisection on ``t`` in ``eta = mean + t (max - mean)`` of the magnitudes
    until between ``k`` and ``2k`` entries pass (or the bracket is narrower
    than ``tolerance``); one counting pass per step of the bisection.

    Args:
      ratio: target density in (0, 1].
      capacity_factor: payload slots per ``k`` (default 2, RedSync's window).
      tolerance: smallest bracket width of ``t``, in (0, 1).
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: for an argument of the wrong type, bools where a number is
        expected included (see :func:`compress`).
      ValueError: for a value out of range (NaN and inf included) or an
        unknown name.
    """
    capacity_factor = check_capacity_factor(capacity_factor)
    tolerance = check_number("tolerance", tolerance, 0.0, 1.0, open_low=True, open_high=True)

    def threshold(vectors, abs_sums, n, k, key):
        del key
        total = jnp.sum(abs_sums)
        (top,) = passes.reduce_each(vectors, [lambda v, z: jnp.abs(v) + z], after=total, op=jnp.max)
        mean = total / n

        def threshold_at(t):
            return mean + t * (top - mean)

        def in_window(count):
            return (count > k) & (count < 2 * k)

        def searching(carry):
            lo, hi, _, count = carry
            return (hi - lo > tolerance) & ~in_window(count)

        def bisect(carry):
            lo, hi, _, _ = carry
            t = 0.5 * (lo + hi)
            count = passes.count_above(vectors, threshold_at(t))
            too_few = count <= k
            return jnp.where(too_few, lo, t), jnp.where(too_few, t, hi), t, count

        # zeros_like(mean), not constants: the carry must vary across devices
        # like the body's output does under shard_map.
        zero = jnp.zeros_like(mean)
        start = (zero, zero + 1, zero, jnp.zeros_like(mean, jnp.int32) - 1)
        lo, _, t, count = lax.while_loop(searching, bisect, start)
        # The last probe if it landed in the window, else the lowest bound known to pass > k.
        return threshold_at(jnp.where(in_window(count), t, lo))

    rule = _threshold_rule(ratio, _slots(ratio, capacity_factor), threshold)
    return build(rule, ratio, **options)


@takes_loop_options
def gaussiank(
    ratio: float,
    *,
    capacity_factor: float = 4 / 3,
    **options: Unpack[LoopOptions],
) -> optax.GradientTransformationExtraArgs:
    """Gaussian-k (Shi et al., 2019): a normal quantile, then up to 3 corrections.

    ``eta = |mean| + std * Phi^-1(1 - ratio / 2)`` from the signed entries;
    then, up to three times, halve ``eta`` when fewer than ``2k/3`` entries
    pass and multiply it by 1.5 when more than ``4k/3`` do.

    Args:
      ratio: target density in (0, 1].
      capacity_factor: payload slots per ``k`` (default 4/3, the upper band).
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: for an argument of the wrong type, bools where a number is
        expected included (see :func:`compress`).
      ValueError: for a value out of range (NaN and inf included) or an
        unknown name.
    """
    capacity_factor = check_capacity_factor(capacity_factor)

    def threshold(vectors, abs_sums, n, k, key):
        del key
        # In units of a power of two near the mean magnitude: squares of
        # 1e20-scale entries would overflow float32.
        scale = fits.unit_scale(jnp.sum(abs_sums) / n)
        total, squares = passes.reduce_each(
            vectors, [lambda v, z, s: v * s + z, lambda v, z, s: (v * s) ** 2 + z], [1.0 / scale]
        )
        mean = total / n
        std = jnp.sqrt(jnp.maximum(squares / n - mean * mean, 0.0))
        eta = (jnp.abs(mean) + std * special.ndtri(1.0 - ratio / 2.0)) * scale

        def correct(_, carry):
            eta, done = carry
            count = passes.count_above(vectors, eta, after=eta)
            few, many = 3 * count < 2 * k, 3 * count > 4 * k
            factor = jnp.where(done, 1.0, jnp.where(few, 0.5, jnp.where(many, 1.5, 1.0)))
            return eta * factor, done | ~(few | many)

        eta, _ = lax.fori_loop(0, 3, correct, (eta, jnp.zeros_like(eta, bool)))
        return eta

    rule = _threshold_rule(ratio, _slots(ratio, capacity_factor), threshold)
    return build(rule, ratio, **options)


@takes_loop_options
def randomk(
    ratio: float,
    **options: Unpack[LoopOptions],
) -> optax.GradientTransformationExtraArgs:
    """Random-k: ``k`` random entries, the same on every device.

    Stratified draw: the vector is cut into ``k`` contiguous strata of
    ``n / k`` entries (give or take one) and one uniformly random entry is
    taken from each, so every entry is sent with probability about ``k / n``,
    no entry twice, at ``O(k)`` cost (``jax.random.choice`` without
    replacement permutes all ``n`` entries, docs/design.md). The
    indices follow from the seed and the step count, so only the ``k`` float32
    values need to travel: across devices they are averaged by a ``psum`` of
    ``k`` floats (``bytes`` counts 4 per entry).

    Args:
      ratio: target density in (0, 1].
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Raises:
      TypeError: for an argument of the wrong type, bools where a number is
        expected included (see :func:`compress`).
      ValueError: for a value out of range (NaN and inf included) or an
        unknown name.
    """
    codecs.refuse("randomk", options, "shares its indices, and only float32 values travel")

    def select(vectors, abs_sums, state, key):
        del abs_sums, state
        n = passes.size(vectors)
        k = _k(n, ratio)
        idx, _, _ = payload_lib.draw_strata(key, n, k)
        values = payload_lib.gather(vectors, idx)
        payload = payload_lib.Payload(values, idx, jnp.int32(k), jnp.int32(k))
        zero = jnp.zeros((), jnp.float32)
        return Selection(payload, zero, k * VALUE_BYTES, shared=True)

    return build(Rule(empty_init, select), ratio, **options)


@takes_loop_options(error_feedback=False)
def dense(**options: Unpack[LoopOptions]) -> optax.GradientTransformationExtraArgs:
    """No compression: the plain mean of the gradient over ``axis_name``.

    The same loop as the compressors with a rule that sends everything: a
    ``pmean`` of the gradient, metrics reporting density 1 and the dense
    message bytes, and a non-finite step skipped on every device. It keeps no
    residual unless ``error_feedback=True`` is asked for (one that stays
    zero); ``communication`` does not apply.

    Args:
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`); with
        ``axis_name=None`` the gradient passes through unchanged, and with an
        ``inner_axis`` the mean is over both axes.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`~sidco_jax.CompressState`, so :func:`sidco_jax.metrics` and
      :func:`sidco_jax.parallel.state_specs` work for it too.

    Examples:
      >>> import jax.numpy as jnp, sidco_jax as sidco
      >>> tx = sidco.dense()
      >>> g = jnp.array([0.1, -5.0, 0.3])
      >>> tx.update(g, tx.init(g))[0]
      Array([ 0.1, -5. ,  0.3], dtype=float32)
    """
    codecs.refuse("dense()", options, "sends every entry, with no indices")
    return build(Rule(empty_init, everything), 1.0, **options)
