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

Each phase runs under a ``jax.named_scope``: ``error_feedback`` (the first pass
and ``u``), ``select`` (the rule; forming the payload is ``select/payload``),
``aggregate`` (the mean and the dense update) and ``write_back`` (the
residual). A profile (TensorBoard, Perfetto) thus shows what each one costs;
``python -m benchmarks.overhead phases`` reads them out of one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from sidco_jax._src import aggregate, costs, passes, sparse_allreduce
from sidco_jax._src import payload as payload_lib
from sidco_jax._src.base import (
    MAX_SIZE,
    VALUE_BYTES,
    AxisName,
    Communication,
    CompressMetrics,
    CompressState,
    Granularity,
    Rule,
    Selection,
    check_axis,
    check_common,
    check_integer,
    check_seed,
    cond_on_device,
    empty_init,
    is_float,
)


def step_metrics(ratio, sent, selected, n, eta, message, finite, dropped=0) -> CompressMetrics:
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
        dropped=jnp.asarray(dropped, jnp.int32),
    )


def reduce_figures(axis_name, finite, sent, selected, eta, dropped):
    """This step's figures agreed across ``axis_name``: identical on every device.

    Returns ``(finite, sent, selected, eta, dropped)``: finite on every
    device, the total entries sent and selected, the mean threshold and the
    total residual entries dropped. One ``psum``.
    """
    if axis_name is None:
        return finite, sent, selected, eta, dropped
    ints = jnp.stack([(~finite).astype(jnp.int32), sent.astype(jnp.int32), dropped])
    # Selected counts can exceed int32 once summed: float32 is enough for a density.
    floats = jnp.concatenate([jnp.reshape(selected, (1,)).astype(jnp.float32), eta.reshape(-1)])
    ints, floats = lax.psum((ints, floats), axis_name)
    devices = lax.axis_size(axis_name)
    return ints[0] == 0, ints[1], floats[0], (floats[1:] / devices).reshape(eta.shape), ints[2]


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
    """Rounds each sent value to the dtype of the leaf it belongs to, saturating.

    The update leaves in the gradient's dtype; rounding here, on the payload,
    lets the residual keep the rounding error so that bf16/fp16 lose nothing.
    A value beyond the dtype's range is sent as its largest finite value, and
    the residual keeps the excess: an update is never infinite.
    """

    def rounded(dtype):
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(values, -top, top).astype(dtype).astype(jnp.float32)

    narrow = [jnp.finfo(d).bits < 32 for d in dtypes]  # float32 and float64 hold the values
    if not any(narrow):
        return values
    if all(narrow) and len(set(dtypes)) == 1:
        return rounded(dtypes[0])
    offsets = np.cumsum([0, *sizes])
    out = values
    for dtype, start, stop, cut in zip(dtypes, offsets[:-1], offsets[1:], narrow, strict=True):
        if cut:
            mine = (indices >= start) & (indices < stop)
            out = jnp.where(mine, rounded(dtype), out)
    return out


def residual_like(params, error_feedback: bool = True):
    """A zero float32 residual for every floating-point leaf of ``params``.

    Shaped like the leaf (at least 1-D, so it can be split over a mesh axis);
    a zero-size vector for other leaves. None without error feedback.
    """
    if not error_feedback:
        return None

    def zero(leaf):
        return jnp.zeros(_residual_shape(leaf), _residual_dtype(leaf))

    return jax.tree.map(zero, params)


def _residual_dtype(leaf):
    """float32, or the leaf's own dtype where it is wider (float64 under x64)."""
    return (
        jnp.promote_types(jnp.asarray(leaf).dtype, jnp.float32) if is_float(leaf) else jnp.float32
    )


def _residual_shape(leaf) -> tuple[int, ...]:
    if not is_float(leaf):
        return (0,)
    return jnp.shape(leaf) or (1,)


def _check_size(n: int) -> None:
    if n > MAX_SIZE:
        raise ValueError(
            f"the gradient has {n} floating-point entries; sidco_jax supports at most "
            "2**31 - 1 (int32 indices): compress parts of the model separately"
        )


