"""Sparsifying optax transformations with error feedback, and SIDCo's ``compress``.

One step on each device, for the floating-point leaves of the gradient tree
flattened into one float32 vector::

    u        = g + residual                  # error feedback
    payload  = select(u)                     # whole model (default) or per leaf
    update   = mean over devices of payloads # collectives.py; local if no axis
    residual = u - payload                   # everything not sent, exactly

:func:`sparsifier` builds that loop around any selection rule; SIDCo's
:func:`compress` and the baselines in ``baselines.py`` differ only in the rule.
Integer and boolean leaves pass through untouched. A step where any device's
gradient (or residual) holds a non-finite value sends nothing anywhere, keeps
every residual and raises the ``nonfinite`` flag of the metrics, so one bad
batch cannot poison a residual. Whatever gates state (that flag, the stage
controller's statistic) is reduced across the axis first, so every device
takes the same decision and the update stays replicated.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sidco_jax._src import collectives, thresholds
from sidco_jax._src import control as control_lib
from sidco_jax._src import payload as payload_lib

GRANULARITIES = ("model", "leaf")
SLOT_BYTES = 4 + 4  # a float32 value and an int32 index


class Selection(NamedTuple):
    """What a selection rule returns for one flat float32 vector.

    Attributes:
      payload: the entries to send.
      threshold: the magnitude threshold used (0 where the rule has none).
      finite: whether the vector was finite (nothing is sent otherwise).
      bytes: static size of the message in bytes.
      shared: whether the indices are the same on every device (then only the
        values need to travel).
    """

    payload: payload_lib.Payload
    threshold: jax.Array
    finite: jax.Array
    bytes: int
    shared: bool = False


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
      residual: this device's float32 error-feedback residual: one flat vector
        over the floating-point leaves in ``jax.tree.leaves`` order (length 0
        without error feedback). Per device: under ``jax.shard_map`` its
        partition spec is ``P(axis_name)`` (see :func:`sidco_jax.state_specs`).
      stages: int32 stage count of SIDCo's thresholds (0 for the baselines).
      control: the stage controller's state (empty without adaptation).
      count: int32 number of steps taken.
      last: :class:`CompressMetrics` of the last step.
    """

    residual: jax.Array
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


