"""Partition specs and initialisation of optax states that hold per-device residuals.

Under ``jax.shard_map`` each device keeps its own error-feedback residual, a
float32 tree shaped like the parameters or flat buckets (``layout="buckets"``),
while everything else in the optimizer state (momentum, step counts, the
stage controller, metrics) stays replicated, but the inner optimizer's state
of :func:`sidco_jax.diloco`, which follows each device's own parameters. As
global arrays the residuals of ``d`` devices are stacked along each leaf's
(or bucket's) first axis: a leaf of shape ``(m, ...)`` becomes
``(d * m, ...)`` sharded along the axis, device ``i`` holding rows
``[i * m, (i + 1) * m)``.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sidco_jax._src.base import AxisName, CompressState, is_float
from sidco_jax._src.loop import residuals
from sidco_jax._src.wrappers.accumulate import AccumulateState
from sidco_jax._src.wrappers.outer import OuterState


def _is_state(node) -> bool:
    return isinstance(node, CompressState | AccumulateState | OuterState)


_REPLICATED, _RESIDUAL, _ACCUMULATOR = "replicated", "residual", "accumulator"


def _kinds(opt_state: optax.OptState) -> Any:
    """A tree like ``opt_state`` with the kind of every leaf: replicated, residual, accumulator."""

    def kind(node):
        if isinstance(node, CompressState):
            kinds = jax.tree.map(lambda _: _REPLICATED, node)
            return kinds._replace(residual=jax.tree.map(lambda _: _RESIDUAL, node.residual))
        if isinstance(node, AccumulateState):
            return AccumulateState(
                kind(node.mini_step),
                jax.tree.map(lambda _: _ACCUMULATOR, node.accumulator),
                jax.tree.map(kind, node.inner, is_leaf=_is_state),
            )
        if isinstance(node, OuterState):
            # The inner state follows each device's parameters; a scalar (a step count) is
            # the same everywhere and could not be split.
            kinds = jax.tree.map(lambda _: _REPLICATED, node)
            return kinds._replace(
                inner=jax.tree.map(lambda x: _RESIDUAL if jnp.ndim(x) else _REPLICATED, node.inner),
                exchange=jax.tree.map(kind, node.exchange, is_leaf=_is_state),
            )
        return jax.tree.map(lambda _: _REPLICATED, node)

    return jax.tree.map(kind, opt_state, is_leaf=_is_state)


def is_per_device(opt_state: optax.OptState) -> Any:
    """A tree like ``opt_state`` with True at every per-device leaf.

    Those are the error-feedback residuals of every
    :class:`~sidco_jax.CompressState` and the accumulators of every
    :class:`~sidco_jax.AccumulateState`.

    Args:
      opt_state: an optax state (arrays, ``jax.ShapeDtypeStruct`` or anything
        with the same tree structure).

    Returns:
      The same tree structure with booleans as leaves.
    """
    return jax.tree.map(lambda kind: kind != _REPLICATED, _kinds(opt_state))


def state_specs(
    opt_state: optax.OptState,
    axis_name: AxisName,
    *,
    accumulator_axis: AxisName | None = None,
    param_specs: Any = None,
) -> Any:
    """Partition specs for a whole optax state containing sidco_jax states.

    Every leaf of the residual of every :class:`~sidco_jax.CompressState` is
    per device (``P(axis_name)``), and so is every leaf of the accumulator of
    every :class:`~sidco_jax.AccumulateState` (``P(accumulator_axis)``) and
    every leaf of at least one axis of the inner state of an
    :class:`~sidco_jax.OuterState` (``P(axis_name)``: it follows each
    device's parameters); every other leaf is replicated (``P()``). Use the result as
    ``in_specs``/``out_specs`` of ``jax.shard_map`` for the state.

    Args:
      opt_state: the state, or its ``jax.eval_shape``.
      axis_name: the mesh axis (or tuple of axes) the compressor averages over.
      accumulator_axis: the axis (or tuple of axes) the accumulators of
        :func:`sidco_jax.accumulate` are split over (default ``axis_name``).
        An accumulator holds its own device's gradients, so it is split over
        every axis they differ along: the batch's. For a hierarchical
        compressor (``compress(r, axis_name="node", inner_axis="local")``)
        that is ``("node", "local")``: the node's mean is taken when the
        accumulated gradient is compressed, after the micro-steps.
      param_specs: the parameters' partition specs, a tree like the
        parameters (default None: replicated). Sharded parameters shard the
        optimizer state that follows them: every part of the state outside
        the sidco_jax states with the parameters' tree structure (a
        momentum, Adam's moments) gets these specs.

    Returns:
      A tree of ``PartitionSpec`` with the structure of ``opt_state``.

    Examples:
      >>> import jax.numpy as jnp, optax, sidco_jax as sidco
      >>> tx = optax.chain(sidco.compress(0.1, axis_name="data"), optax.sgd(0.1))
      >>> specs = sidco.parallel.state_specs(tx.init(jnp.zeros(100)), "data")
      >>> specs[0].residual, specs[0].count
      (P('data',), P())
    """
    accumulator_axis = axis_name if accumulator_axis is None else accumulator_axis
    spec = {_REPLICATED: P(), _RESIDUAL: P(axis_name), _ACCUMULATOR: P(accumulator_axis)}
    specs = jax.tree.map(spec.__getitem__, _kinds(opt_state))
    return specs if param_specs is None else _following(opt_state, specs, param_specs)


def _following(opt_state, specs, param_specs) -> Any:
    """``specs`` with ``param_specs`` at every part of ``opt_state`` outside sidco_jax's states
    that has the parameters' structure (and leaves of at least the dimensions their specs
    name): the optimizer state that follows the parameters."""
    structure = jax.tree.structure(param_specs, is_leaf=_is_spec)
    wanted = jax.tree.leaves(param_specs, is_leaf=_is_spec)

    def follows(node) -> bool:
        if _is_state(node) or jax.tree.structure(node) != structure:
            return False
        leaves = jax.tree.leaves(node)
        return all(np.ndim(x) >= len(s) for x, s in zip(leaves, wanted, strict=True))

    def choose(node, spec):
        if isinstance(node, OuterState):  # its anchor is the parameters, its outer state follows
            outer = _following(node.outer, spec.outer, param_specs)
            return spec._replace(anchor=structure.unflatten(wanted), outer=outer)
        return structure.unflatten(wanted) if follows(node) else spec

    stop = lambda n: _is_state(n) or follows(n)  # noqa: E731
    return jax.tree.map(choose, opt_state, specs, is_leaf=stop)


def state_shardings(
    opt_state: optax.OptState,
    mesh: Mesh,
    axis_name: AxisName,
    *,
    accumulator_axis: AxisName | None = None,
) -> Any:
    """``NamedSharding`` on ``mesh`` for every leaf of ``opt_state`` (see :func:`state_specs`)."""
    specs = state_specs(opt_state, axis_name, accumulator_axis=accumulator_axis)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def shard_init(
    tx: optax.GradientTransformation,
    params: optax.Params,
    mesh: Mesh,
    axis_name: AxisName,
    param_specs: Any = None,
    *,
    accumulator_axis: AxisName | None = None,
) -> optax.OptState:
    """``tx.init(params)`` on every device of ``mesh``, as global sharded arrays.

    Each device gets its own zero residual; the rest of the state is
    replicated. The result has the shardings of :func:`state_shardings`, ready
    for a ``jax.shard_map`` step with ``state_specs`` as its specs.

    Args:
      tx: the optimizer (a chain containing sidco_jax transformations).
      params: the parameters (replicated unless ``param_specs`` says otherwise).
      mesh: the device mesh.
      axis_name: the axis (or tuple of axes) the compressor averages over.
      param_specs: partition specs of ``params`` (default ``P()``: replicated).
      accumulator_axis: the axis (or tuple of axes) the accumulators of
        :func:`sidco_jax.accumulate` are split over (default ``axis_name``;
        see :func:`state_specs`).

    Returns:
      The optimizer state.
    """
    _devices_along(mesh, axis_name)
    if accumulator_axis is not None:
        _devices_along(mesh, accumulator_axis, "accumulator_axis")
    # What each device's init sees: its shards of the parameters (a Cut records their shapes).
    one, full = params, None
    if param_specs is not None:
        one, full = _per_device(params, mesh, param_specs)
    abstract = jax.eval_shape(tx.init, one)
    specs = state_specs(abstract, axis_name, accumulator_axis=accumulator_axis, param_specs=full)
    in_specs = (P() if param_specs is None else param_specs,)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=in_specs, out_specs=specs)
    return jax.jit(init)(params)


def _check_all_sharded(params, specs) -> None:
    """Refuses a floating-point leaf left whole among sharded parameters: each device's
    gradient of it would be its own, and the compressor would update it differently on each."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), spec in zip(flat, jax.tree.leaves(specs, is_leaf=_is_spec), strict=True):
        if is_float(leaf) and not _spec_axes(spec):
            raise ValueError(
                f"params{jax.tree_util.keystr(path)} is whole on every device (its spec is "
                f"{spec}) among sharded parameters: split it too, a dimension over the axis "
                "the others are split over"
            )


