"""``metrics``: the compressor's figures, found anywhere in a nested optax state."""

import jax
import jax.numpy as jnp
import optax

from sidco_jax._src.base import CompressState


def metrics(opt_state: optax.OptState) -> dict[str, jax.Array]:
    """Figures of the last step of the compressor state inside ``opt_state``.

    Works through ``optax.chain``, ``named_chain``, ``inject_hyperparams``,
    ``MultiSteps`` and any other pytree of states.

    Args:
      opt_state: an optax state containing a ``CompressState``.

    Returns:
      A dict with ``density`` (fraction of entries sent), ``target_density``,
      ``selected_density`` (fraction above the threshold before the capacity
      cut), ``threshold``, ``stages``, ``overflow`` (entries above the
      threshold that stayed in the residual), ``bytes`` (payload bytes of the
      step's message), ``nonfinite`` (the step met a non-finite gradient and
      sent nothing), ``dropped`` (non-finite residual entries set to zero) and
      ``step``.

    Raises:
      ValueError: if ``opt_state`` holds no compressor state, or several (pass
        the part of the state that holds the one you mean).

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
    if len(found) > 1:
        raise ValueError(
            f"opt_state holds {len(found)} sidco_jax compressor states; pass the part of it "
            "that holds the one you mean (e.g. opt_state[0] of an optax.chain)"
        )
    (state,) = found
    out = state.last._asdict()
    # Rules with a stage count (SIDCo) report it; the baselines have none.
    out["stages"] = getattr(state.rule, "stages", jnp.zeros((), jnp.int32))
    out["step"] = state.count
    return out
