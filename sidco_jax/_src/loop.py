"""The error-feedback and aggregation loop that every compressor runs.

One step on each device, leaf by leaf over the floating-point leaves of the
gradient tree (never copied into one flat vector)::

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
    """One payload over the concatenated groups from per-group payloads (k-sized)."""
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


def _round_to_leaves(values, indices, dtypes, sizes):
    """Rounds each sent value to the dtype of the leaf it belongs to.

    The update leaves in the gradient's dtype; rounding here, on the payload,
    lets the residual keep the rounding error so that bf16/fp16 lose nothing.
    """
    if all(d == jnp.float32 for d in dtypes):
        return values
    if len(set(dtypes)) == 1:
        return values.astype(dtypes[0]).astype(jnp.float32)
    offsets = np.cumsum([0, *sizes])
    rounded = values
    for dtype, start, stop in zip(dtypes, offsets[:-1], offsets[1:], strict=True):
        if dtype != jnp.float32:
            mine = (indices >= start) & (indices < stop)
            rounded = jnp.where(mine, values.astype(dtype).astype(jnp.float32), rounded)
    return rounded


def residual_like(params, error_feedback: bool = True):
    """A zero float32 residual for every floating-point leaf of ``params``.

    Shaped like the leaf (at least 1-D, so it can be split over a mesh axis);
    a zero-size vector for other leaves. None without error feedback.
    """
    if not error_feedback:
        return None

    def zero(leaf):
        shape = jnp.shape(leaf) if is_float(leaf) else (0,)
        return jnp.zeros(shape if len(shape) else (1,), jnp.float32)

    return jax.tree.map(zero, params)


def _subtract_at(x: jax.Array, flat_index: jax.Array, values: jax.Array) -> jax.Array:
    """``x`` with ``values`` subtracted at row-major ``flat_index`` (``x.size``: dropped).

    Indexed in ``x``'s own shape, so XLA updates it in place in its buffer.
    """
    if x.size == 0:
        return x
    index, rest = [], flat_index
    for dim in reversed(x.shape[1:]):
        index.append(rest % dim)
        rest = rest // dim
    index.append(rest)  # the padding index x.size lands past the first axis: dropped
    return x.at[tuple(reversed(index))].add(-values, mode="drop")


def _abs_sum(pair, zero):
    g, r = pair
    return jnp.abs(g.astype(jnp.float32) + r) + zero


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

    Nothing copies the gradient into one flat vector: the residual is a tree
    like the parameters, the rule's statistics are summed leaf by leaf, the
    payload's indices run over the leaves in ``jax.tree.leaves`` order, the
    update and the residual are written leaf by leaf, and the non-finite gate
    acts on the fixed-size payload and the step's figures.

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
        zero = jnp.zeros((), jnp.int32)
        eta = jnp.zeros((len(floats),) if granularity == "leaf" else (), jnp.float32)
        return CompressState(
            residual=residual_like(params, error_feedback),
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
        # Everything full-size keeps the residual's shapes (the leaf's, at least
        # 1-D): a reshape between the in-place write-back and the donated state
        # would cost XLA a copy of every multi-dimensional leaf.
        if error_feedback:
            old = jax.tree.leaves(state.residual)
            old = [old[i] for i in float_at]
        else:
            old = [jnp.zeros(np.shape(g) or (1,), jnp.float32) for g in grads]
        flat = [g.reshape(r.shape) for g, r in zip(grads, old, strict=True)]

        # First pass, fused with the residual add: sum(|g + r|) per leaf, for
        # the finite check and for the rules' statistics.
        abs_sums = jnp.stack(passes.reduce_parts(list(zip(flat, old, strict=True)), _abs_sum))
        local_finite = jnp.all(jnp.isfinite(abs_sums))
        # A non-finite device keeps its residual as it was (u = r sends nothing).
        u = [
            jnp.where(local_finite, g.astype(jnp.float32) + r, r)
            if error_feedback
            else g.astype(jnp.float32)
            for g, r in zip(flat, old, strict=True)
        ]
        key = jax.random.fold_in(jax.random.key(seed), state.count)

        groups = [list(range(len(u)))] if granularity == "model" else [[i] for i in range(len(u))]
        keys = jax.random.split(key, len(groups))
        chosen = [
            rule.select(
                [u[i].reshape(-1) for i in group], abs_sums[np.asarray(group)], state.rule, k
            )
            for group, k in zip(groups, keys, strict=True)
        ]
        etas = (
            chosen[0].threshold
            if granularity == "model"
            else jnp.stack([c.threshold for c in chosen])
        )
        shared = all(c.shared for c in chosen)
        everything = chosen[0].payload is None
        group_sizes = [sum(sizes[i] for i in group) for group in groups]

        if everything:
            sent = jnp.where(local_finite, n, 0).astype(jnp.int32)
            selected = jnp.int32(n)
        else:
            payload = _merge(chosen, group_sizes)
            sent = jnp.where(local_finite, payload.count, 0)
            selected = payload.selected
        # Every device agrees on the step before anything is sent: one
        # non-finite device makes all of them send nothing, and the rule sees
        # the same figures everywhere.
        finite, sent, selected, etas = reduce_figures(axis_name, local_finite, sent, selected, etas)

        devices = 1 if axis_name is None else lax.axis_size(axis_name)
        if everything:
            zero = jnp.zeros((), jnp.float32)
            mean = [jnp.where(finite, x, zero) for x in u]
            if axis_name is not None:
                mean = lax.pmean(mean, axis_name)
            message, mode = aggregate.message_bytes("dense", n, n), "dense"
            left = [jnp.where(finite, zero, x) for x in u]
        else:
            dtypes = [g.dtype for g in grads]
            values = jnp.where(
                finite, _round_to_leaves(payload.values, payload.indices, dtypes, sizes), 0.0
            )
            payload = payload._replace(values=values)
            capacity = values.shape[0]
            mode = "sparse"
            if axis_name is not None and not shared:
                mode = aggregate.resolve(communication, n, capacity, devices)
            mean = aggregate.mean(payload, sizes, axis_name, mode, shared)
            message = (
                sum(c.bytes for c in chosen)
                if mode == "sparse"
                else aggregate.message_bytes(mode, n, capacity, shared)
            )
            # What this device did not send stays in its residual, exactly:
            # the sent entries are subtracted in place, leaf by leaf.
            left = [
                _subtract_at(x, local, values)
                for x, local in zip(
                    u, payload_lib.local_indices(payload.indices, sizes), strict=True
                )
            ]

        new_leaves = list(leaves)
        for i, part, g in zip(float_at, mean, grads, strict=True):
            new_leaves[i] = part.reshape(g.shape).astype(g.dtype)
        residual = state.residual
        if error_feedback:
            residual_leaves = jax.tree.leaves(state.residual)
            for i, x in zip(float_at, left, strict=True):
                residual_leaves[i] = x
            residual = jax.tree.unflatten(jax.tree.structure(state.residual), residual_leaves)

        last = step_metrics(ratio, sent, selected, n * devices, etas, message, finite)
        rule_state = rule.observe(state.rule, last)
        new_state = CompressState(residual, state.count + 1, last, rule_state)
        return jax.tree.unflatten(treedef, new_leaves), new_state

    return optax.GradientTransformationExtraArgs(init, update)
