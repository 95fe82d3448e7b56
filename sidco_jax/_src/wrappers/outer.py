"""Outer steps: local training between synchronizations, compressed pseudo-gradients at them.

DiLoCo (Douillard et al., 2023) and its compressed successors (SparseLoCo)
communicate once every ``H`` steps. Each device applies the inner optimizer
to its own parameters, with no communication; every ``H`` steps it takes the
*pseudo-gradient* ``anchor - local``, how far its parameters moved since the
last synchronization, and the devices average it. An outer optimizer turns
the average into a step of the shared anchor, and every device's parameters
become the new anchor. Here the average goes through any compressor of this
library, with its error feedback: what it does not send of a pseudo-gradient
is sent at a later synchronization.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from sidco_jax._src.base import check_integer, check_transformation, next_count, static
from sidco_jax._src.loop import memo
from sidco_jax._src.loop.eager import compiled_when_eager

STATIC_WHY = "decides which steps synchronize and must be static"


class OuterState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      count: int32 steps taken (saturating at ``2**31 - 1``), the same on every device.
      anchor: the parameters of the last synchronization, the same on every device.
      inner: the inner optimizer's state; per device, it follows each device's
        own parameters.
      outer: the outer optimizer's state, the same on every device.
      exchange: the compressor's state (its residual per device).
    """

    count: jax.Array
    anchor: Any
    inner: Any
    outer: Any
    exchange: Any


def _check_params(params, anchor) -> None:
    """Refuses parameters unlike the ones ``init`` saw (structure, shapes, dtypes)."""
    if params is None:
        raise ValueError("diloco's update needs the parameters: call update(grads, state, params)")
    want, got = jax.tree.structure(anchor), jax.tree.structure(params)
    if want != got:
        raise ValueError(f"the parameters' tree structure {got} does not match init's {want}")
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), held in zip(paths, jax.tree.leaves(anchor), strict=True):
        if (jnp.shape(leaf), jnp.result_type(leaf)) != (jnp.shape(held), jnp.result_type(held)):
            raise ValueError(
                f"parameter {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)} and dtype "
                f"{jnp.result_type(leaf)}, but init saw {jnp.shape(held)} and "
                f"{jnp.result_type(held)}: the anchor would not match the model"
            )