def check_axis(axis_name, communication: str = "auto") -> None:
    """Validates ``axis_name`` and ``communication`` (raises ``ValueError``)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not (names and all(isinstance(a, str) for a in names)):
        raise ValueError(
            f"axis_name must be None, a mesh axis name or a tuple of them, got {axis_name!r}"
        )
    collectives.check_mode(communication)


def reduce_figures(axis_name, finite, sent, selected, eta):
    """This step's figures agreed across ``axis_name``: identical on every device.

    Returns ``(finite, sent, selected, eta)``: finite on every device, the
    total entries sent and selected, and the mean threshold. One ``psum``.
    """
    if axis_name is None:
        return finite, sent, selected, eta
    ints = jnp.stack([(~finite).astype(jnp.int32), sent.astype(jnp.int32)])
    # Selected counts can exceed int32 once summed: float32 is enough for a density.
    floats = jnp.concatenate([jnp.reshape(selected, (1,)).astype(jnp.float32), eta.reshape(-1)])
    ints, floats = lax.psum((ints, floats), axis_name)
    devices = lax.axis_size(axis_name)
    return ints[0] == 0, ints[1], floats[0], (floats[1:] / devices).reshape(eta.shape)


def _merge(chosen: list[Selection], sizes: list[int]) -> payload_lib.Payload:
    """One payload over the concatenated vector from per-leaf payloads."""
    if len(chosen) == 1:
        return chosen[0].payload
    n = sum(sizes)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    indices = [
        jnp.where(c.payload.indices < size, c.payload.indices + offset, n)
        for c, size, offset in zip(chosen, sizes, offsets, strict=True)
    ]
    return payload_lib.Payload(
        jnp.concatenate([c.payload.values for c in chosen]),
        jnp.concatenate(indices).astype(jnp.int32),
        sum((c.payload.count for c in chosen), jnp.int32(0)),
        sum((c.payload.selected for c in chosen), jnp.int32(0)),
    )


def _round_to_leaves(values, indices, grads, sizes):
    """Rounds each sent value to the dtype of the leaf it belongs to.

    The update leaves in the gradient's dtype; rounding here, on the payload,
    lets the residual keep the rounding error so that bf16/fp16 lose nothing.
    """
    dtypes = [g.dtype for g in grads]
    if all(d == jnp.float32 for d in dtypes):
        return values
    if len(set(dtypes)) == 1:
        return values.astype(dtypes[0]).astype(jnp.float32)
    leaf = jnp.searchsorted(jnp.asarray(np.cumsum(sizes)), indices, side="right")
    rounded = values
    for dtype in set(dtypes) - {jnp.dtype(jnp.float32)}:
        mine = jnp.isin(leaf, jnp.asarray([i for i, d in enumerate(dtypes) if d == dtype]))
        rounded = jnp.where(mine, values.astype(dtype).astype(jnp.float32), rounded)
    return rounded


def sparsifier(
    select: Select,
    *,
    ratio: float,
    granularity: str = "model",
    error_feedback: bool = True,
    stages: int = 0,
    adapt: Callable | None = None,
    seed: int = 0,
    axis_name: collectives.AxisName | None = None,
    communication: str = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Error feedback and aggregation around a selection rule, as an optax transformation.

    Args:
      select: ``select(u, stages, key) -> Selection`` for a flat float32 vector.
      ratio: target density (reported in the metrics).
      granularity: ``"model"`` (one selection over all floating-point leaves)
        or ``"leaf"`` (one per leaf, merged into one message).
      error_feedback: keep what was not sent and add it to the next gradient.
      stages: initial stage count handed to ``select``.
      adapt: optional ``adapt(stages, control, achieved_over_target) ->
        (stages, control)`` run after every step; its state starts as
        ``control.init()``.
      seed: seed of the rule's randomness; the key of step ``t`` is
        ``fold_in(key(seed), t)``, the same on every device.
      axis_name: mesh axis (or tuple of axes) to average the update over, or
        None to sparsify locally.
      communication: ``"auto"``, ``"sparse"`` or ``"dense"`` (see
        ``collectives.py``).

    Returns:
      The transformation.
    """
    check_axis(axis_name, communication)

    def init(params):
        floats = [leaf for leaf in jax.tree.leaves(params) if is_float(leaf)]
        size = sum(int(np.prod(jnp.shape(p))) for p in floats) if error_feedback else 0
        zero = jnp.zeros((), jnp.int32)
        eta = jnp.zeros((len(floats),) if granularity == "leaf" else (), jnp.float32)
        return CompressState(
            residual=jnp.zeros((size,), jnp.float32),
            stages=jnp.asarray(stages, jnp.int32),
            control=control_lib.init() if adapt is not None else (),
            count=zero,
            last=step_metrics(ratio, zero, zero, 1, eta, 0, jnp.array(True)),
        )

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        float_at = [i for i, leaf in enumerate(leaves) if is_float(leaf)]
        if not float_at:
            return updates, state._replace(count=state.count + 1)
        grads = [jnp.asarray(leaves[i]) for i in float_at]
        sizes = [g.size for g in grads]
        n = sum(sizes)
        u = jnp.concatenate([g.astype(jnp.float32).reshape(-1) for g in grads])
        if error_feedback:
            u = u + state.residual
        key = jax.random.fold_in(jax.random.key(seed), state.count)

        whole = granularity == "model" or len(grads) == 1
        vectors = [u] if whole else jnp.split(u, np.cumsum(sizes)[:-1].tolist())
        keys = jax.random.split(key, len(vectors))
        chosen = [select(x, state.stages, k) for x, k in zip(vectors, keys, strict=True)]
        payload = _merge(chosen, [x.shape[0] for x in vectors])
        etas = chosen[0].threshold if whole else jnp.stack([c.threshold for c in chosen])
        shared = all(c.shared for c in chosen)
        local_finite = jnp.all(jnp.stack([c.finite for c in chosen]))

        # Every device agrees on the step before anything is sent: one
        # non-finite device makes all of them send nothing and keep their
        # residuals, and the stage controller sees the same mean everywhere.
        sent = jnp.where(local_finite, payload.count, 0)
        finite, sent, selected, etas = reduce_figures(
            axis_name, local_finite, sent, payload.selected, etas
        )
        values = jnp.where(
            finite, _round_to_leaves(payload.values, payload.indices, grads, sizes), 0.0
        )
        payload = payload._replace(values=values)

        capacity = payload.values.shape[0]
        if axis_name is None:
            devices, mode = 1, "sparse"
            mean = payload_lib.densify(payload, n)
        else:
            devices = lax.axis_size(axis_name)
            # Shared indices need only a psum of the values, whatever the mode.
            mode = "sparse" if shared else collectives.resolve(communication, n, capacity, devices)
            mean = collectives.mean(payload, n, axis_name, mode, shared)

        new_leaves = list(leaves)
        for i, part, g in zip(
            float_at, jnp.split(mean, np.cumsum(sizes)[:-1].tolist()), grads, strict=True
        ):
            new_leaves[i] = part.reshape(g.shape).astype(g.dtype)
        # What this device did not send stays in its residual, exactly.
        residual = state.residual
        if error_feedback:
            left = u.at[payload.indices].add(-payload.values, mode="drop")
            residual = jnp.where(finite, left, state.residual)

        message = (
            sum(c.bytes for c in chosen)
            if mode == "sparse"
            else collectives.message_bytes(mode, n, capacity, shared)
        )
        last = step_metrics(ratio, sent, selected, n * devices, etas, message, finite)
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
    axis_name: collectives.AxisName | None = None,
    communication: str = "auto",
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
      axis_name: mesh axis (or tuple of axes) of ``jax.shard_map`` or
        ``jax.pmap`` to average the update over; None (default) sparsifies
        locally with no collective. With an axis the update is the mean of
        all devices' messages, identical on every device, and the residual is
        per device (see :func:`sidco_jax.state_specs`).
      communication: how the messages are averaged: ``"sparse"``
        (``all_gather`` of values and indices, then a scatter-add),
        ``"dense"`` (``psum`` of the densified message, for fast links) or
        ``"auto"`` (default: the one that moves fewer bytes, decided at trace
        time; sparse exactly when ``devices x capacity < n``).

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
        axis_name=axis_name,
        communication=communication,
    )
