"""The loop every compressor runs, as phases that hand small NamedTuples on.

One step on each device, over the *parts* of the gradient (its
floating-point leaves as they are, or packed into buckets: :mod:`layout`)::

    pack            g, r     = parts of the gradient and of the residual
    error_feedback  u        = g + r, and sum |u| per part     (feedback.py)
    select          payload  = rule.select(u)                  (selection.py)
    aggregate       update   = mean over devices of payloads   (aggregate.py)
    write_back      residual = u - payload                     (feedback.py)
    unpack          the update's leaves, the residual's storage
                    rule     = rule.observe(figures)           (e.g. SIDCo's stage controller)

:func:`sparsifier` builds that loop around any :class:`~sidco_jax.Rule`;
SIDCo's :func:`~sidco_jax.compress`, the baselines and :func:`~sidco_jax.dense`
differ only in the rule. Integer and boolean leaves pass through untouched,
complex leaves are averaged densely. A step where any device's gradient (or
residual) holds a non-finite value sends nothing anywhere, keeps every
residual and raises the ``nonfinite`` flag of the metrics, so one bad batch
cannot poison a residual. Whatever gates state (that flag, the figures a rule
observes) is reduced across the axis first, so every device takes the same
decision and the update stays replicated.

Each phase runs under a ``jax.named_scope`` of its name, so a profile
(TensorBoard, Perfetto) shows what each one costs;
``python -m benchmarks.overhead phases`` reads them out of one.
"""

from typing import Literal, NamedTuple, TypedDict, Unpack

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sidco_jax._src.analysis import costs
from sidco_jax._src.base import (
    COMMUNICATIONS,
    GRANULARITIES,
    MAX_SIZE,
    AxisName,
    Communication,
    CompressMetrics,
    CompressState,
    Granularity,
    axis_names,
    check_bool,
    check_choice,
    check_integer,
    check_ratio,
    check_seed,
    is_float,
    next_count,
    static,
)
from sidco_jax._src.loop import aggregate as aggregate_lib
from sidco_jax._src.loop import feedback, hierarchy, residuals, selection, slices
from sidco_jax._src.loop import layout as layout_lib
from sidco_jax._src.loop.eager import compiled_when_eager
from sidco_jax._src.loop.layout import Layout
from sidco_jax._src.loop.rule import Rule, empty_init
from sidco_jax._src.loop.warmup import warmed_up
from sidco_jax._src.ops import codecs


class LoopOptions(TypedDict, total=False):
    """The options every compressor takes: the keywords of :func:`sparsifier`.

    Defined once, here; each factory (:func:`~sidco_jax.compress`,
    :func:`~sidco_jax.topk`, ..., :func:`~sidco_jax.dense`) adds its own
    options to these. Their meaning and defaults are :func:`sparsifier`'s.
    """

    granularity: Granularity
    error_feedback: bool
    seed: int
    axis_name: AxisName | None
    communication: Communication
    inner_axis: AxisName | None
    inner_shards: int | Literal["params"] | None
    link: costs.Link | None
    warmup_steps: int
    layout: Layout
    bucket_bytes: int | None
    values: codecs.ValueCodec
    indices: codecs.IndexCodec


LOOP_OPTIONS: tuple[str, ...] = tuple(LoopOptions.__annotations__)


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


def _check_size(n: int) -> None:
    if n > MAX_SIZE:
        raise ValueError(
            f"the gradient has {n} floating-point entries; sidco_jax supports at most "
            "2**31 - 1 (int32 indices): compress parts of the model separately"
        )


def _check_layout(asked: str, residual, expected: residuals.Form) -> residuals.Form:
    """The form ``residual`` is stored in, refused where the compressor asked for another."""
    form = residuals.form_of(residual)
    if form.per_node_device or expected.per_node_device:
        if form is not expected:
            raise ValueError(
                f"the state holds a residual in the {form.name!r} layout, but this compressor "
                f"keeps it as {expected.name!r} (inner_shards): take the state from its init"
            )
        return form
    if asked != "auto" and asked != form.name:
        raise ValueError(
            f"the state holds a residual in the {form.name!r} layout, but this compressor was "
            f"built with layout={asked!r}: take the state from its init (sidco.restore converts "
            "a checkpoint from one layout to the other)"
        )
    return form


