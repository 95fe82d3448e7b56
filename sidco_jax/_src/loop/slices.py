"""The sharded hierarchy: the devices of a node share its compression.

With ``inner_shards=L`` the loop's parts (buckets) are reduce-scattered over
``inner_axis`` instead of averaged whole: each device of a node holds
``1/L`` of the node's mean of every part (its *slice*), runs error feedback,
selection and the sparse mode over ``axis_name`` on that slice only, and
keeps that slice's residual. An ``all_gather`` over ``inner_axis`` then puts
the slices' updates back together, the same on every device. A part is
padded with zeros to a multiple of ``L`` entries; the padding is never part
of the update, and its residual stays zero.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from sidco_jax._src.base import AxisName, check_integer, static
from sidco_jax._src.loop import collectives

PARAMS = "params"  # inner_shards: the gradient arrives sharded as the parameters are


def check(inner_shards, inner_axis, layout: str) -> int | str | None:
    """Validates ``inner_shards`` at construction; returns it (None: not sharded)."""
    if inner_shards is None:
        return None
    if isinstance(inner_shards, str):
        if inner_shards != PARAMS:
            raise TypeError(
                f"inner_shards must be None, a positive int or {PARAMS!r}, got {inner_shards!r}"
            )
        shards = inner_shards
    else:
        shards = check_integer("inner_shards", static("inner_shards", inner_shards), 1, None)
    if inner_axis is None:
        raise ValueError(
            f"inner_shards={shards!r} splits the node's work over inner_axis, but inner_axis is "
            "None: give the fast axis of the node's devices (inner_axis='local')"
        )
    if layout == "tree":
        raise ValueError(
            f"inner_shards={shards!r} keeps each device's residual in flat buckets, which the "
            "tree layout cannot hold: use layout='buckets' or 'auto'"
        )
    return shards


def check_bound(inner_axis: AxisName, shards: int) -> None:
    """Refuses an ``inner_axis`` whose size is not ``shards``, naming both."""
    size = lax.axis_size(inner_axis)
    if size != shards:
        raise ValueError(
            f"inner_shards={shards}, but inner_axis {inner_axis!r} has {size} devices: each "
            "device holds 1/inner_shards of the node's residual, so give the inner axis's size"
        )


def check_size(n: int, shards: int) -> None:
    """Refuses a model with fewer floating-point entries than devices to share it."""
    if n < shards:
        raise ValueError(
            f"the gradient has {n} floating-point entries, fewer than the inner_shards={shards} "
            "devices that would share it: compress it without inner_shards"
        )


def length(size: int, shards: int) -> int:
    """Entries of one device's slice of a part of ``size`` entries."""
    return -(-size // shards)


def scatter(g: Sequence[jax.Array], parts, inner_axis: AxisName, shards: int) -> list:
    """This device's slice of the node's mean of every part: one ``psum_scatter`` per part."""
    out = []
    for x, p in zip(g, parts, strict=True):
        x = jnp.ravel(x).astype(p.dtype)
        x = jnp.pad(x, (0, length(p.size, shards) * shards - p.size))
        out.append(lax.psum_scatter(x, inner_axis, tiled=True) / shards)
    return out


def gather(means: Sequence[jax.Array], parts, inner_axis: AxisName) -> list:
    """Every part's mean from the slices' means: one ``all_gather`` over ``inner_axis``."""
    whole = collectives.all_gather(list(means), inner_axis)
    return [
        jnp.reshape(x, -1)[: p.size].reshape(p.shape) for x, p in zip(whole, parts, strict=True)
    ]


def spans(parts, sizes: Sequence[int], inner_axis: AxisName, shards: int) -> list:
    """Each leaf's ``(start, stop)`` in this device's concatenated slices (traced).

    ``sizes`` are the entries of the parts' leaves, in order. A leaf outside
    this device's slice of its part gets an empty span.
    """
    at, offset, out, leaf = lax.axis_index(inner_axis), 0, [], 0
    for p in parts:
        m, start = length(p.size, shards), 0
        for _ in p.leaves:
            lo, hi = start - at * m, start + sizes[leaf] - at * m
            out.append((offset + jnp.clip(lo, 0, m), offset + jnp.clip(hi, 0, m)))
            start, leaf = start + sizes[leaf], leaf + 1
        offset += m
    return out