def _check_tree(updates, residual) -> None:
    """Refuses a gradient tree unlike the one ``init`` saw (recorded by the residual's shapes)."""
    want, got = jax.tree.structure(residual), jax.tree.structure(updates)
    if want != got:
        raise ValueError(
            f"the gradient's tree structure {got} does not match the one given to init {want}"
        )
    paths = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, leaf), r in zip(paths, jax.tree.leaves(residual), strict=True):
        if _residual_shape(leaf) != r.shape:
            seen = f"a leaf of shape {r.shape}" if r.size else "a non-floating-point leaf"
            raise ValueError(
                f"gradient leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)} and "
                f"dtype {jnp.asarray(leaf).dtype}, but init saw {seen} there: the residual would "
                "be added to the wrong entries (call init with parameters like the gradients)"
            )


def _devices(axis_name) -> int:
    """Devices along ``axis_name`` (1 for None), with a clear error where it is unbound."""
    if axis_name is None:
        return 1
    try:
        return lax.axis_size(axis_name)
    except NameError as error:
        raise NameError(
            f"axis_name {axis_name!r} is not bound here: call the update inside jax.shard_map "
            "or jax.pmap over that axis, or build the compressor with axis_name=None to "
            "compress locally"
        ) from error


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
    return jnp.abs(g.astype(r.dtype) + r) + zero


def _finite(x) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def _recovered(g, r, gradient_ok):
    """``g + r`` without what is not finite: a bad gradient or bad residual entries are dropped.

    A sum beyond float32's range saturates, so the entry is sent early rather than lost.
    """
    top = jnp.finfo(r.dtype).max
    g = jnp.where(gradient_ok, g.astype(r.dtype), jnp.zeros((), r.dtype))
    return jnp.clip(_finite(g) + _finite(r), -top, top)


def _diagnose(pairs, others, error_feedback):
    """Runs only when a per-leaf sum is not finite: what exactly is wrong.

    Returns whether every gradient entry is finite, how many residual entries
    are not (to be dropped), and the per-leaf sums ``|g + r|`` of what remains.
    """
    gradient_ok = jnp.all(
        jnp.stack(
            [jnp.all(jnp.isfinite(g)) for g, _ in pairs]
            + [jnp.all(jnp.isfinite(c)) for c in others]
        )
    )
    dropped = jnp.zeros_like(gradient_ok, jnp.int32)  # varies across devices like the rest
    if error_feedback:
        # Counted in the metrics, not warned about from the device: a host callback
        # anywhere in the update, even in this branch that seldom runs, cost about a
        # sixth of every update on XLA's CPU backend (docs/benchmarks.md).
        dropped += sum(jnp.sum(~jnp.isfinite(r), dtype=jnp.int32) for _, r in pairs)
    sums = [jnp.sum(jnp.abs(_recovered(g, r, gradient_ok))) for g, r in pairs]
    sums += [jnp.sum(jnp.abs(_finite(c))) for c in others]
    return gradient_ok, dropped, jnp.stack(sums).astype(jnp.float32)


def _fill_if_starved(chosen: Selection, vectors, abs_sum) -> Selection:
    """Fills the payload with the largest magnitudes where a rule selected nothing to send.

    Ties at the threshold (all-equal magnitudes, which error feedback keeps
    tied) or a threshold over the top would otherwise leave the paid-for
    payload empty step after step. The exact top-``capacity`` then fills it,
    ties going to the lower index as in top-k; it only runs on such steps. It
    is found by counting passes, not ``lax.top_k``: on a GPU the sort of an
    untaken branch still reserved three gradient sizes of memory.
    """
    payload = chosen.payload
    if payload is None or chosen.shared:
        return chosen
    capacity = payload.values.shape[0]
    starved = (payload.selected == 0) & (abs_sum > 0)

    payload, eta = cond_on_device(
        starved,
        lambda: payload_lib.top_by_count(vectors, capacity),
        lambda: (payload, jnp.asarray(chosen.threshold, jnp.float32)),
    )
    return chosen._replace(payload=payload, threshold=eta)


def everything(vectors, abs_sums, state, key) -> Selection:
    """The :class:`~sidco_jax.SelectFn` of no compression: every entry is sent."""
    del abs_sums, state, key
    return Selection(None, jnp.zeros((), jnp.float32), VALUE_BYTES * sum(v.size for v in vectors))