def _reselect(rule: Rule, rule_state, key, used: int):
    """The owner's selection in the sparse all-reduce: the same rule on its region's mean.

    Its key follows the ``used`` keys of the step's own selections.
    """
    key = jax.random.fold_in(key, used)

    def reselect(region):
        abs_sum = jnp.sum(jnp.abs(region))
        again = rule.select([region], abs_sum[None], rule_state, key)
        return selection.fill_if_starved(again, [region], abs_sum).payload

    return reselect


def _positions(leaves) -> tuple[list[int], list[int]]:
    """Where the floating-point leaves are, and the complex ones with entries."""
    float_at = [i for i, leaf in enumerate(leaves) if is_float(leaf)]
    complex_at = [i for i, leaf in enumerate(leaves) if jnp.iscomplexobj(leaf) and np.size(leaf)]
    return float_at, complex_at


def _unpack(parts, leaves, float_at, complex_at, done) -> list:
    """The update's leaves: the mean cut out of the parts, the complex means, the rest as given."""
    out = list(leaves)
    floats = [jnp.asarray(leaves[i]) for i in float_at]
    mean = layout_lib.unpack(parts, done.mean, floats)
    for j, i in enumerate(float_at):  # zero-size leaves are in no part
        out[i] = mean[j] if j in mean else jnp.zeros(floats[j].shape, floats[j].dtype)
    for i, c in zip(complex_at, done.others, strict=True):
        out[i] = c
    return out


