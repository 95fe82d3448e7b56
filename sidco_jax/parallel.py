"""Placing a compressor's state across devices, and a data-parallel step built on it.

Under ``jax.shard_map`` each device keeps its own error-feedback residual and
the rest of the state is replicated: :func:`state_specs` and
:func:`state_shardings` say so for any optimizer state, :func:`shard_init`
builds it in place, :func:`place` puts parameters and batches on a mesh,
:func:`gather` makes sharded parameters whole for the forward pass, and
:func:`data_parallel_step` wraps a loss into a jitted step for those who do not
write their own (docs/distributed.md).
"""

import warnings

from sidco_jax._src.parallel import (
    data_parallel_step,
    gather,
    is_per_device,
    per_device,
    place,
    shard_init,
    state_shardings,
    state_specs,
)


def is_residual(opt_state):
    """Deprecated: :func:`is_per_device`, its old name (accumulators are per device too)."""
    warnings.warn(
        "sidco.parallel.is_residual is renamed sidco.parallel.is_per_device",
        DeprecationWarning,
        stacklevel=2,
    )
    return is_per_device(opt_state)


__all__ = [
    "data_parallel_step",
    "gather",
    "is_per_device",
    "per_device",
    "place",
    "shard_init",
    "state_shardings",
    "state_specs",
]
