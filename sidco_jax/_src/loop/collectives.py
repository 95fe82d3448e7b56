"""Collectives that work wherever an axis is named: jax.shard_map, jax.pmap or jax.vmap.

Under ``jax.shard_map`` every value carries the mesh axes it varies along,
and an update whose parameters are replicated (``out_specs=P()``) must be
built from values invariant across the axis. ``jax.vmap(f, axis_name=...)``
names an axis that is not a mesh axis: nothing there varies or is invariant,
and the collectives that mark their input varying first fail.
"""

import jax
from jax import lax

from sidco_jax._src.base import AxisName


def all_gather(x, axis_name: AxisName):
    """``lax.all_gather`` of ``x`` over ``axis_name``, invariant across it where that has a meaning.

    Over mesh axes (``jax.shard_map``, ``jax.pmap``) the result is invariant
    (``to="invarying"``). That form first marks its input varying with
    ``pvary``, which exists only over mesh axes: over an axis of ``jax.vmap``
    it failed with a bare ``AssertionError`` (under ``jit``) or "pvary should
    be called under jax.shard_map"; the plain gather is the same gather there.

    Args:
      x: an array or a pytree of arrays.
      axis_name: the axis (or tuple of axes) to gather over.

    Returns:
      ``x`` of every device along ``axis_name``, stacked on a new leading axis.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    manual = jax.sharding.get_abstract_mesh().manual_axes
    return lax.all_gather(x, axis_name, to="invarying" if set(names) <= set(manual) else "varying")
