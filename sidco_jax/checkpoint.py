"""Saving and restoring an optimizer state, its per-device residuals included.

:func:`save` writes a checkpoint with a manifest and a checksum per shard;
:func:`restore` reads it into a target state on any mesh, warning where the
residual or the ratio changed (docs/distributed.md). The two functions are
also ``sidco_jax.save`` and ``sidco_jax.restore``.
"""

from sidco_jax._src.checkpoint.saving import RatioWarning, ResidualWarning, restore, save

__all__ = ["RatioWarning", "ResidualWarning", "restore", "save"]