def _metrics(ratio, done, n: int) -> CompressMetrics:
    """The step's :class:`CompressMetrics` from the aggregate phase's agreed figures."""
    f = done.figures
    return step_metrics(
        ratio, f.sent, f.selected, n, f.thresholds, done.message, f.finite, f.dropped
    )


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
    inner_shards: int | Literal["params"] | None = None,
    link: costs.Link | None = None,
    warmup_steps: int = 0,
    layout: Layout = "auto",
    bucket_bytes: int | None = None,
    values: codecs.ValueCodec = "float32",
    indices: codecs.IndexCodec = "int32",
) -> optax.GradientTransformationExtraArgs:
    """Error feedback and aggregation around a selection rule, as an optax transformation.

    Floating-point leaves are compressed; complex leaves are averaged densely
    over ``axis_name`` (under the same non-finite gate); other leaves pass
    through untouched. Zero-size leaves take no part. The payload's indices
    run over the floating-point entries in ``jax.tree.leaves`` order, in
    every layout.

    The message is float32. Under x64 a float64 leaf keeps a float64
    residual: its entries are sent rounded to float32, those beyond float32's
    range as its largest finite value, and the residual keeps the rest.
    Magnitudes below float32's smallest normal number (about 1.2e-38) cannot
    be sent at all: they stay in the residual, exactly, and are never lost.

    Args:
      rule: the :class:`~sidco_jax.Rule` choosing what to send.
      ratio: target density (reported in the metrics).
      granularity: ``"model"`` (one selection over all floating-point leaves,
        as in the paper) or ``"leaf"`` (one threshold and payload per leaf,
        merged into one message).
      error_feedback: keep what was not sent and add it to the next gradient.
      seed: seed of the rule's randomness, in ``[0, 2**32 - 1]``; the key of
        step ``t`` is ``fold_in(key(seed), t)``, the same on every device
        (the step count saturates at ``2**31 - 1``, and the key with it).
        Deterministic rules ignore it.
      axis_name: mesh axis (or tuple of axes) of ``jax.shard_map`` or
        ``jax.pmap`` to average the update over; None (default) sparsifies
        locally with no collective. With an axis the update is the mean of
        all devices' messages, identical on every device, and the residual is
        per device (see :func:`sidco_jax.parallel.state_specs`).
      communication: how the messages are averaged over ``axis_name``:
        ``"sparse"`` (``all_gather`` of values and indices, then a
        scatter-add: each device receives ``(P - 1) x capacity`` slots),
        ``"sparse_allreduce"`` (each entry routed to the device owning its
        region with ``all_to_all``, reduced and selected again there, then
        gathered: under ``3 x capacity`` slots per device whatever ``P``),
        ``"dense"`` (``psum`` of the densified message, for fast links) or
        ``"auto"`` (default: the cheapest under the alpha-beta model of
        ``link``, decided at trace time; see docs/distributed.md).
      inner_axis: a fast mesh axis (or tuple), e.g. the devices of one node,
        averaged densely (``pmean``) before compressing over ``axis_name``
        (the slow axis across nodes): hierarchical aggregation. Every device
        of a node then holds and compresses the same vector, so the residual
        is per node: shard it over ``axis_name`` only
        (``state_specs(state, axis_name)``).
      inner_shards: None (default: as above) or the number of devices along
        ``inner_axis``: the node's devices share the compression instead.
        The gradient is reduce-scattered (``psum_scatter``) over
        ``inner_axis``, each device runs error feedback, selection and the
        ``communication`` mode over ``axis_name`` on its ``1/inner_shards``
        slice of every bucket, and an ``all_gather`` over ``inner_axis``
        puts the update back together. Each device keeps the residual of
        its slice (one flat slice per bucket), so shard it over both
        axes (``state_specs(state, (axis_name, inner_axis))``). Needs the
        bucketed layout (``"auto"`` takes it). ``"params"``: the parameters
        themselves are sharded over ``inner_axis`` (FSDP within a node), so
        the gradient arrives as this device's shard of the node's mean (see
        :func:`sidco_jax.parallel.gather`); each device compresses that shard
        over ``axis_name`` and its update is that shard, in the parameters'
        own sharding. The residual, one per device, is split over both axes
        like the slices' (docs/distributed.md, "Sharded parameters").
      link: a :class:`~sidco_jax.costs.Link` (latency, bandwidth) of
        ``axis_name`` for ``"auto"``; default ``Link()`` (5 us, 100 Gbit/s).
      warmup_steps: the first ``warmup_steps`` steps send the dense mean of
        the gradient (exactly :func:`sidco_jax.dense`'s update), with the
        residual and the rule's state untouched and the metrics reporting
        the dense bytes; compression starts at step ``warmup_steps``. An int
        in ``[0, 2**31 - 1]`` (default 0: compress from the first step).
      layout: how the loop holds the gradient and the residual: ``"tree"``
        (leaf by leaf, small leaves packed together: fastest on XLA:CPU),
        ``"buckets"`` (packed into a few flat buckets: the kernels launched
        do not grow with the leaf count, for GPU and TPU) or ``"auto"``
        (default: the tree for CPU devices, buckets for GPU and TPU, decided
        at ``init`` from the devices of the parameters, or of the mesh it runs
        under, not from ``jax.default_backend()``; with
        ``error_feedback=False``, at each ``update`` from the gradient's).
        Both give the same result; :func:`sidco_jax.restore` converts a
        checkpoint from one to the other.
      bucket_bytes: the most bytes of residual per bucket, a positive int
        (default None: 25 MiB, PyTorch DDP's); a larger leaf is a bucket of
        its own. Static: it sets the buckets' shapes.
      values: how a sparse message's values travel: ``"float32"`` (default,
        4 bytes), ``"bfloat16"`` (2), ``"int8"`` (1, with a float32 scale per
        256 slots) or ``"sign"`` (1 bit, with the mean magnitude per 256
        slots). The residual keeps whatever the rounding loses. Not used by
        ``"dense"`` communication, which sums the values as selected.
      indices: how a sparse message's indices travel: ``"int32"`` (default,
        4 bytes), ``"chunked"`` (a 2-byte offset in its chunk of ``2**16``
        entries, and a 4-byte count per chunk) or ``"auto"`` (the smaller
        for the message's sizes). Lossless. ``"auto"`` communication and
        the metrics' ``bytes`` count the real message (docs/distributed.md).

    Returns:
      The transformation; its state is a :class:`~sidco_jax.CompressState`.

    Raises:
      TypeError: at construction, for an option of the wrong type.
      ValueError: at construction, for an option out of range or an unknown
        name; at ``update``, for a gradient tree unlike the one given to
        ``init`` (structure, shapes, which leaves are floating point), a state
        in another layout than ``layout`` asks for, or more than
        ``2**31 - 1`` floating-point entries.
      NameError: at ``update``, when ``axis_name`` or ``inner_axis`` is not
        bound (the update is not inside ``jax.shard_map`` or ``jax.pmap``
        over it).
    """
    ratio, options = configure(
        ratio,
        granularity=granularity,
        error_feedback=error_feedback,
        seed=seed,
        axis_name=axis_name,
        communication=communication,
        inner_axis=inner_axis,
        inner_shards=inner_shards,
        link=link,
        warmup_steps=warmup_steps,
        layout=layout,
        bucket_bytes=bucket_bytes,
        values=values,
        indices=indices,
    )
    return build(rule, ratio, **options)


