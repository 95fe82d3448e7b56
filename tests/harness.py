"""Shared test set-up: per-device gradient streams and runs under shard_map or plain jit."""

import functools
import math
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco

AXIS = "data"
DEVICES = 8
SHAPES = {"w": (48, 40), "b": (40,), "v": (300,)}  # 2260 float entries


# Compressors picked by their registry traits, never by name, so a new one is covered.
SELECTING = [n for n in sidco.COMPRESSORS if sidco.traits(n).kind != "none"]  # all but dense
WITH_INDICES = [n for n in sidco.COMPRESSORS if sidco.traits(n).indices == "sent"]


def one_of_each_kind(names) -> list[str]:
    """The first of ``names`` of each kind of rule (:class:`sidco_jax.Traits`)."""
    firsts = {}
    for name in names:
        firsts.setdefault(sidco.traits(name).kind, name)
    return list(firsts.values())


def params_tree():
    return {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}


def gradient_stream(rng, steps, identical=False):
    """Per-device gradients, a leading device axis on every leaf.

    The values are multiples of 1/64 below 4 in magnitude: sums of up to 8 of
    them are exact in float32, so results that differ only in summation order
    compare bit for bit.
    """

    def draw(shape):
        if identical:
            return np.broadcast_to(draw_one(shape), (DEVICES, *shape))
        return draw_one((DEVICES, *shape))

    def draw_one(shape):
        return (np.round(rng.standard_t(3, size=shape) * 8) / 64).clip(-4, 4).astype(np.float32)

    stream = []
    for _ in range(steps):
        grads = {k: draw(s) for k, s in SHAPES.items()}
        stream.append(grads)
    return stream


def mesh_of(devices=DEVICES):
    return jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])


def run_shard_map(tx, stream, devices=DEVICES, start=None):
    """``tx`` under shard_map, data-parallel over ``devices``, applied to parameters.

    Args:
      tx: the optimizer.
      stream: per-device gradients (see :func:`gradient_stream`).
      devices: the first ``devices`` devices form the mesh.
      start: ``(params, opt_state)`` to continue from; default a fresh start.

    Returns:
      ``(updates, states, params)``: the update and optimizer state after
      every step, and the final parameters (all global arrays).
    """
    mesh = mesh_of(devices)
    if start is None:
        params = jax.device_put(params_tree(), NamedSharding(mesh, P()))
        state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
    else:
        params, state = start
    specs = sidco.parallel.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P(AXIS)),
        out_specs=(P(), P(), specs),
        check_vma=True,
    )
    def step(params, state, grads):
        update, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
        return optax.apply_updates(params, update), update, state

    updates, states = [], []
    for grads in stream:
        grads = jax.device_put(
            jax.tree.map(lambda g: g[:devices], grads), NamedSharding(mesh, P(AXIS))
        )
        params, update, state = step(params, state, grads)
        updates.append(update)
        states.append(state)
    return updates, states, params


def mesh_step(tx, mesh, state_axes, params=None):
    """``tx`` jitted under ``shard_map(check_vma=True)`` on ``mesh``, residuals split over
    ``state_axes``: ``(step, params, state, put)``, the placed parameters, a fresh state, and
    ``put(grads)``, which splits gradients with a leading device axis over all mesh axes."""
    params = jax.device_put(params_tree() if params is None else params, NamedSharding(mesh, P()))
    state = sidco.parallel.shard_init(tx, params, mesh, state_axes)
    specs = sidco.parallel.state_specs(state, state_axes)
    every = tuple(mesh.axis_names)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P(every)),
        out_specs=(P(), specs),
        check_vma=True,
    )
    def step(params, state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state, params)

    return step, params, state, lambda grads: jax.device_put(grads, NamedSharding(mesh, P(every)))


def run_on_mesh(tx, stream, mesh, state_axes, params=None):
    """``tx`` under ``shard_map(check_vma=True)`` on ``mesh``, gradients split over all its axes.

    The residuals are split over ``state_axes``. Returns every step's update
    and the last state.
    """
    step, params, state, put = mesh_step(tx, mesh, state_axes, params)
    updates = []
    for grads in stream:
        update, state = step(params, state, put(grads))
        updates.append(update)
    return updates, state


