"""The error-feedback and aggregation loop that every compressor runs.

One step on each device, for the floating-point leaves of the gradient tree::

    u        = g + residual                  # error feedback
    payload  = rule.select(u)                # whole model (default) or per leaf
    update   = mean over devices of payloads # aggregate.py; local if no axis
    residual = u - payload                   # everything not sent, exactly
    rule     = rule.observe(figures)         # e.g. SIDCo's stage controller

:func:`sparsifier` builds that loop around any :class:`~sidco_jax.Rule`;
SIDCo's :func:`~sidco_jax.compress`, the baselines and :func:`~sidco_jax.dense`
differ only in the rule. Integer and boolean leaves pass through untouched. A
step where any device's gradient (or residual) holds a non-finite value sends
nothing anywhere, keeps every residual and raises the ``nonfinite`` flag of the
metrics, so one bad batch cannot poison a residual. Whatever gates state (that
flag, the figures a rule observes) is reduced across the axis first, so every
device takes the same decision and the update stays replicated.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sidco_jax._src import aggregate, passes
from sidco_jax._src import payload as payload_lib
from sidco_jax._src.base import (
    GRANULARITIES,
    AxisName,
    Communication,
    CompressMetrics,
    CompressState,
    Granularity,
    Rule,
    Selection,
    check_axis,
    check_choice,
    is_float,
)


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


def _everything(u: jax.Array) -> payload_lib.Payload:
    """All of ``u`` as a payload (what a rule's ``None`` payload means)."""
    n = u.shape[0]
    count = jnp.int32(n)
    return payload_lib.Payload(u, jnp.arange(n, dtype=jnp.int32), count, count)


def sparsifier(
    rule: Rule,
    *,
    ratio: float,
    granularity: Granularity = "model",
    error_feedback: bool = True,
    seed: int = 0,
    axis_name: AxisName | None = None,
    communication: Communication = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Error feedback and aggregation around a selection rule, as an optax transformation.

    Args:
      rule: the :class:`~sidco_jax.Rule` choosing what to send.
      ratio: target density (reported in the metrics).
      granularity: ``"model"`` (one selection over all floating-point leaves)
        or ``"leaf"`` (one per leaf, merged into one message).
      error_feedback: keep what was not sent and add it to the next gradient.
      seed: seed of the rule's randomness; the key of step ``t`` is
        ``fold_in(key(seed), t)``, the same on every device.
      axis_name: mesh axis (or tuple of axes) to average the update over, or
        None to sparsify locally.
      communication: ``"auto"``, ``"sparse"`` or ``"dense"`` (see
        :func:`sidco_jax.compress`).

    Returns:
      The transformation; its state is a :class:`~sidco_jax.CompressState`.
    """
    check_axis(axis_name, communication)
    check_choice("granularity", granularity, GRANULARITIES)

    def init(params):
        floats = [leaf for leaf in jax.tree.leaves(params) if is_float(leaf)]
        size = sum(int(np.prod(jnp.shape(p))) for p in floats) if error_feedback else 0
        zero = jnp.zeros((), jnp.int32)
        eta = jnp.zeros((len(floats),) if granularity == "leaf" else (), jnp.float32)
        return CompressState(
            residual=jnp.zeros((size,), jnp.float32),
            count=zero,
            last=step_metrics(ratio, zero, zero, 1, eta, 0, jnp.array(True)),
            rule=rule.init(params),
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
        abs_sums = [
            passes.reduce_each(x, [lambda v, z: jnp.abs(v) + z])[0].reshape(1) for x in vectors
        ]
        local_finite = jnp.all(jnp.isfinite(jnp.concatenate(abs_sums)))
        keys = jax.random.split(key, len(vectors))
        chosen = [
            rule.select([x], s, state.rule, k)
            for x, s, k in zip(vectors, abs_sums, keys, strict=True)
        ]
        chosen = [
            c if c.payload is not None else c._replace(payload=_everything(x))
            for c, x in zip(chosen, vectors, strict=True)
        ]
        payload = _merge(chosen, [x.shape[0] for x in vectors])
        etas = chosen[0].threshold if whole else jnp.stack([c.threshold for c in chosen])
        shared = all(c.shared for c in chosen)

        # Every device agrees on the step before anything is sent: one
        # non-finite device makes all of them send nothing and keep their
        # residuals, and the rule sees the same figures everywhere.
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
            mode = "sparse" if shared else aggregate.resolve(communication, n, capacity, devices)
            mean = aggregate.mean(payload, n, axis_name, mode, shared)

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
            else aggregate.message_bytes(mode, n, capacity, shared)
        )
        last = step_metrics(ratio, sent, selected, n * devices, etas, message, finite)
        rule_state = rule.observe(state.rule, last)
        new_state = CompressState(residual, state.count + 1, last, rule_state)
        return jax.tree.unflatten(treedef, new_leaves), new_state

    return optax.GradientTransformationExtraArgs(init, update)
