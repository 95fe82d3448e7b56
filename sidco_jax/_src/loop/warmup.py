"""Dense steps before compression starts, as a wrapper in the style of optax's
``conditionally_transform``.

One ``lax.cond`` on the step count, which every device holds alike: both
paths are compiled once and each step runs one of them. A dense step leaves
the residual and the rule's state as they are and reports the dense bytes, at
the compressor's target density.
"""

import jax.numpy as jnp
import optax
from jax import lax

from sidco_jax._src.base import CompressState


def warmed_up(
    compressed: optax.GradientTransformationExtraArgs,
    dense: optax.GradientTransformationExtraArgs,
    steps: int,
) -> optax.GradientTransformationExtraArgs:
    """``compressed``, preceded by ``steps`` steps of ``dense`` on the same state.

    Args:
      compressed: a transformation whose state is a :class:`~sidco_jax.CompressState`.
      dense: the loop with a rule that sends everything and keeps no residual.
      steps: how many steps are dense (an int >= 0, or traced).
    """

    def update(updates, state: CompressState, params=None, **extra_args):
        def warm(_):
            out, done = dense.update(
                updates, state._replace(residual=None, rule=optax.EmptyState())
            )
            last = done.last._replace(
                target_density=state.last.target_density,
                threshold=jnp.zeros_like(state.last.threshold),
            )
            return out, state._replace(count=done.count, last=last)

        def compress(_):
            return compressed.update(updates, state, params, **extra_args)

        return lax.cond(state.count < steps, warm, compress, None)

    return optax.GradientTransformationExtraArgs(compressed.init, update)
