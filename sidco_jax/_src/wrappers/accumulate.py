"""Gradient accumulation that selects and communicates once per optimizer step.

``optax.MultiSteps`` calls the inner ``update`` on every micro-step and masks
the result, so a compressor inside it selects, and with an ``axis_name``
communicates, ``every_k`` times per optimizer step. :func:`accumulate` adds
the micro-steps' gradients into a local accumulator instead and runs the inner
transformation once, on their mean, under a ``lax.cond`` on the micro-step
count, which every device holds alike: a micro-step has no selection and no
collective in it.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from sidco_jax._src.base import check_integer, check_transformation, zeros_as
from sidco_jax._src.loop import memo
from sidco_jax._src.loop.eager import compiled_when_eager


class AccumulateState(NamedTuple):
    """State of :func:`accumulate`.

    Attributes:
      mini_step: int32 micro-steps accumulated since the last optimizer step
        (the same on every device).
      accumulator: float32 running mean of those micro-steps' gradients, a
        tree like the parameters. Per device, like the error-feedback residual:
        under ``jax.shard_map`` its partition spec is ``P(axis_name)``, or with
        a hierarchical compressor, whose node mean comes after it,
        ``P((axis_name, inner_axis))`` (see :func:`sidco_jax.parallel.state_specs`).
      inner: the wrapped transformation's state.
    """

    mini_step: jax.Array
    accumulator: Any
    inner: Any


def check_every_k(every_k) -> int:
    """``every_k`` as a Python ``int`` in ``[1, 2**31 - 1]``; refuses a traced one."""
    if isinstance(every_k, jax.core.Tracer):
        raise ValueError(
            f"every_k must be a concrete integer >= 1, got a traced {every_k.dtype}"
            f"{list(every_k.shape)}: it decides which steps communicate, so it is fixed when "
            "the step is built (with optax.inject_hyperparams, list it in static_args)"
        )
    return check_integer("every_k", every_k, 1)


@memo.memoized
def accumulate(
    tx: optax.GradientTransformation, every_k: int
) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``every_k`` micro-steps' gradients, then runs ``tx`` once on their mean.

    The arithmetic of ``optax.MultiSteps(tx, every_k)``: its running mean
    ``acc + (g - acc) / (i + 1)``, then ``tx``, compiled together in one
    ``lax.cond`` branch even when the update is not jitted. The inner state,
    residuals included, comes out bit for bit the same in the tests; an update
    may differ in its last bit or two, where XLA fuses the optimizer's
    multiply-add in one program and not in the other. But a micro-step only
    adds its gradient to a local float32 accumulator: no selection and no
    collective. The ``every_k``-th step runs ``tx.update`` on the mean, under a
    ``lax.cond`` whose predicate (the micro-step count) is identical on every
    device, and returns its update; the other steps return zeros.

    Args:
      tx: the transformation to run once per ``every_k`` steps, typically an
        ``optax.chain`` of a compressor and an optimizer.
      every_k: micro-steps per optimizer step, a concrete int in
        ``[1, 2**31 - 1]``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      :class:`AccumulateState` (:func:`sidco_jax.metrics`,
      :func:`sidco_jax.parallel.state_specs` and :func:`sidco_jax.parallel.shard_init` see
      through it).

    Raises:
      TypeError: for a ``tx`` that is not an optax ``GradientTransformation``,
        or an ``every_k`` that is not an integer (bools included).
      ValueError: for an ``every_k`` outside ``[1, 2**31 - 1]`` or traced.

    Examples:
      >>> import jax.numpy as jnp, optax, sidco_jax as sidco
      >>> tx = sidco.accumulate(optax.chain(sidco.compress(0.5), optax.sgd(1.0)), 2)
      >>> params = jnp.zeros(4)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(jnp.array([4.0, 0.0, -2.0, 0.0]), state, params)
      >>> updates  # a micro-step: nothing sent
      Array([0., 0., 0., 0.], dtype=float32)
      >>> updates, state = tx.update(jnp.array([0.0, 0.0, -2.0, 1.0]), state, params)
      >>> updates  # the mean [2, 0, -2, 0.5], compressed to half its entries
      Array([-2., -0.,  2., -0.], dtype=float32)
    """
    check_transformation("tx", tx)
    every_k = check_every_k(every_k)
    tx = optax.with_extra_args_support(tx)

    def init(params):
        accumulator = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return AccumulateState(jnp.zeros((), jnp.int32), accumulator, tx.init(params))

    def update(updates, state, params=None, **extra_args):
        def running_mean():
            # optax.MultiSteps' running mean, acc + (g - acc) / (i + 1), inside the cond's
            # branches as MultiSteps has it: compiled even when the update is not, where
            # XLA fuses it into one multiply-add (op by op it was rounded twice).
            i = state.mini_step
            return jax.tree.map(lambda g, a: a + (g - a) / (i + 1), updates, state.accumulator)

        def step(_):
            mean = running_mean()
            out, inner = tx.update(
                optax.tree.cast_like(mean, updates), state.inner, params, **extra_args
            )
            return out, inner, jax.tree.map(jnp.zeros_like, mean)

        def hold(_):
            zeros = jax.tree.map(zeros_as, jax.eval_shape(step, None)[0])
            return zeros, state.inner, running_mean()

        boundary = state.mini_step == every_k - 1
        out, inner, accumulator = lax.cond(boundary, step, hold, None)
        return out, AccumulateState((state.mini_step + 1) % every_k, accumulator, inner)

    return compiled_when_eager(optax.GradientTransformationExtraArgs(init, update))
