"""``compress``: SIDCo sparsification with error feedback as an optax transformation.

One step on one device, for the floating-point leaves of the gradient tree::

    u        = g + residual              # error feedback, float32
    eta      = threshold(u, ratio)       # whole model (default) or per leaf
    payload  = sparsify(u, eta, capacity)
    update   = densify(payload)          # what this device sends
    residual = u - update                # everything not sent, exactly

Integer and boolean leaves pass through untouched. A step whose gradient (or
residual) holds a non-finite value sends nothing, keeps the old residual and
raises the ``nonfinite`` flag of the metrics, so one bad batch cannot poison
the residual.

Aggregation across devices (``axis_name``) and the adaptive stage controller
are not part of this module yet: the update is the locally sparsified
gradient, with a fixed stage count.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sidco_jax._src import payload as payload_lib
from sidco_jax._src import thresholds

GRANULARITIES = ("model", "leaf")
_SLOT_BYTES = 4 + 4  # a float32 value and an int32 index


class CompressMetrics(NamedTuple):
    """Figures of the last step (see :func:`sidco_jax.metrics`).

    Attributes:
      target_density: the ``ratio`` asked for.
      density: fraction of the entries sent.
      selected_density: fraction of the entries above the threshold, before
        the capacity cut.
      threshold: magnitude threshold (one per leaf with ``granularity="leaf"``).
      overflow: entries above the threshold that did not fit and stayed in the
        residual.
      bytes: payload bytes (values + int32 indices) of a fixed-capacity message.
      nonfinite: whether the step met a non-finite value and sent nothing.
    """

    target_density: jax.Array
    density: jax.Array
    selected_density: jax.Array
    threshold: jax.Array
    overflow: jax.Array
    bytes: jax.Array
    nonfinite: jax.Array


class CompressState(NamedTuple):
    """State of :func:`compress`.

    Attributes:
      residual: float32 error-feedback residual of each floating-point leaf, in
        ``jax.tree.leaves`` order (empty without error feedback).
      stages: int32 stage count used by the thresholds.
      count: int32 number of steps taken.
      last: :class:`CompressMetrics` of the last step.
    """

    residual: tuple[jax.Array, ...]
    stages: jax.Array
    count: jax.Array
    last: CompressMetrics


def _is_float(leaf) -> bool:
    return jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)


def _static(name: str, value):
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} sets the payload shape and must be static; with optax.inject_hyperparams "
            f"list it in static_args, e.g. static_args=('ratio', 'capacity_factor')"
        )
    return value


def _check(ratio, estimator, stages, first_ratio, capacity_factor, granularity) -> None:
    thresholds.check_ratio(_static("ratio", ratio))
    thresholds.check_estimator(estimator)
    thresholds.check_ratio(first_ratio, "first_ratio")
    limit = thresholds.max_stages(ratio)
    # A traced stage count (optax.inject_hyperparams) is clipped in the graph.
    value = None if isinstance(stages, jax.core.Tracer) else np.asarray(stages)
    if value is not None and not (
        value.shape == () and np.issubdtype(value.dtype, np.integer) and 1 <= value <= limit
    ):
        raise ValueError(
            f"stages must be an integer in [1, {limit}] for ratio {ratio}, got {stages!r}"
        )
    if not _static("capacity_factor", capacity_factor) >= 1.0:
        raise ValueError(f"capacity_factor must be >= 1, got {capacity_factor!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def compress(
    ratio: float,
    *,
    estimator: str = "exponential",
    stages: int | None = None,
    first_ratio: float = 0.25,
    capacity_factor: float = 1.0,
    granularity: str = "model",
    error_feedback: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """SIDCo gradient sparsification with error feedback.

    Args:
      ratio: target density in (0, 1]: the fraction of entries sent per step.
        Static (it sets the payload capacity).
      estimator: ``"exponential"`` (SIDCo-E), ``"gpareto"`` (SIDCo-P) or
        ``"gamma"`` (SIDCo-GP).
      stages: number of threshold stages, in ``[1, max_stages(ratio)]``; by
        default ``min(3, max_stages(ratio))``, which kept synthetic
        heavy- and light-tailed gradients within 0.82-1.17x of the target
        (docs/benchmarks.md).
      first_ratio: density targeted by the first of several stages.
      capacity_factor: payload slots per expected entry (>= 1); entries beyond
        the capacity stay in the residual. Static.
      granularity: ``"model"`` (one threshold over all floating-point leaves,
        as in the paper) or ``"leaf"`` (one threshold and payload per leaf).
      error_feedback: keep what was not sent and add it to the next gradient.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update is the
      sparsified gradient (same tree and dtypes as the input).

    Raises:
      ValueError: for any argument outside its allowed range, with the value.

    Examples:
      >>> import jax.numpy as jnp, optax, sidco_jax as sidco
      >>> tx = optax.chain(sidco.compress(0.1), optax.sgd(0.1))
      >>> params = {"w": jnp.arange(20.0) - 10.0}
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> int(jnp.count_nonzero(updates["w"]))
      2
    """
    if stages is None:
        stages = min(3, thresholds.max_stages(_static("ratio", ratio)))
    _check(ratio, estimator, stages, first_ratio, capacity_factor, granularity)

    def init(params):
        floats = [leaf for leaf in jax.tree.leaves(params) if _is_float(leaf)]
        residual = tuple(jnp.zeros(jnp.shape(p), jnp.float32) for p in floats)
        zero = jnp.zeros((), jnp.float32)
        last = CompressMetrics(
            target_density=jnp.asarray(ratio, jnp.float32),
            density=zero,
            selected_density=zero,
            threshold=jnp.zeros((len(floats),) if granularity == "leaf" else (), jnp.float32),
            overflow=jnp.zeros((), jnp.int32),
            bytes=jnp.zeros((), jnp.int32),
            nonfinite=jnp.zeros((), bool),
        )
        return CompressState(
            residual=residual if error_feedback else (),
            stages=jnp.asarray(stages, jnp.int32),
            count=jnp.zeros((), jnp.int32),
            last=last,
        )

    def sparsify_flat(u, stage_count):
        cap = payload_lib.capacity(u.shape[0], ratio, capacity_factor)
        eta = thresholds.threshold(
            u, ratio, estimator=estimator, stages=stage_count, first_ratio=first_ratio
        )
        packed = payload_lib.sparsify(u, eta, cap)
        return payload_lib.densify(packed, u.shape[0]), eta, packed, cap

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        float_at = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
        grads = [jnp.asarray(leaves[i]) for i in float_at]
        old = state.residual if error_feedback else tuple(jnp.zeros(()) for _ in grads)
        u = [
            g.astype(jnp.float32).reshape(-1) + r.reshape(-1)
            for g, r in zip(grads, old, strict=True)
        ]
        sizes = [x.shape[0] for x in u]
        total = sum(sizes)

        if granularity == "model" and u:
            flat = jnp.concatenate(u) if len(u) > 1 else u[0]
            sent_flat, eta, packed, cap = sparsify_flat(flat, state.stages)
            splits = jnp.split(sent_flat, np.cumsum(sizes)[:-1].tolist())
            etas, counts, selected, caps = eta, packed.count, packed.selected, cap
            finite = jnp.isfinite(eta)
        else:
            results = [sparsify_flat(x, state.stages) for x in u]
            splits = [r[0] for r in results]
            etas = jnp.stack([r[1] for r in results]) if results else state.last.threshold
            counts = sum((r[2].count for r in results), jnp.int32(0))
            selected = sum((r[2].selected for r in results), jnp.int32(0))
            caps = sum(r[3] for r in results)
            finite = jnp.all(jnp.isfinite(etas))

        # A non-finite step sends nothing and leaves the residual as it was. The
        # update is rounded to the gradient's dtype; the rounding error stays in
        # the residual, so nothing is lost with bf16/fp16 gradients either.
        sent = [
            jnp.where(finite, s, 0.0).astype(g.dtype).astype(jnp.float32)
            for s, g in zip(splits, grads, strict=True)
        ]
        new_leaves = list(leaves)
        for i, s, g in zip(float_at, sent, grads, strict=True):
            new_leaves[i] = s.reshape(jnp.shape(g)).astype(g.dtype)
        if error_feedback:
            residual = tuple(
                jnp.where(finite, x - s, r.reshape(-1)).reshape(r.shape)
                for x, s, r in zip(u, sent, old, strict=True)
            )
        else:
            residual = ()

        denom = max(total, 1)
        last = CompressMetrics(
            target_density=state.last.target_density,
            density=jnp.where(finite, counts, 0).astype(jnp.float32) / denom,
            selected_density=selected.astype(jnp.float32) / denom,
            threshold=jnp.asarray(etas, jnp.float32),
            overflow=jnp.where(finite, selected - counts, 0).astype(jnp.int32),
            bytes=jnp.asarray(caps * _SLOT_BYTES, jnp.int32),
            nonfinite=~finite,
        )
        new_state = CompressState(residual, state.stages, state.count + 1, last)
        return jax.tree.unflatten(treedef, new_leaves), new_state

    return optax.GradientTransformationExtraArgs(init, update)