def _varying(x) -> frozenset:
    """The mesh axes ``x`` varies over under ``jax.shard_map`` (none elsewhere)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.9; older ones say vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _check_averaged(mean, anchor) -> None:
    """Refuses a compressor whose result still varies across devices (no ``axis_name``): it
    may vary only where the anchor does (sharded parameters: each device its shard)."""
    axes = set()
    for leaf, held in zip(jax.tree.leaves(mean), jax.tree.leaves(anchor), strict=True):
        axes |= _varying(leaf) - _varying(held)
    if axes:
        raise ValueError(
            f"the compressor's average still varies over the mesh axes {sorted(axes)}: the "
            "pseudo-gradients must be averaged over the devices, so build the compressor with "
            f"axis_name={tuple(sorted(axes))!r} (or the axis the batch is split over)"
        )


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """``x`` typed as varying over the mesh axes ``like`` varies over (``lax.cond`` joins them)."""
    axes = tuple(sorted(_varying(like) - _varying(x)))
    return lax.pcast(x, axes, to="varying") if axes else x


def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [jnp.array(True)]))


@memo.memoized
def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    every: int,
    compressor: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Outer steps every ``every`` steps, the pseudo-gradients averaged through ``compressor``.

    Each step applies ``inner`` to this device's parameters, with no
    communication. Every ``every``-th step (the ``every``-th, the
    ``2 every``-th, ...) then averages this device's pseudo-gradient
    ``anchor - local`` through ``compressor``, applies ``outer`` to the
    average as to a gradient of the anchor, and makes every device's
    parameters the new anchor: the update it returns is ``anchor - params``,
    so ``optax.apply_updates`` lands on the anchor to within one float
    rounding, and that rounding is part of the next pseudo-gradient. One
    compilation serves both kinds of step (a ``lax.cond`` on the step count,
    the same on every device); an inner step runs no collective.

    Between synchronizations the parameters differ across devices: under
    ``jax.shard_map`` they are per device
    (:func:`sidco_jax.parallel.per_device`,
    ``data_parallel_step(..., local_params=True)``), like the inner state.
    Sharded parameters (FSDP within a node) are per node and sharded over
    its devices, the anchor and the outer state sharded as the parameters,
    with a compressor built with ``inner_shards="params"``.

    A non-finite gradient on a device skips that device's inner step: its
    parameters and inner state stay as they were, so no NaN or infinity
    ever reaches them, and the other devices step on. (Were a
    pseudo-gradient not finite anyway, an overflow, the compressor would
    skip the exchange everywhere, as it skips any non-finite gradient.)

    Args:
      inner: the optimizer of the local steps, e.g. ``optax.adamw(1e-3)``.
      outer: the optimizer of the anchor, given the averaged pseudo-gradient,
        e.g. ``optax.sgd(0.7, momentum=0.9, nesterov=True)`` (DiLoCo's);
        ``optax.sgd(1.0)`` makes the anchor the devices' mean.
      every: steps between synchronizations (H), an int of at least 1.
      compressor: averages the pseudo-gradients over the devices, e.g.
        ``sidco.compress(0.01, axis_name="data")`` or
        ``sidco.dense(axis_name="data")`` (DiLoCo's dense exchange).

    Returns:
      The transformation; its state is an :class:`OuterState`.

    Raises:
      TypeError: at construction, for an optimizer that is not an optax
        ``GradientTransformation``.
      ValueError: at construction, for ``every`` below 1 or traced; at
        ``update``, without parameters, for parameters unlike those given to
        ``init``, or (under ``jax.shard_map``) for a compressor whose average
        still varies across the devices.

    Examples:
      >>> import jax.numpy as jnp, optax, sidco_jax as sidco
      >>> tx = sidco.diloco(optax.sgd(0.5), optax.sgd(1.0), every=2, compressor=sidco.dense())
      >>> params = jnp.ones(3)
      >>> state = tx.init(params)
      >>> for _ in range(2):
      ...     updates, state = tx.update(jnp.ones(3), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> params.tolist()
      [0.0, 0.0, 0.0]
    """
    for name, tx in (("inner", inner), ("outer", outer), ("compressor", compressor)):
        check_transformation(name, tx)
    every = check_integer("every", static("every", every, STATIC_WHY), 1)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return OuterState(
            jnp.zeros((), jnp.int32),
            params,
            inner.init(params),
            outer.init(params),
            compressor.init(params),
        )

    def update(grads, state, params=None, **extra_args):
        _check_params(params, state.anchor)
        steps, inner_state = inner.update(grads, state.inner, params, **extra_args)
        fine = _all_finite((steps, inner_state))  # else this device skips its step
        steps = jax.tree.map(lambda x: jnp.where(fine, x, jnp.zeros_like(x)), steps)
        # A scalar (a step count) stays the same on every device: it is shared, not split.
        inner_state = jax.tree.map(
            lambda new, old: jnp.where(fine, new, old) if jnp.ndim(new) else new,
            inner_state,
            state.inner,
        )
        local = optax.apply_updates(params, steps)
        count = next_count(state.count)

        def synchronize(_):
            moved = jax.tree.map(jnp.subtract, state.anchor, local)
            mean, exchange = compressor.update(moved, state.exchange, state.anchor)
            _check_averaged(mean, state.anchor)
            step, outer_state = outer.update(mean, state.outer, state.anchor)
            anchor = optax.apply_updates(state.anchor, step)
            target = jax.tree.map(_varying_like, anchor, local)
            return target, anchor, inner_state, outer_state, exchange

        def carry_on(_):
            return local, state.anchor, inner_state, state.outer, state.exchange

        target, anchor, inner_state, outer_state, exchange = lax.cond(
            count % every == 0, synchronize, carry_on, None
        )
        updates = jax.tree.map(jnp.subtract, target, params)
        return updates, OuterState(count, anchor, inner_state, outer_state, exchange)

    return compiled_when_eager(optax.GradientTransformationExtraArgs(init, update))
