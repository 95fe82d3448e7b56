"""Sparsifying optax transformations with error feedback, and SIDCo's ``compress``.

One step on one device, for the floating-point leaves of the gradient tree::

    u        = g + residual              # error feedback, float32
    payload  = select(u)                 # whole model (default) or per leaf
    update   = densify(payload)          # what this device sends
    residual = u - update                # everything not sent, exactly

:func:`sparsifier` builds that loop around any selection rule; SIDCo's
:func:`compress` and the baselines in ``baselines.py`` differ only in the rule.
Integer and boolean leaves pass through untouched. A step whose gradient (or
residual) holds a non-finite value sends nothing, keeps the old residual and
raises the ``nonfinite`` flag of the metrics, so one bad batch cannot poison
the residual. Aggregation across devices is not part of this module yet: the
update is the locally sparsified gradient.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sidco_jax._src import control as control_lib
from sidco_jax._src import payload as payload_lib
from sidco_jax._src import thresholds

GRANULARITIES = ("model", "leaf")
SLOT_BYTES = 4 + 4  # a float32 value and an int32 index


class Selection(NamedTuple):
    """What a selection rule returns for one flat float32 vector.

    Attributes:
      payload: the entries to send.
      threshold: the magnitude threshold used (0 where the rule has none).
      finite: whether the vector was finite (nothing is sent otherwise).
      bytes: static size of the message in bytes.
    """

    payload: payload_lib.Payload
    threshold: jax.Array
    finite: jax.Array
    bytes: int


# select(u, stages, key) -> Selection, for a flat float32 vector u.
Select = Callable[[jax.Array, jax.Array, jax.Array], Selection]


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
      bytes: bytes of one message (fixed-capacity values + int32 indices).
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
    """State of :func:`compress` and of the baselines.

    Attributes:
      residual: float32 error-feedback residual of each floating-point leaf, in
        ``jax.tree.leaves`` order (empty without error feedback).
      stages: int32 stage count of SIDCo's thresholds (0 for the baselines).
      control: the stage controller's state (empty without adaptation).
      count: int32 number of steps taken.
      last: :class:`CompressMetrics` of the last step.
    """

    residual: tuple[jax.Array, ...]
    stages: jax.Array
    control: Any
    count: jax.Array
    last: CompressMetrics


def is_float(leaf) -> bool:
    """Whether a gradient leaf takes part in compression (floating-point dtype)."""
    return jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)


def static(name: str, value):
    """Returns ``value``, or raises a clear error if a shape-setting option is traced."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} sets the payload shape and must be static; with optax.inject_hyperparams "
            f"list it in static_args, e.g. static_args=('ratio', 'capacity_factor')"
        )
    return value


def _concrete(value):
    """``value`` as a NumPy array, or None if traced (``optax.inject_hyperparams``)."""
    return None if isinstance(value, jax.core.Tracer) else np.asarray(value)


def _check_integer(name, value, low, high, context=""):
    v = _concrete(value)
    if v is not None and not (
        v.shape == ()
        and np.issubdtype(v.dtype, np.integer)
        and low <= v
        and (high is None or v <= high)
    ):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {allowed}{context}, got {value!r}")