def per_device_step(tx, mesh, state, axes=AXIS):
    """A jitted ``shard_map`` step over ``axes``: per-device gradients in, per-device updates out.

    Gradients carry a leading device axis; so do the returned updates, so that
    tests can compare the replicas. The state has the specs of ``state``, its
    residual split over ``AXIS``.
    """
    specs = sidco.parallel.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(specs, P(axes)), out_specs=(P(axes), specs)
    )
    def step(state, grads):
        update, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
        return jax.tree.map(lambda u: u[None], update), state

    return step


def run_local(tx, stream, device=0):
    """``tx`` (without an axis) on one device's gradients, plain jit."""
    state = tx.init(params_tree())
    update = jax.jit(tx.update)
    updates, states = [], []
    for grads in stream:
        u, state = update(jax.tree.map(lambda g: g[device], grads), state)
        updates.append(u)
        states.append(state)
    return updates, states


def assert_mapped_agrees(mapped, tx, stream):
    """``tx`` under ``mapped`` (``jax.pmap`` or ``jax.vmap``) over AXIS equals it under shard_map.

    The same update on every device at every step, and in the end the same
    per-device residuals and stage count.
    """
    want, want_states, _ = run_shard_map(tx, stream)
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (DEVICES, *jnp.shape(x))), params_tree())
    state = mapped(tx.init, axis_name=AXIS)(stacked)
    update = jax.jit(mapped(tx.update, axis_name=AXIS))
    for grads, w in zip(stream, want, strict=True):
        got, state = update(grads, state)
        for d in range(DEVICES):
            chex.assert_trees_all_equal(jax.tree.map(lambda x, d=d: x[d], got), w)
    for d in range(DEVICES):
        chex.assert_trees_all_equal(
            jax.tree.map(lambda r, d=d: r[d], state.residual),
            device_residual(want_states[-1].residual, d),
        )
    assert int(np.ravel(sidco.metrics(state)["stages"])[0]) == int(
        sidco.metrics(want_states[-1])["stages"]
    )


def copies(x: jax.Array) -> list[np.ndarray]:
    """Every device's buffer of a (replicated) global array."""
    return [np.asarray(s.data) for s in x.addressable_shards]


def train_least_squares(
    steps: int,
    ratio: float = 0.05,
    per_device: int = 16,
    features: int = 256,
    hierarchical: bool = False,
    sharded: bool | str = False,
):
    """Data-parallel least squares over every device of every process (``jax.devices()``).

    The same on one process with 8 devices and on several processes: the data
    come from a fixed seed and each process supplies only its devices' rows.
    ``hierarchical`` runs on a 2 x (devices / 2) mesh: the gradient averaged
    densely over ``"local"`` and compressed over ``"node"``; ``sharded`` too,
    each device of a node compressing its slice (``inner_shards``), or with
    ``sharded="params"`` its shard of the weights, split over ``"local"``.

    Returns:
      The final weights and the compressor's metrics, as NumPy values.
    """
    params, state = least_squares_state(steps, ratio, per_device, features, hierarchical, sharded)
    metrics = {k: np.asarray(v.addressable_data(0)) for k, v in sidco.metrics(state).items()}
    whole = jax.jit(lambda p: p, out_shardings=NamedSharding(params.sharding.mesh, P()))(params)
    return np.asarray(whole.addressable_data(0)), metrics