class Options(NamedTuple):
    """``ratio`` and the loop's options, as :func:`configure` checks them and :func:`build` trusts.

    As given to :func:`sparsifier`, but concrete numbers are Python numbers,
    ``link`` is a :class:`~sidco_jax.costs.Link` (never None) and
    ``bucket_bytes`` an int.
    """

    ratio: float
    granularity: str
    error_feedback: bool
    seed: int | jax.Array
    axis_name: AxisName | None
    communication: str
    inner_axis: AxisName | None
    inner_shards: int | Literal["params"] | None
    link: costs.Link
    warmup_steps: int | jax.Array
    layout: str
    bucket_bytes: int
    values: str
    indices: str


def configure(ratio, **options: Unpack[LoopOptions]) -> tuple[float, LoopOptions]:
    """``ratio`` and every option of :func:`sparsifier`, checked: the one place they are.

    Returns:
      ``ratio`` as a Python float and the options, each checked (see :class:`Options`).

    Raises:
      TypeError: for an option of the wrong type (see :func:`sparsifier`).
      ValueError: for one out of range, an unknown name, a traced ``ratio`` (it
        sets the payload's shape), or options that do not go together.
    """
    o = Options(check_ratio(static("ratio", ratio)), **options)
    check_choice("granularity", o.granularity, GRANULARITIES)
    check_bool("error_feedback", o.error_feedback)
    _check_axes(o.axis_name, o.communication, o.inner_axis)
    codecs.check(o.values, o.indices)
    checked = o._replace(
        seed=check_seed(o.seed),
        inner_shards=slices.check(o.inner_shards, o.inner_axis, o.layout),
        link=costs.check_link(o.link),
        warmup_steps=check_integer("warmup_steps", o.warmup_steps, 0),
        bucket_bytes=layout_lib.check_layout(o.layout, o.bucket_bytes),
    )._asdict()
    return checked.pop("ratio"), checked


def _check_axes(axis_name, communication, inner_axis) -> None:
    """Refuses a bad ``axis_name``, ``communication`` or ``inner_axis``, or a bad pair."""
    for name, value in (("axis_name", axis_name), ("inner_axis", inner_axis)):
        names = axis_names(value)
        if value is not None and not (names and all(isinstance(a, str) for a in names)):
            raise ValueError(
                f"{name} must be None, a mesh axis name or a tuple of them, got {value!r}"
            )
    check_choice("communication", communication, COMMUNICATIONS)
    if inner_axis is None:
        return
    if axis_name is None:
        raise ValueError(
            f"inner_axis={inner_axis!r} needs an axis_name to compress over (the slow axis "
            "across nodes); without one, average over the inner axis yourself"
        )
    if set(axis_names(inner_axis)) & set(axis_names(axis_name)):
        raise ValueError(
            f"inner_axis={inner_axis!r} must differ from axis_name={axis_name!r}: the inner "
            "axis is averaged densely, axis_name is compressed"
        )


