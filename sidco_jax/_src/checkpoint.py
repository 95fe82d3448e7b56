"""Saving and restoring training state with its per-device residuals (orbax).

``flax.jax_utils.unreplicate``-style checkpoints keep device 0 only and drop
every other device's residual: the error feedback those devices owed is lost.
Here the whole global state is saved with orbax (each device writes its own
residual shard) and restored with the shardings of a target.

Restoring onto a different number of devices cannot give each device its own
residual back. The policy keeps what matters, the update still owed: each
device sends its residual eventually and the update is the mean over devices,
so the owed update is the mean of the residuals. Every new device starts from
that mean (so the new mean equals the old), with a :class:`ResidualWarning`.
"""

import os
import warnings
from typing import Any

import jax
import numpy as np

from sidco_jax._src.sharding import is_residual


class ResidualWarning(UserWarning):
    """A restore changed the number of devices and redistributed the residuals."""


def save(path: str | os.PathLike, tree: Any) -> None:
    """Saves a pytree of (sharded) arrays, for example ``{"params": ..., "opt_state": ...}``.

    Every process of a multi-process run must call it with the same path.

    Args:
      path: a directory that does not exist yet.
      tree: the pytree (NamedTuple states included).
    """
    import orbax.checkpoint as ocp  # slow to import: only here

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), tree)


def _abstract(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))


def restore(path: str | os.PathLike, target: Any) -> Any:
    """Restores a checkpoint written by :func:`save` with the shardings of ``target``.

    Args:
      path: the checkpoint directory.
      target: a pytree like the saved one, of arrays or ``jax.ShapeDtypeStruct``
        with shardings (for example :func:`sidco_jax.state_shardings`): the
        devices, and their number, may differ from the saved run.

    Returns:
      The restored pytree, each leaf with the sharding of ``target``. Residuals
      saved on ``d`` devices and restored on ``d' != d`` are redistributed:
      every new device gets the mean of the ``d`` old residuals.

    Raises:
      ValueError: if a residual leaf's saved first axis is not a whole number
        of the target's per-device residuals.
    """
    import orbax.checkpoint as ocp  # slow to import: only here

    path = os.path.abspath(path)
    target = jax.tree.map(_abstract, target)
    marks = is_residual(target)
    with ocp.StandardCheckpointer() as checkpointer:
        # The metadata tree has dicts for NamedTuples and lists for tuples:
        # match leaves by path, not by order.
        saved = checkpointer.metadata(path).item_metadata.tree
        saved_shapes = {
            _names(keys): tuple(leaf.shape)
            for keys, leaf in jax.tree_util.tree_flatten_with_path(saved, is_leaf=_has_shape)[0]
        }

        def request(keys, leaf, mark):
            shape = saved_shapes.get(_names(keys), leaf.shape)
            if mark and shape != leaf.shape:  # read it whole, redistribute below
                return jax.ShapeDtypeStruct(shape, leaf.dtype)
            return leaf

        wanted = jax.tree_util.tree_map_with_path(request, target, marks)
        restored = checkpointer.restore(path, wanted)
    return jax.tree.map(_redistribute, restored, target)


def _has_shape(node) -> bool:
    return hasattr(node, "shape") and hasattr(node, "dtype")


def _names(keys) -> tuple:
    """A key path as plain names and indices (NamedTuple field == dict key)."""
    return tuple(getattr(k, "name", getattr(k, "key", getattr(k, "idx", None))) for k in keys)


def _redistribute(value, target):
    if value.shape == target.shape:
        return value
    per_device = (
        target.sharding.shard_shape(target.shape)[0] if target.sharding else target.shape[0]
    )
    if per_device == 0 or value.shape[0] % per_device:
        raise ValueError(
            f"a residual saved with {value.shape[0]} entries is not a whole number of "
            f"devices' residuals of {per_device} entries: the model changed?"
        )
    old = value.shape[0] // per_device
    new = target.shape[0] // per_device
    warnings.warn(
        f"residuals saved on {old} devices restored on {new}: every device starts from their "
        "mean, which keeps the update still owed",
        ResidualWarning,
        stacklevel=3,
    )
    rest = value.shape[1:]
    mean = np.asarray(value).reshape(old, per_device, *rest).mean(axis=0, dtype=np.float64)
    tiled = np.tile(mean.astype(value.dtype), (new,) + (1,) * len(rest))
    if target.sharding is None:
        return jax.numpy.asarray(tiled)
    return jax.make_array_from_callback(target.shape, target.sharding, lambda i: tiled[i])