def _is_spec(node) -> bool:
    return isinstance(node, P)


def _per_device(params, mesh: Mesh, param_specs) -> tuple[Any, Any]:
    """The shapes and dtypes of one device's shards of ``params``, and the spec of every leaf
    (``param_specs`` may be a prefix tree of them)."""

    def shard(spec, x):
        shape = NamedSharding(mesh, spec).shard_shape(jnp.shape(x))
        return jax.ShapeDtypeStruct(shape, jnp.result_type(x))

    return _by_spec(shard, param_specs, params), _by_spec(lambda spec, _: spec, param_specs, params)


def _devices_along(mesh: Mesh, axis_name: AxisName, name: str = "axis_name") -> int:
    """Devices along ``axis_name``; an axis not in ``mesh`` is refused, naming ``name``."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        raise ValueError(
            f"{name} {axis_name!r} names {missing[0]!r}, which is not an axis of the mesh; its "
            f"axes are {tuple(mesh.axis_names)}"
        )
    return math.prod(mesh.shape[n] for n in names)


def _check_state(opt_state, one_device, mesh: Mesh, axes: dict[str, AxisName]) -> None:
    """Refuses a state whose per-device leaves are not split over the axes the step splits them.

    ``one_device`` is ``tx.init``'s state on one device; a per-device leaf of
    the global state stacks one such leaf per device along its axes.
    """
    if jax.tree.structure(opt_state) != jax.tree.structure(one_device):
        return  # shard_map names the difference
    _check_slices(one_device, mesh, axes)
    given = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    kinds = jax.tree.leaves(_kinds(one_device))
    for (path, leaf), one, kind in zip(given, jax.tree.leaves(one_device), kinds, strict=True):
        if kind == _REPLICATED:
            continue
        devices = _devices_along(mesh, axes[kind])
        want = (devices * one.shape[0], *one.shape[1:])
        if jnp.shape(leaf) != want:
            raise ValueError(
                f"opt_state{jax.tree_util.keystr(path)} must have shape {want} (one {kind} per "
                f"device, split over {axes[kind]!r}: {devices} devices), got {jnp.shape(leaf)}: "
                "make the state with sidco.parallel.shard_init(tx, params, mesh, "
                f"{axes[_RESIDUAL]!r}, accumulator_axis={axes[_ACCUMULATOR]!r})"
            )


def _check_slices(one_device, mesh: Mesh, axes: dict[str, AxisName]) -> None:
    """Refuses residuals that differ between a node's devices (``inner_shards``) but split over
    fewer axes than the batch: each device holds its own, so they split over every device."""
    states = jax.tree.leaves(one_device, is_leaf=lambda n: isinstance(n, CompressState))
    for state in states:
        if not isinstance(state, CompressState) or state.residual is None:
            continue
        form = residuals.form_of(state.residual)
        if not form.per_node_device:
            continue
        if _devices_along(mesh, axes[_RESIDUAL]) != _devices_along(mesh, axes[_ACCUMULATOR]):
            shards = "params" if form is residuals.SHARDS else state.residual.cut.shards
            raise ValueError(
                f"the compressor keeps a residual per device of a node "
                f"(inner_shards={shards!r}), so its residual splits over every "
                f"axis of the batch, {axes[_ACCUMULATOR]!r}, not over state_axis "
                f"{axes[_RESIDUAL]!r} alone: pass state_axis={axes[_ACCUMULATOR]!r} and make the "
                f"state with sidco.parallel.shard_init(tx, params, mesh, {axes[_ACCUMULATOR]!r})"
            )


def _split(batch: Any, mesh: Mesh, axis_name: AxisName) -> Any:
    """``batch`` split along ``axis_name`` in the step, however it was given.

    Over Explicit mesh axes (``jax.make_mesh``'s default) ``shard_map`` takes
    only inputs whose type says they are split so: a host (NumPy) array, or
    one placed otherwise, is resharded here (a batch from :func:`place` is
    left as it is). Over Auto axes ``shard_map`` reshards by itself.
    """
    devices = _devices_along(mesh, axis_name)
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = jnp.shape(leaf)
        if not shape or shape[0] % devices:
            raise ValueError(
                f"batch{jax.tree_util.keystr(path)} must have a leading axis that splits evenly "
                f"over the {devices} devices along {axis_name!r}, got shape {shape}"
            )
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(types[name] != AxisType.Explicit for name in names):
        return batch
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(lambda leaf: jax.reshard(leaf, sharding), batch)


def place(tree: Any, mesh: Mesh, spec: Any = None) -> Any:
    """Host arrays as global arrays on ``mesh`` with partition ``spec``.

    Every process passes the same whole (global) host arrays and supplies the
    rows its own devices hold, so this works unchanged on one process and
    across processes (``jax.distributed``), where ``jax.device_put`` of a host
    array would need every device to be addressable.

    Args:
      tree: a pytree of host (NumPy) or device arrays, the global values.
      mesh: the device mesh.
      spec: how every leaf is partitioned (default None: ``P()``, replicated);
        ``P(axis_name)`` splits each leaf's leading axis over ``axis_name``. A
        tree of specs like ``tree`` (or a prefix of it) partitions each leaf
        its own way, as sharded parameters are.

    Returns:
      The same tree of global ``jax.Array`` with ``NamedSharding(mesh, spec)``.

    Examples:
      >>> import jax, numpy as np, sidco_jax as sidco
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> batch = sidco.parallel.place({"x": np.ones((4, 3))}, mesh, jax.P("data"))
      >>> batch["x"].shape, batch["x"].sharding.spec
      ((4, 3), P('data',))
    """

    def put(spec, x):
        x, sharding = np.asarray(x), NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return _by_spec(put, P() if spec is None else spec, tree)


def per_device(params: Any, mesh: Mesh, axis_name: AxisName, param_specs: Any = None) -> Any:
    """One copy of ``params`` per device along ``axis_name``: a new leading axis split over it.

    The layout of parameters that differ across devices, as
    :func:`sidco_jax.diloco` trains them between its synchronizations: a leaf
    ``x`` becomes ``(devices, *x.shape)``, device ``i`` holding row ``i``.
    With ``param_specs``, each copy is sharded as they say (FSDP within a
    node: one copy per node, split over the node's devices). Like
    :func:`place`, it works unchanged across processes.

    Args:
      params: the parameters (host or fully addressable arrays).
      mesh: the device mesh.
      axis_name: the axis (or tuple of axes) the copies are split over.
      param_specs: how each copy is sharded (a ``PartitionSpec`` per leaf, or
        a prefix tree of them; default None: whole on each device).

    Returns:
      The global arrays, ``NamedSharding(mesh, P(axis_name, *spec))``.

    Examples:
      >>> import jax, numpy as np, sidco_jax as sidco
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> copies = sidco.parallel.per_device({"w": np.zeros(3)}, mesh, "data")
      >>> copies["w"].shape
      (1, 3)
    """
    devices = _devices_along(mesh, axis_name)
    stacked = jax.tree.map(lambda x: np.broadcast_to(x, (devices, *np.shape(x))), params)
    specs = P() if param_specs is None else param_specs
    return place(stacked, mesh, jax.tree.map(lambda s: P(axis_name, *s), specs, is_leaf=_is_spec))


def _copies(param_specs: Any, batch_axes: tuple[str, ...]) -> Any:
    """The specs of per-device copies of sharded parameters (:func:`per_device`): each split
    over the batch axes its shards are not split over."""

    def spec(s):
        rest = _unsplit(s, batch_axes)
        return P(rest[0] if len(rest) == 1 else (rest or None), *s)

    return jax.tree.map(spec, param_specs, is_leaf=_is_spec)


def _unsplit(spec, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Those of ``axes`` that ``spec`` does not split any dimension over."""
    held = {a for _, split in _spec_axes(spec) for a in split}
    return tuple(a for a in axes if a not in held)


def _spec_axes(spec) -> list[tuple[int, tuple[str, ...]]]:
    """``(dimension, axes)`` of every dimension a ``PartitionSpec`` splits."""
    return [(d, a if isinstance(a, tuple) else (a,)) for d, a in enumerate(spec) if a is not None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gathered(x, axes: tuple[str, ...], dim: int):
    return jax.lax.all_gather(x, axes, axis=dim, tiled=True)


def _gathered_fwd(x, axes, dim):
    return _gathered(x, axes, dim), None


def _gathered_bwd(axes, dim, _, cotangent):
    scattered = jax.lax.psum_scatter(cotangent, axes, scatter_dimension=dim, tiled=True)
    return (scattered / jax.lax.axis_size(axes),)


_gathered.defvjp(_gathered_fwd, _gathered_bwd)


def gather(params: Any, param_specs: Any) -> Any:
    """The whole parameters from this device's shards, inside ``jax.shard_map``.

    Each leaf is all-gathered over the mesh axes its spec names, along the
    dimensions it names them at. Under ``jax.grad`` the gradient comes back
    as this device's shard of the *mean* over those devices of their
    gradients (a ``psum_scatter``, divided): FSDP's backward pass, ready for a
    compressor built with ``inner_shards="params"``.

    Args:
      params: this device's shards of the parameters (the ``jax.shard_map``
        body's view of parameters placed with ``param_specs``).
      param_specs: a ``PartitionSpec`` per leaf of ``params`` (a prefix tree
        of it also works), as given to ``jax.shard_map``.

    Returns:
      The parameters, whole on every device.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, sidco_jax as sidco
      >>> mesh = jax.make_mesh((1,), ("local",), devices=jax.devices()[:1])
      >>> w = sidco.parallel.place(np.arange(4.0), mesh, jax.P("local"))
      >>> def loss(w):  # the model sees the whole parameters
      ...     return jnp.sum(sidco.parallel.gather(w, jax.P("local")) ** 2)
      >>> shard_grad = jax.shard_map(
      ...     jax.grad(loss), mesh=mesh, in_specs=jax.P("local"), out_specs=jax.P("local"))
      >>> shard_grad(w)
      Array([0., 2., 4., 6.], dtype=float32)
    """

    def whole(spec, x):
        for dim, axes in _spec_axes(spec):
            x = _gathered(x, axes, dim)
        return x

    return _by_spec(whole, param_specs, params)


def _by_spec(fn, specs, tree) -> Any:
    """``fn(spec, leaf)`` for every leaf of ``tree``, ``specs`` a prefix tree of its specs."""

    def subtree(spec, sub):
        return jax.tree.map(lambda x: fn(spec, x), sub)

    return jax.tree.map(subtree, specs, tree, is_leaf=_is_spec)


def _local_step(loss, tx, axis_name: AxisName, local_params: bool, param_specs) -> Callable:
    """One device's step of :func:`data_parallel_step`: gradient, update, new parameters."""
    batch_axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def varying(spec, p):
        # Parameters the same across devices would make the backward pass psum the gradient
        # densely: they vary over every batch axis their shards do not already vary over.
        rest = _unsplit(spec, batch_axes)
        return jax.lax.pcast(p, rest, to="varying") if rest else p

    def whole_loss(params, batch):
        return loss(params if param_specs is None else gather(params, param_specs), batch)

    def step(params, opt_state, batch):
        if local_params:  # each device's copy varies over every batch axis already
            own = jax.tree.map(lambda p: p[0], params)
            value, grads = jax.value_and_grad(whole_loss)(own, batch)
        else:
            own = params
            at = _by_spec(varying, P() if param_specs is None else param_specs, own)
            value, grads = jax.value_and_grad(whole_loss)(at, batch)
        updates, opt_state = tx.update(grads, opt_state, own)
        own = optax.apply_updates(own, updates)
        params = jax.tree.map(lambda p: p[None], own) if local_params else own
        return params, opt_state, jax.lax.pmean(value, axis_name)

    return step


def data_parallel_step(
    loss: Callable[..., jax.Array],
    tx: optax.GradientTransformation,
    opt_state: optax.OptState,
    mesh: Mesh,
    axis_name: AxisName,
    *,
    state_axis: AxisName | None = None,
    donate_state: bool = False,
    local_params: bool = False,
    param_specs: Any = None,
) -> Callable:
    """The jitted data-parallel training step of ``loss`` under ``jax.shard_map``.

    On every device: the gradient of ``loss`` on that device's shard of the
    batch, ``tx.update`` (whose compressor averages over ``axis_name``) and
    ``optax.apply_updates``. The parameters are replicated (``P()``), the
    batch split along its leading axis (``P(axis_name)``) and the optimizer
    state has the specs of :func:`state_specs`, as :func:`shard_init` gives it.
    The gradient is taken with respect to the parameters cast to varying
    (``jax.lax.pcast``): without that, the backward pass of replicated
    parameters would ``psum`` the gradient densely before the compressor sees it.

    Args:
      loss: ``loss(params, batch) -> scalar``, the mean loss of one device's
        batch shard (``batch`` is any pytree).
      tx: the optimizer, containing a compressor with ``axis_name=axis_name``.
      opt_state: the optimizer state, or its ``jax.eval_shape`` (only its
        structure is used, to derive the partition specs).
      mesh: the device mesh.
      axis_name: the mesh axis (or tuple of axes) the batch is split over.
      state_axis: the axis the residuals are split over (default
        ``axis_name``). For a hierarchical compressor
        (``compress(r, axis_name="node", inner_axis="local")``) that is its
        ``axis_name``, while the batch is split over ``("node", "local")``.
        The accumulators of :func:`sidco_jax.accumulate` are split over
        ``axis_name``, like the batch: make the state with
        ``shard_init(tx, params, mesh, state_axis, accumulator_axis=axis_name)``.
      donate_state: donate the optimizer state's buffers to the step (saves
        memory; the state passed in must not be used again).
      local_params: the parameters differ across devices, one copy per
        device along a leading axis (:func:`per_device`), as
        :func:`sidco_jax.diloco` trains them; each device's gradient is taken
        at its own copy. With ``param_specs``, each copy is sharded so and
        split over the batch axes its shards are not (``per_device(params,
        mesh, "node", param_specs)``: one copy per node, FSDP within it).
      param_specs: how the parameters are sharded (a ``PartitionSpec`` per
        leaf, or a prefix tree of them; default None: replicated). Each
        device holds its shards, the loss sees them gathered (:func:`gather`)
        and the compressor gets the gradient as this device's shard of the
        mean over the devices holding the other shards: give it
        ``inner_shards="params"`` over those axes (FSDP within a node), and
        split the residuals over every axis of the batch (``state_axis``).

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, loss)``, with
      ``loss`` the mean over devices. ``params`` and ``opt_state`` are global
      arrays with the shardings above (see :func:`place` and
      :func:`shard_init`). ``batch`` is best placed with :func:`place`, which
      copies each device its own rows; host (NumPy) arrays, and arrays placed
      otherwise, are split in the step, each device first receiving the whole
      batch. When it is traced, the step raises a ``ValueError`` naming a
      leaf of ``batch`` whose leading axis does not split evenly over the
      devices, or a leaf of ``opt_state`` whose per-device leaves are not split
      over the axes above (a state made with other axes, or with ``tx.init``
      on one device).

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, sidco_jax as sidco
      >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
      >>> tx = optax.chain(sidco.compress(0.1, axis_name="data"), optax.sgd(0.1))
      >>> params = sidco.parallel.place(jnp.zeros(50), mesh)
      >>> opt_state = sidco.parallel.shard_init(tx, params, mesh, "data")
      >>> def loss(w, batch):
      ...     return jnp.mean((batch @ w - 1.0) ** 2)
      >>> step = sidco.parallel.data_parallel_step(loss, tx, opt_state, mesh, "data")
      >>> batch = sidco.parallel.place(np.ones((4, 50), np.float32), mesh, jax.P("data"))
      >>> params, opt_state, value = step(params, opt_state, batch)
      >>> float(value)
      1.0
    """
    state_axis = axis_name if state_axis is None else state_axis
    _devices_along(mesh, axis_name)
    _devices_along(mesh, state_axis, "state_axis")
    step = _local_step(loss, tx, axis_name, local_params, param_specs)
    axes = {_RESIDUAL: state_axis, _ACCUMULATOR: axis_name}
    batch_axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def checked(params, opt_state, batch):
        one, full, param_spec = params, None, P()
        if param_specs is not None:
            full = _by_spec(lambda spec, _: spec, param_specs, params)
            _check_all_sharded(params, full)
            param_spec = _copies(full, batch_axes) if local_params else full
            one, _ = _per_device(params, mesh, param_spec)
        elif local_params:
            param_spec = P(axis_name)
            one, _ = _per_device(params, mesh, param_spec)
        if local_params:  # one copy's shards
            one = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], p.dtype), one)
        _check_state(opt_state, jax.eval_shape(tx.init, one), mesh, axes)
        specs = state_specs(opt_state, state_axis, accumulator_axis=axis_name, param_specs=full)
        sharded = jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(param_spec, specs, P(axis_name)),
            out_specs=(param_spec, specs, P()),
        )
        return sharded(params, opt_state, _split(batch, mesh, axis_name))

    return jax.jit(checked, donate_argnums=(1,) if donate_state else ())