def check_common(ratio, capacity_factor, granularity) -> None:
    """Validates the options every sparsifier shares (raises ``ValueError``)."""
    thresholds.check_ratio(static("ratio", ratio))
    if not static("capacity_factor", capacity_factor) >= 1.0:
        raise ValueError(f"capacity_factor must be >= 1, got {capacity_factor!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def step_metrics(ratio, sent, selected, n, eta, message, finite) -> CompressMetrics:
    """The :class:`CompressMetrics` of a step that sent ``sent`` of ``n`` entries."""
    n = max(n, 1)
    return CompressMetrics(
        target_density=jnp.asarray(ratio, jnp.float32),
        density=jnp.where(finite, sent, 0).astype(jnp.float32) / n,
        selected_density=jnp.asarray(selected, jnp.float32) / n,
        threshold=jnp.asarray(eta, jnp.float32),
        overflow=jnp.where(finite, selected - sent, 0).astype(jnp.int32),
        bytes=jnp.asarray(message, jnp.int32),
        nonfinite=~finite,
    )


def sparsifier(
    select: Select,
    *,
    ratio: float,
    granularity: str = "model",
    error_feedback: bool = True,
    stages: int = 0,
    adapt: Callable | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Error feedback around a selection rule, as an optax transformation.

    Args:
      select: ``select(u, stages, key) -> Selection`` for a flat float32 vector.
      ratio: target density (reported in the metrics).
      granularity: ``"model"`` (one selection over all floating-point leaves)
        or ``"leaf"`` (one per leaf).
      error_feedback: keep what was not sent and add it to the next gradient.
      stages: initial stage count handed to ``select``.
      adapt: optional ``adapt(stages, control, achieved_over_target) ->
        (stages, control)`` run after every step; its state starts as
        ``control.init()``.
      seed: seed of the rule's randomness; the key of step ``t`` is
        ``fold_in(key(seed), t)``, the same on every device.

    Returns:
      The transformation.
    """

    def init(params):
        floats = [leaf for leaf in jax.tree.leaves(params) if is_float(leaf)]
        zero = jnp.zeros((), jnp.int32)
        eta = jnp.zeros((len(floats),) if granularity == "leaf" else (), jnp.float32)
        return CompressState(
            residual=tuple(jnp.zeros(jnp.shape(p), jnp.float32) for p in floats)
            if error_feedback
            else (),
            stages=jnp.asarray(stages, jnp.int32),
            control=control_lib.init() if adapt is not None else (),
            count=zero,
            last=step_metrics(ratio, zero, zero, 1, eta, 0, jnp.array(True)),
        )

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        float_at = [i for i, leaf in enumerate(leaves) if is_float(leaf)]
        grads = [jnp.asarray(leaves[i]) for i in float_at]
        old = state.residual if error_feedback else tuple(jnp.zeros(()) for _ in grads)
        u = [
            g.astype(jnp.float32).reshape(-1) + r.reshape(-1)
            for g, r in zip(grads, old, strict=True)
        ]
        sizes = [x.shape[0] for x in u]
        key = jax.random.fold_in(jax.random.key(seed), state.count)

        whole = granularity == "model" and len(u) > 0
        vectors = [jnp.concatenate(u) if len(u) > 1 else u[0]] if whole else u
        keys = jax.random.split(key, max(len(vectors), 1))
        chosen = [select(x, state.stages, k) for x, k in zip(vectors, keys, strict=False)]
        if whole:
            etas = chosen[0].threshold
        else:
            etas = jnp.stack([c.threshold for c in chosen]) if chosen else state.last.threshold
        finite = jnp.all(jnp.stack([c.finite for c in chosen])) if chosen else jnp.array(True)

        # A non-finite step sends nothing (masked on the payload, not the dense
        # vector) and leaves the residual as it was. The update is rounded to the
        # gradient's dtype and the rounding error stays in the residual, so
        # nothing is lost with bf16/fp16 gradients either.
        dense = [
            payload_lib.densify(
                c.payload._replace(values=jnp.where(finite, c.payload.values, 0.0)), x.shape[0]
            )
            for c, x in zip(chosen, vectors, strict=True)
        ]
        splits = jnp.split(dense[0], np.cumsum(sizes)[:-1].tolist()) if whole else dense
        sent = [s.astype(g.dtype).astype(jnp.float32) for s, g in zip(splits, grads, strict=True)]
        new_leaves = list(leaves)
        for i, s, g in zip(float_at, sent, grads, strict=True):
            new_leaves[i] = s.reshape(g.shape).astype(g.dtype)
        residual = (
            tuple(
                jnp.where(finite, x - s, r.reshape(-1)).reshape(r.shape)
                for x, s, r in zip(u, sent, old, strict=True)
            )
            if error_feedback
            else ()
        )

        count = sum((c.payload.count for c in chosen), jnp.int32(0))
        selected = sum((c.payload.selected for c in chosen), jnp.int32(0))
        message = sum(c.bytes for c in chosen)
        last = step_metrics(ratio, count, selected, sum(sizes), etas, message, finite)
        stages_, control = state.stages, state.control
        if adapt is not None:
            achieved = last.density / last.target_density
            stages_, control = adapt(stages_, control, jnp.where(finite, achieved, 1.0))
        new_state = CompressState(residual, stages_, control, state.count + 1, last)
        return jax.tree.unflatten(treedef, new_leaves), new_state

    return optax.GradientTransformationExtraArgs(init, update)


def compress(
    ratio: float,
    *,
    estimator: str = "exponential",
    stages: int | None = None,
    adaptation: str | None = "paper",
    first_ratio: float = 0.25,
    capacity_factor: float = 1.0,
    granularity: str = "model",
    error_feedback: bool = True,
    period: int = 5,
    band: float = 0.2,
) -> optax.GradientTransformationExtraArgs:
    """SIDCo gradient sparsification with error feedback.

    Args:
      ratio: target density in (0, 1]: the fraction of entries sent per step.
        Static (it sets the payload capacity).
      estimator: ``"exponential"`` (SIDCo-E), ``"gpareto"`` (SIDCo-P) or
        ``"gamma"`` (SIDCo-GP).
      stages: (initial) number of threshold stages, in
        ``[1, max_stages(ratio)]``; by default ``min(3, max_stages(ratio))``.
      adaptation: how the stage count follows the achieved density:
        ``"paper"`` (default: every ``period`` steps one stage fewer above
        ``1 + band`` x target, one more below ``1 - band``), ``"directional"``
        (reverses after a move that did not help) or ``None`` (fixed). The
        default was chosen on training runs under error feedback
        (docs/benchmarks.md).
      first_ratio: density targeted by the first of several stages.
      capacity_factor: payload slots per expected entry (>= 1); entries beyond
        the capacity stay in the residual. Static.
      granularity: ``"model"`` (one threshold over all floating-point leaves,
        as in the paper) or ``"leaf"`` (one threshold and payload per leaf).
      error_feedback: keep what was not sent and add it to the next gradient.
      period: steps per adaptation window (the paper's ``Q``).
      band: tolerance of the adaptation around the target (the paper's 0.2).

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
    check_common(ratio, capacity_factor, granularity)
    thresholds.check_estimator(estimator)
    thresholds.check_ratio(first_ratio, "first_ratio")
    limit = thresholds.max_stages(ratio)
    if stages is None:
        stages = min(3, limit)
    _check_integer("stages", stages, 1, limit, f" for ratio {ratio}")
    if adaptation is not None and adaptation not in control_lib.RULES:
        raise ValueError(
            f"adaptation must be None or one of {control_lib.RULES}, got {adaptation!r}"
        )
    _check_integer("period", period, 1, None)
    band_value = _concrete(band)
    if band_value is not None and not 0.0 < band_value < 1.0:
        raise ValueError(f"band must be in (0, 1), got {band!r}")

    def select(u, stage_count, key):
        del key
        eta = thresholds.threshold(
            u, ratio, estimator=estimator, stages=stage_count, first_ratio=first_ratio
        )
        cap = payload_lib.capacity(u.shape[0], ratio, capacity_factor)
        return Selection(
            payload_lib.sparsify(u, eta, cap), eta, jnp.isfinite(eta), cap * SLOT_BYTES
        )

    adapt = None
    if adaptation is not None:

        def adapt(stage_count, control, achieved_over_target):
            return control_lib.adapt(
                stage_count,
                control,
                achieved_over_target,
                rule=adaptation,
                period=period,
                band=band,
                max_stages=limit,
            )

    return sparsifier(
        select,
        ratio=ratio,
        granularity=granularity,
        error_feedback=error_feedback,
        stages=stages,
        adapt=adapt,
    )
