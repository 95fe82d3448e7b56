"""An update called outside any trace runs as one program, compiled once.

Called eagerly (a Python loop of ``tx.update``, as in a notebook), JAX runs
each operation on its own and compiles every ``lax.cond`` and ``lax.scan``
anew on each call: the loop's many small programs cost about a second a step,
and their code is mapped into the process each time until it runs out of
memory mappings. :func:`compiled_when_eager` routes such calls through one
``jax.jit`` of the update, compiled on the first step and reused; inside a
trace (``jit``, ``shard_map``, ``pmap``, ``vmap``, ``grad``) the update runs
as written, inlined in the caller's program.
"""

import jax
import numpy as np
import optax


def is_eager(*trees) -> bool:
    """Whether every leaf is a concrete array or Python number (no tracer, nothing else)."""
    leaves = jax.tree.leaves(trees)
    return all(
        isinstance(x, jax.Array | np.ndarray | np.generic | int | float | complex)
        and not isinstance(x, jax.core.Tracer)
        for x in leaves
    )


def compiled_when_eager(
    tx: optax.GradientTransformationExtraArgs,
) -> optax.GradientTransformationExtraArgs:
    """``tx`` whose ``update``, called outside any trace, runs one cached ``jax.jit``.

    Under a trace, or with an argument that is not an array (an extra
    argument that is a function, say), the update runs as written.
    """
    compiled = jax.jit(tx.update)

    def update(updates, state, params=None, **extra_args):
        run = compiled if is_eager(updates, state, params, extra_args) else tx.update
        return run(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(tx.init, update)
