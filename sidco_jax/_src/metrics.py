"""``metrics``: the compressor's figures, found anywhere in a nested optax state."""

import jax
import optax

from sidco_jax._src.transform import CompressState


def metrics(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """Figures of the last step of the first :func:`compress` state inside ``opt_state``.

    Works through ``optax.chain``, ``named_chain``, ``inject_hyperparams``,
    ``MultiSteps`` and any other pytree of states.

    Args:
      opt_state: an optax state containing a ``CompressState``.

    Returns:
      A dict with ``density`` (fraction of entries sent), ``target_density``,
      ``selected_density`` (fraction above the threshold before the capacity
      cut), ``threshold``, ``stages``, ``overflow`` (entries above the
      threshold that stayed in the residual), ``bytes`` (payload bytes of the
      step's message), ``nonfinite`` and ``step``.

    Raises:
      ValueError: if ``opt_state`` holds no compressor state.

    Examples:
      >>> import jax.numpy as jnp, optax, sidco_jax as sidco
      >>> tx = optax.chain(sidco.compress(0.5), optax.sgd(0.1))
      >>> params = jnp.array([3.0, -0.1, 0.2, -4.0])
      >>> _, state = tx.update(params, tx.init(params), params)
      >>> float(sidco.metrics(state)["density"])
      0.5
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, CompressState))
        if isinstance(s, CompressState)
    ]
    if not found:
        raise ValueError("no sidco_jax compressor state found in opt_state")
    state = found[0]
    out = state.last._asdict()
    out["stages"] = state.stages
    out["step"] = state.count
    return out