def sparsifier(
    rule: Rule,
    *,
    ratio: float,
    granularity: Granularity = "model",
    error_feedback: bool = True,
    seed: int = 0,
    axis_name: AxisName | None = None,
    communication: Communication = "auto",
    inner_axis: AxisName | None = None,
    link: costs.Link | None = None,
    warmup_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Error feedback and aggregation around a selection rule, as an optax transformation.

    Nothing copies the gradient into one flat vector: the residual is a tree
    like the parameters, the rule's statistics are summed leaf by leaf, the
    payload's indices run over the leaves in ``jax.tree.leaves`` order, the
    update and the residual are written leaf by leaf, and the non-finite gate
    acts on the fixed-size payload and the step's figures.

    Floating-point leaves are compressed; complex leaves are averaged densely
    over ``axis_name`` (under the same non-finite gate); other leaves pass
    through untouched. Zero-size leaves take no part.

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
      communication: ``"auto"``, ``"sparse"``, ``"dense"`` or
        ``"sparse_allreduce"`` (see :func:`sidco_jax.compress`).
      inner_axis: a fast mesh axis (or tuple) to average over densely before
        compressing over ``axis_name`` (hierarchical aggregation; see
        :func:`sidco_jax.compress`).
      link: the :class:`~sidco_jax.Link` of ``axis_name`` for ``"auto"``.
      warmup_steps: the first ``warmup_steps`` steps send the dense mean, as
        :func:`sidco_jax.dense` does, leaving the residual and the rule's
        state untouched; compression starts at step ``warmup_steps``. An
        int >= 0.

    Returns:
      The transformation; its state is a :class:`~sidco_jax.CompressState`.

    Raises:
      ValueError: at ``update``, for a gradient tree unlike the one given to
        ``init`` (structure, shapes, which leaves are floating point) or with
        more than ``2**31 - 1`` floating-point entries.
      NameError: at ``update``, when ``axis_name`` or ``inner_axis`` is not
        bound (the update is not inside ``jax.shard_map`` or ``jax.pmap``
        over it).
    """
    ratio = check_common(ratio, granularity, error_feedback)
    seed = check_seed(seed)
    check_axis(axis_name, communication, inner_axis)
    link = costs.check_link(link)
    warmup_steps = check_integer("warmup_steps", warmup_steps, 0)

    def init(params):
        floats = [leaf for leaf in jax.tree.leaves(params) if is_float(leaf)]
        _check_size(sum(int(np.prod(jnp.shape(leaf))) for leaf in floats))
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
        if error_feedback:
            _check_tree(updates, state.residual)
        devices = _devices(axis_name)
        if inner_axis is not None:
            # Hierarchical: the node's mean first, over the fast links; every
            # device of the node then compresses the same vector identically.
            _devices(inner_axis)
            updates = jax.tree.map(
                lambda x: lax.pmean(x, inner_axis) if jnp.issubdtype(x.dtype, jnp.inexact) else x,
                updates,
            )
        leaves, treedef = jax.tree.flatten(updates)
        float_at = [i for i, leaf in enumerate(leaves) if is_float(leaf)]
        complex_at = [
            i for i, leaf in enumerate(leaves) if jnp.iscomplexobj(leaf) and np.size(leaf)
        ]
        grads = [jnp.asarray(leaves[i]) for i in float_at]
        sizes = [g.size for g in grads]
        n = sum(sizes)
        _check_size(n)
        if n == 0 and not complex_at:
            return updates, state._replace(count=state.count + 1)
        others = [jnp.asarray(leaves[i]) for i in complex_at]
        # Everything full-size keeps the residual's shapes (the leaf's, at least
        # 1-D): a reshape between the in-place write-back and the donated state
        # would cost XLA a copy of every multi-dimensional leaf.
        if error_feedback:
            old = jax.tree.leaves(state.residual)
            pairs = [
                (g.reshape(old[i].shape), old[i]) for g, i in zip(grads, float_at, strict=True)
            ]
        else:
            # A scalar zero stands in for the residual: a full-size one was written
            # and read on every step (passes' barriers keep XLA from folding it).
            pairs = [
                (g.reshape(np.shape(g) or (1,)), jnp.zeros((), _residual_dtype(g))) for g in grads
            ]

        # First pass, fused with the residual add: sum(|g + r|) per leaf, for
        # the finite check and for the rules' statistics. Only where a sum is
        # not finite does a second look tell a bad gradient (the step is
        # skipped) from bad residual entries (dropped) or a mere overflow.
        with jax.named_scope("error_feedback"):
            abs_sums = passes.reduce_parts(pairs, _abs_sum)
            abs_sums += [jnp.sum(jnp.abs(c)) for c in others]
            abs_sums = jnp.stack(abs_sums).astype(jnp.float32)
            sums_ok = jnp.all(jnp.isfinite(abs_sums))

            def fine(_):
                return sums_ok, jnp.zeros_like(sums_ok, jnp.int32), abs_sums

            local_finite, dropped, abs_sums = lax.cond(
                sums_ok, fine, lambda _: _diagnose(pairs, others, error_feedback), None
            )
            # A non-finite device keeps its residual (less any bad entry): it sends nothing.
            u = [
                jnp.where(sums_ok, g.astype(r.dtype) + r, _recovered(g, r, local_finite))
                if error_feedback
                else g.astype(r.dtype)
                for g, r in pairs
            ]
        key = jax.random.fold_in(jax.random.key(seed), state.count)

        # Zero-size leaves take no part: indices over all leaves are the same without them.
        used = [i for i in range(len(u)) if sizes[i]]
        groups = ([used] if used else []) if granularity == "model" else [[i] for i in used]
        keys = jax.random.split(key, len(groups)) if groups else []
        chosen = []
        with jax.named_scope("select"):
            for group, k in zip(groups, keys, strict=True):
                # The message is float32; a float64 leaf's residual keeps what it cannot carry.
                vectors = [u[i].reshape(-1).astype(jnp.float32) for i in group]
                sums = abs_sums[np.asarray(group)]
                selection = rule.select(vectors, sums, state.rule, k)
                chosen.append(_fill_if_starved(selection, vectors, jnp.sum(sums)))
        if granularity == "model":
            etas = chosen[0].threshold if chosen else jnp.zeros((), jnp.float32)
        else:  # one threshold per floating-point leaf, 0 for the zero-size ones
            by_leaf = {i: c.threshold for i, c in zip(used, chosen, strict=True)}
            etas = jnp.asarray([by_leaf.get(i, 0.0) for i in range(len(u))], jnp.float32)
        shared = all(c.shared for c in chosen)
        send_all = bool(chosen) and chosen[0].payload is None
        group_sizes = [sum(sizes[i] for i in group) for group in groups]

        mode, routed = "sparse", None
        if send_all or not chosen:
            sent = jnp.where(local_finite, n, 0).astype(jnp.int32)
            selected = jnp.int32(n)
        else:
            payload = _merge(chosen, group_sizes)
            dtypes = [g.dtype for g in grads]
            payload = payload._replace(
                values=_round_to_leaves(payload.values, payload.indices, dtypes, sizes)
            )
            capacity = payload.values.shape[0]
            if axis_name is not None and not shared:
                mode = aggregate.resolve(communication, n, capacity, devices, link)
            if mode == "sparse_allreduce":  # what does not fit its owner's slots stays here
                routed = sparse_allreduce.route(payload, n, devices)
            sent = jnp.where(local_finite, payload.count if routed is None else routed.count, 0)
            selected = payload.selected
        # Every device agrees on the step before anything is sent: one
        # non-finite device makes all of them send nothing, and the rule sees
        # the same figures everywhere.
        finite, sent, selected, etas, dropped = reduce_figures(
            axis_name, local_finite, sent, selected, etas, dropped
        )

        zero = jnp.zeros((), jnp.float32)
        sent_at = kept_at = kept = None
        with jax.named_scope("aggregate"):
            if send_all or not chosen:
                mean = [jnp.where(finite, x, zero) for x in u]
                if axis_name is not None:
                    mean = lax.pmean(mean, axis_name)
                message = sum(x.size * x.dtype.itemsize for x in u)
            else:
                values = jnp.where(finite, payload.values, 0.0)
                sent_at = payload.indices
                if routed is None:
                    mean = aggregate.mean(
                        payload._replace(values=values), sizes, axis_name, mode, shared
                    )
                    message = (
                        sum(c.bytes for c in chosen)
                        if mode == "sparse"
                        else aggregate.message_bytes(mode, n, capacity, shared)
                    )
                else:

                    def reselect(region):
                        # The owner selects from its region's sum with the same rule.
                        abs_sum = jnp.sum(jnp.abs(region))
                        again = rule.select([region], abs_sum[None], state.rule, region_key)
                        return _fill_if_starved(again, [region], abs_sum).payload

                    region_key = jax.random.fold_in(key, len(groups))
                    routed = routed._replace(values=jnp.where(finite, routed.values, 0.0))
                    reduced = sparse_allreduce.exchange(routed, sizes, axis_name, reselect)
                    mean, message = reduced.mean, reduced.message
                    sent_at, kept_at, kept = routed.sent, reduced.kept_indices, reduced.kept_values
        with jax.named_scope("write_back"):
            if sent_at is None:
                left = [jnp.where(finite, zero, x) for x in u]
            else:
                # What this device did not send stays in its residual, exactly:
                # the sent entries are subtracted in place, leaf by leaf, and an
                # owner adds back what it received and did not send on.
                left = [
                    _subtract_at(x, local, values)
                    for x, local in zip(u, payload_lib.local_indices(sent_at, sizes), strict=True)
                ]
            if kept is not None:
                left = [
                    _subtract_at(x, local, -kept)
                    for x, local in zip(
                        left, payload_lib.local_indices(kept_at, sizes), strict=True
                    )
                ]
        # Complex leaves are averaged densely: never left out of the collective.
        dense_complex = [jnp.where(finite, c, jnp.zeros((), c.dtype)) for c in others]
        if axis_name is not None:
            dense_complex = lax.pmean(dense_complex, axis_name)
        message += sum(c.size * c.dtype.itemsize for c in others)

        new_leaves = list(leaves)
        with jax.named_scope("aggregate"):
            for i, part, g in zip(float_at, mean, grads, strict=True):
                new_leaves[i] = part.reshape(g.shape).astype(g.dtype)
        for i, part in zip(complex_at, dense_complex, strict=True):
            new_leaves[i] = part
        residual = state.residual
        if error_feedback:
            residual_leaves = jax.tree.leaves(state.residual)
            for i, x in zip(float_at, left, strict=True):
                residual_leaves[i] = x
            residual = jax.tree.unflatten(jax.tree.structure(state.residual), residual_leaves)

        last = step_metrics(ratio, sent, selected, n * devices, etas, message, finite, dropped)
        rule_state = rule.observe(state.rule, last)
        new_state = CompressState(residual, state.count + 1, last, rule_state)
        return jax.tree.unflatten(treedef, new_leaves), new_state

    if isinstance(warmup_steps, int) and warmup_steps == 0:
        return optax.GradientTransformationExtraArgs(init, update)
    return optax.GradientTransformationExtraArgs(
        init, _warm(update, warmup_steps, axis_name, inner_axis)
    )


def dense_mean(axis_name: AxisName | None, inner_axis: AxisName | None = None):
    """The loop with a rule that sends everything: the plain mean over the axes, no residual."""
    return sparsifier(
        Rule(empty_init, everything),
        ratio=1.0,
        error_feedback=False,
        axis_name=axis_name,
        communication="dense",
        inner_axis=inner_axis,
    )


def _warm(update, warmup_steps, axis_name, inner_axis):
    """``update`` preceded by ``warmup_steps`` steps of :func:`sidco_jax.dense`.

    One ``lax.cond`` on the step count, which every device holds alike: both
    paths are compiled once and each step runs one of them. A dense step
    leaves the residual and the rule's state as they are and reports the
    dense bytes, at the compressor's target density.
    """
    dense = dense_mean(axis_name, inner_axis)

    def warm_update(updates, state, params=None, **extra_args):
        def warm(_):
            out, done = dense.update(
                updates, state._replace(residual=None, rule=optax.EmptyState())
            )
            last = done.last._replace(
                target_density=state.last.target_density,
                threshold=jnp.zeros_like(state.last.threshold),
            )
            return out, state._replace(count=done.count, last=last)

        def compressed(_):
            return update(updates, state, params, **extra_args)

        return lax.cond(state.count < warmup_steps, warm, compressed, None)

    return warm_update