def least_squares_state(
    steps: int,
    ratio: float = 0.05,
    per_device: int = 16,
    features: int = 256,
    hierarchical: bool = False,
    sharded: bool | str = False,
):
    """The global ``(params, opt_state)`` of :func:`train_least_squares` after ``steps``."""
    devices = jax.device_count()
    specs = None
    if hierarchical:
        mesh = jax.make_mesh((2, devices // 2), ("node", "local"))
        data_axes = ("node", "local")
        axis = data_axes if sharded else "node"
        shards = sharded if sharded == "params" else devices // 2 if sharded else None
        specs = P("local") if sharded == "params" else None
        compressor = sidco.compress(
            ratio, axis_name="node", inner_axis="local", inner_shards=shards
        )
    else:
        mesh = jax.make_mesh((devices,), (AXIS,))
        axis, data_axes = AXIS, AXIS
        compressor = sidco.compress(ratio, axis_name=AXIS)
    data = np.random.default_rng(7)
    x = data.normal(size=(devices * per_device, features)).astype(np.float32)
    y = (x @ data.normal(size=features) + 0.1 * data.normal(size=len(x))).astype(np.float32)

    x, y = sidco.parallel.place((x, y), mesh, P(data_axes))
    params = sidco.parallel.place(np.zeros(features, np.float32), mesh, specs)
    tx = optax.chain(compressor, optax.sgd(0.05))
    state = sidco.parallel.shard_init(tx, params, mesh, axis, specs)

    def loss(w, batch):
        x, y = batch
        return jnp.mean((x @ w - y) ** 2)

    step = sidco.parallel.data_parallel_step(
        loss, tx, state, mesh, data_axes, state_axis=axis, param_specs=specs
    )

    for _ in range(steps):
        params, state, _ = step(params, state, (x, y))
    return params, state


def flat_residual(state) -> np.ndarray:
    """One device's residual tree as one float32 vector (leaves in ``jax.tree.leaves`` order).

    The residual is a tree like the parameters (a zero-size leaf where a leaf
    is not floating point), so this is the concatenation of what error
    feedback keeps for the floating-point leaves.
    """
    leaves = jax.tree.leaves(state.residual)
    return np.concatenate([np.ravel(np.asarray(r)) for r in leaves]).astype(np.float32)


def device_residual(residual, device: int, devices: int = DEVICES):
    """Device ``device``'s part of a global residual tree (each leaf split along axis 0)."""
    return jax.tree.map(lambda r: np.split(np.asarray(r), devices)[device], residual)


def quick_first(values) -> list:
    """``parametrize`` values whose first runs in the quick tier; the rest are marked slow.

    ``pytest -m "not slow"`` then still checks each property once.
    """
    return [v if i == 0 else pytest.param(v, marks=pytest.mark.slow) for i, v in enumerate(values)]


def _entry_lines(jitted, args, shape: tuple[int, ...]) -> list[str]:
    """Lines of the compiled entry computation of ``jitted(*args)`` that name an f32 array
    of ``shape`` or of its flattened size."""
    text = jitted.lower(*args).compile().as_text()
    wanted = (f"f32[{','.join(map(str, shape))}]", f"f32[{math.prod(shape)}]")
    lines = text[text.index("ENTRY") :].splitlines()
    return [line for line in lines if any(w in line for w in wanted)]


def full_size_lines(jitted, *args, shape: tuple[int, ...]) -> list[str]:
    """Lines of the compiled entry computation of ``jitted(*args)`` that name an f32 array
    of ``shape``, or of its flattened size: the passes over it."""
    return _entry_lines(jitted, args, shape)


def full_size_copies(jitted, *args, shape: tuple[int, ...]) -> list[str]:
    """Lines of the compiled entry computation of ``jitted(*args)`` that copy an f32 array
    of ``shape``, or of its flattened size."""
    return [line for line in _entry_lines(jitted, args, shape) if " copy(" in line]


def constant_fills(jitted, *args, shape: tuple[int, ...]) -> list[str]:
    """Lines of the compiled entry computation of ``jitted(*args)`` that fill an f32 array
    of ``shape``, or of its flattened size, from constants alone: written, then read, for
    nothing."""
    fill = re.compile(r"= f32\[[\d,]*\]\S* (fusion|broadcast)\((%constant[\w.]*(, )?)+\)")
    return [line for line in _entry_lines(jitted, args, shape) if fill.search(line)]


def equations(jaxpr):
    """Every equation of ``jaxpr`` and of its sub-jaxprs (``lax.cond`` branches, loop bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


def sorted_sizes(jaxpr) -> list[int]:
    """Operand sizes of every ``top_k`` and ``sort`` in ``jaxpr`` and its sub-jaxprs."""
    return [
        math.prod(eqn.invars[0].aval.shape)
        for eqn in equations(jaxpr)
        if eqn.primitive.name in ("top_k", "sort")
    ]


def require_libtpu() -> None:
    """Skips a test that compiles for a TPU topology where libtpu is not installed,
    except under CI, which installs it (``.[tpu-compile]``): there its absence fails."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        message = "libtpu is not installed: no TPU topology to compile for"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{message} (CI installs it: .[tpu-compile])")
        pytest.skip(message)