def build(
    rule: Rule, ratio: float, **options: Unpack[LoopOptions]
) -> optax.GradientTransformationExtraArgs:
    """:func:`sparsifier` of ``ratio`` and options :func:`configure` checked (all of them)."""
    o = Options(ratio, **options)
    node = hierarchy.choose(o.inner_axis, o.inner_shards)
    wire = codecs.Codec(o.values, o.indices)

    def init(params):
        return _init(rule, o, params)

    def update(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        float_at, complex_at = _positions(leaves)
        grads = [jnp.asarray(leaves[i]) for i in float_at]
        if not any(g.size for g in grads) and not complex_at:
            return updates, state._replace(count=next_count(state.count))
        copies = hierarchy.devices(o.axis_name) * node.copies  # first: names an unbound axis
        form, parts = _form_and_parts(o, state.residual, updates, grads)

        with jax.named_scope("pack"):
            others = [jnp.asarray(leaves[i]) for i in complex_at]
            g, others = node.pack(layout_lib.pack(parts, grads), others, parts)
            r = [jnp.zeros((), p.dtype) for p in parts]  # a full-size zero costs a pass
            if o.error_feedback:
                r = form.parts(state.residual, parts, float_at)
        fed = feedback.error_feedback(list(zip(g, r, strict=True)), others, o.error_feedback)
        key = jax.random.fold_in(jax.random.key(o.seed), state.count)
        chosen = _select(rule, o, node, fed, state.rule, key, parts, grads)
        reselect = _reselect(rule, state.rule, key, len(parts) if o.granularity == "leaf" else 1)
        agreed = node.agreed(o.axis_name)  # the axes the step's figures are agreed over
        done = aggregate_lib.aggregate(
            chosen, fed, others, o.axis_name, o.communication, o.link, reselect, wire, agreed
        )
        left = feedback.write_back(
            fed.u, done.figures.finite, done.sent, done.kept, [x.size for x in fed.u]
        )

        with jax.named_scope("unpack"):
            done = done._replace(mean=node.unpack(done.mean, parts))
            out = _unpack(parts, leaves, float_at, complex_at, done)
            residual = state.residual
            if o.error_feedback:
                residual = form.store(state.residual, parts, left, float_at)
        last = _metrics(o.ratio, done, sum(x.size for x in fed.u) * copies)
        observed = rule.observe(state.rule, last)
        new_state = CompressState(residual, next_count(state.count), last, observed)
        return jax.tree.unflatten(treedef, out), new_state

    compressed = optax.GradientTransformationExtraArgs(init, update)
    if not (isinstance(o.warmup_steps, int) and o.warmup_steps == 0):
        compressed = warmed_up(compressed, _dense_mean(options), o.warmup_steps)
    return compiled_when_eager(compressed)


def _init(rule: Rule, o: Options, params) -> CompressState:
    """The loop's ``init``: an empty residual in the form the options and devices ask for."""
    floats = [leaf for leaf in jax.tree.leaves(params) if is_float(leaf)]
    n = sum(int(np.prod(jnp.shape(leaf))) for leaf in floats)
    _check_size(n)
    if isinstance(o.inner_shards, int):
        slices.check_size(n, o.inner_shards)
    zero = jnp.zeros((), jnp.int32)
    eta = jnp.zeros((len(floats),) if o.granularity == "leaf" else (), jnp.float32)
    residual = None
    if o.error_feedback:
        form = residuals.choose(layout_lib.resolve(o.layout, params), o.inner_shards)
        parts = layout_lib.plan(floats, form.layout, o.bucket_bytes, o.granularity == "leaf")
        residual = form.empty(params, parts, o.inner_shards if form is residuals.SLICES else 1)
    return CompressState(
        residual=residual,
        count=zero,
        last=step_metrics(o.ratio, zero, zero, 1, eta, 0, jnp.array(True)),
        rule=rule.init(params),
    )


def _form_and_parts(o: Options, residual, updates, grads):
    """The residual's form, checked against the options and the gradient, and the parts."""
    _check_size(sum(g.size for g in grads))
    form = residuals.choose(layout_lib.resolve(o.layout, grads), o.inner_shards)
    if o.error_feedback:
        form = _check_layout(o.layout, residual, form)
    parts = layout_lib.plan(grads, form.layout, o.bucket_bytes, o.granularity == "leaf")
    if o.error_feedback:
        form.check(residual, updates, parts)
    return form, parts


def _select(rule: Rule, o: Options, node, fed, rule_state, key, parts, grads):
    """The select phase: the rule over all parts, or over each leaf's own."""
    leaf_info = [(i, grads[i].dtype, grads[i].size) for p in parts for i in p.leaves]
    spans = node.spans(parts, [size for *_, size in leaf_info])
    groups = len(grads) if o.granularity == "leaf" else None
    return selection.select(rule, fed.u, fed.abs_sums, rule_state, key, leaf_info, groups, spans)


def _dense_mean(options: LoopOptions) -> optax.GradientTransformationExtraArgs:
    """The loop with a rule that sends everything: the plain mean over the axes, no residual.

    A device holding its shard of the parameters' gradient keeps to it; one holding the
    node's whole gradient (or a slice of it) takes the node's mean whole.
    """
    owned = options["inner_shards"] == slices.PARAMS
    dense = {
        **options,
        "granularity": "model",
        "error_feedback": False,
        "communication": "dense",
        "inner_shards": slices.PARAMS if owned else None,
        "warmup_steps": 0,
        "values": "float32",
        "indices": "int32",
    }
    return build(Rule(empty_init, selection.everything), 1.0, **dense)
