"""Data-parallel training steps with a sidco_jax compressor, under ``jax.shard_map``.

The same code runs on forced CPU devices, on GPUs and across processes
(``jax.distributed``): the mesh spans ``jax.devices()`` and each device
computes the gradient of its shard of the batch.
"""

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco

AXIS = "data"


def compressor(
    name: str, ratio: float, axis_name: str | None = AXIS
) -> optax.GradientTransformation:
    """The compressor called ``name`` (one of ``sidco.COMPRESSORS``) averaging over ``axis_name``.

    ``axis_name=None`` gives the same compressor on one device, with no communication.
    """
    return sidco.compressor(name, ratio, axis_name=axis_name)


class Trainer(NamedTuple):
    """A compiled data-parallel step and what it needs.

    Attributes:
      step: ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
      mesh: the device mesh (one axis, :data:`AXIS`).
      opt_state: the initial optimizer state (per-device residuals included).
      bytes_per_step: bytes one device sends per step, read from the compiled HLO.
    """

    step: Callable
    mesh: Any
    opt_state: Any
    bytes_per_step: int


def place(mesh, tree, spec):
    """Host arrays as global arrays with ``spec`` (each process supplies its own rows)."""

    def put(x):
        x = np.asarray(x)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, tree)


def build(loss: Callable, params, batch, tx: optax.GradientTransformation, devices: int) -> Trainer:
    """Compiles the data-parallel step of ``loss(params, batch) -> scalar``.

    Args:
      loss: mean loss of a (per-device) batch.
      params: replicated parameters (a pytree of global arrays).
      batch: an example global batch (leading axis split over devices).
      tx: the optimizer, whose compressor averages over :data:`AXIS`.
      devices: how many of ``jax.devices()`` to use.

    Returns:
      The :class:`Trainer`.
    """
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])
    params = place(mesh, params, P())
    opt_state = sidco.shard_init(tx, params, mesh, AXIS)
    specs = sidco.state_specs(opt_state, AXIS)

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), specs, P(AXIS)),
        out_specs=(P(), specs, P()),
    )
    def step(params, opt_state, batch):
        # pcast: the gradient of replicated params would otherwise be psummed
        # densely by the backward pass, before the compressor sees it.
        value, grads = jax.value_and_grad(loss)(jax.lax.pcast(params, AXIS, to="varying"), batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(value, AXIS)

    step = jax.jit(step, donate_argnums=(1,))
    compiled = step.lower(params, opt_state, place(mesh, batch, P(AXIS))).compile()
    sent = sum(c.operand_bytes for c in sidco.hlo_collectives(compiled))
    return Trainer(step, mesh, opt_state, sent)


def flat_gradient(loss: Callable, params, batch) -> np.ndarray:
    """The whole-model gradient of ``loss`` on ``batch`` as one float32 vector."""
    grads = jax.jit(jax.grad(loss))(params, batch)
    return np.concatenate([np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(grads)])


def first_residual(opt_state) -> np.ndarray | None:
    """Device 0's error-feedback residual as one flat vector, or None without one.

    The residual is a tree like the parameters; its leaves (device 0's rows of
    each) are concatenated in ``jax.tree.leaves`` order, like :func:`flat_gradient`.
    """
    marked = jax.tree.leaves(sidco.is_residual(opt_state))
    leaves = [x for x, m in zip(jax.tree.leaves(opt_state), marked, strict=True) if m]
    if not leaves:
        return None
    return np.concatenate([np.ravel(np.asarray(x.addressable_shards[0].data)) for x in leaves])


def replicated_value(x) -> np.ndarray:
    """A replicated global array as NumPy (works in every process)."""
    return np.asarray(x.addressable_data(0))
