"""Partition specs and initialisation of optax states that hold per-device residuals.

Under ``jax.shard_map`` each device keeps its own error-feedback residual, a
float32 tree shaped like the parameters, while everything else in the
optimizer state (momentum, step counts, the stage controller, metrics) stays
replicated. As global arrays the residuals of ``d`` devices are stacked along
each leaf's first axis: a leaf of shape ``(m, ...)`` becomes ``(d * m, ...)``
sharded along the axis, device ``i`` holding rows ``[i * m, (i + 1) * m)``.
"""

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sidco_jax._src.accumulate import AccumulateState
from sidco_jax._src.base import AxisName, CompressState


def _is_state(node) -> bool:
    return isinstance(node, CompressState | AccumulateState)


def is_residual(opt_state: optax.OptState) -> Any:
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

    def mark(node):
        if isinstance(node, CompressState):
            marks = jax.tree.map(lambda _: False, node)
            return marks._replace(residual=jax.tree.map(lambda _: True, node.residual))
        if isinstance(node, AccumulateState):  # its accumulator is per device too
            return AccumulateState(
                mark(node.mini_step),
                jax.tree.map(lambda _: True, node.accumulator),
                jax.tree.map(mark, node.inner, is_leaf=_is_state),
            )
        return jax.tree.map(lambda _: False, node)

    return jax.tree.map(mark, opt_state, is_leaf=_is_state)


def state_specs(opt_state: optax.OptState, axis_name: AxisName) -> Any:
    """Partition specs for a whole optax state containing sidco_jax states.

    Every leaf of the residual of every :class:`~sidco_jax.CompressState`,
    and of the accumulator of every :class:`~sidco_jax.AccumulateState`, is
    per device (``P(axis_name)``); every other leaf is replicated (``P()``). Use the
    result as ``in_specs``/``out_specs`` of ``jax.shard_map`` for the state.

    Args:
      opt_state: the state, or its ``jax.eval_shape``.
      axis_name: the mesh axis (or tuple of axes) the compressor averages over.

    Returns:
      A tree of ``PartitionSpec`` with the structure of ``opt_state``.

    Examples:
      >>> import jax.numpy as jnp, optax, sidco_jax as sidco
      >>> tx = optax.chain(sidco.compress(0.1, axis_name="data"), optax.sgd(0.1))
      >>> specs = sidco.state_specs(tx.init(jnp.zeros(100)), "data")
      >>> specs[0].residual, specs[0].count
      (P('data',), P())
    """
    return jax.tree.map(lambda residual: P(axis_name) if residual else P(), is_residual(opt_state))


def state_shardings(opt_state: optax.OptState, mesh: Mesh, axis_name: AxisName) -> Any:
    """``NamedSharding`` on ``mesh`` for every leaf of ``opt_state`` (see :func:`state_specs`)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), state_specs(opt_state, axis_name))


def shard_init(
    tx: optax.GradientTransformation,
    params: optax.Params,
    mesh: Mesh,
    axis_name: AxisName,
    param_specs: Any = None,
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

    Returns:
      The optimizer state.
    """
    specs = state_specs(jax.eval_shape(tx.init, params), axis_name)
    in_specs = (P() if param_specs is None else param_specs,)
    init = jax.shard_map(tx.init, mesh=mesh, in_specs=in_specs, out_specs=specs)
    return jax.jit(init)(params)
