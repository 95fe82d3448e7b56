"""The loop's working arrays: the gradient's leaves as they are, or packed into buckets.

The loop works on *parts*, arrays whose concatenation, raveled and in order,
is every floating-point entry of the model in ``jax.tree.leaves`` order. Every
layout keeps that order, so a payload index names the same entry in all of
them, and a residual converts from one to another by concatenation.

* ``"tree"`` (XLA:CPU): a leaf of at least :data:`SMALL` entries is a part of
  its own, in its own shape; runs of smaller leaves are packed into flat parts.
  The residual is stored as a tree like the parameters. XLA:CPU's
  multi-threaded ``concatenate`` of large leaves costs more than the rest of
  the update, while per-leaf work on many tiny leaves grows the compiled
  program (and its compile time) with the leaf count.
* ``"buckets"`` (GPU, TPU): consecutive leaves are packed into flat buckets of
  at most ``bucket_bytes`` of residual each (a larger leaf is a bucket of its
  own), one dtype per bucket, and the residual is stored as those buckets
  (:mod:`residuals`). A step packs the gradient once and unpacks the update
  with slices, so the kernels it launches do not grow with the leaf count.
* ``"auto"``: the tree for CPU devices and buckets for others, decided at
  ``init`` from the devices of the parameters or the mesh it runs under
  (:func:`platform_of`), not from the default backend.

With ``granularity="leaf"`` every leaf is a part of its own in both layouts:
each is selected on its own anyway.
"""

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np

from sidco_jax._src.base import check_choice, check_integer, platform_of, static

Layout = Literal["auto", "tree", "buckets"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's default bucket_cap_mb
# Leaves below this many entries are packed together in the tree layout.
SMALL = 2**16


class Part(NamedTuple):
    """One working array: consecutive floating-point leaves, packed if several.

    Attributes:
      leaves: positions of its leaves among the floating-point leaves.
      shape: a lone leaf's own shape (at least 1-D) in the tree layout, else flat.
      dtype: the residual's dtype (float32, or the leaf's where wider).
    """

    leaves: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def check_layout(layout, bucket_bytes) -> int:
    """Validates ``layout`` and ``bucket_bytes`` at construction; returns ``bucket_bytes``.

    None means :data:`BUCKET_BYTES` (a default that ``optax.inject_hyperparams``
    leaves static); a given size sets shapes, so it must be static.
    """
    check_choice("layout", layout, LAYOUTS)
    if bucket_bytes is None:
        return BUCKET_BYTES
    return check_integer("bucket_bytes", static("bucket_bytes", bucket_bytes), 1, None)


def resolve(layout: str, arrays) -> str:
    """``"tree"`` or ``"buckets"``: ``"auto"`` is the tree where ``arrays`` are for the CPU."""
    if layout != "auto":
        return layout
    return "tree" if platform_of(arrays) == "cpu" else "buckets"


def residual_dtype(leaf) -> np.dtype:
    """float32, or the leaf's own dtype where it is wider (float64 under x64)."""
    dtype = getattr(leaf, "dtype", None)  # arrays and shape structs have one
    dtype = jnp.asarray(leaf).dtype if dtype is None else dtype
    dtype = dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def plan(floats: Sequence, layout: str, bucket_bytes: int, by_leaf: bool) -> tuple[Part, ...]:
    """The parts of the floating-point leaves ``floats`` (arrays or shape-dtype structs).

    Zero-size leaves take no part. ``layout`` is ``"tree"`` or ``"buckets"``.
    """
    parts, run, filled = [], [], 0  # the run of leaves being packed, and its entries

    def alone(i, dtype):
        shape = tuple(np.shape(floats[i])) if layout == "tree" else (np.size(floats[i]),)
        return Part((i,), shape or (1,), dtype)

    def flush(dtype):
        if len(run) == 1 and layout == "tree":
            parts.append(alone(run[0], dtype))
        elif run:
            parts.append(Part(tuple(run), (filled,), dtype))
        run.clear()
        return 0

    run_dtype = None
    for i, leaf in enumerate(floats):
        size, dtype = math.prod(np.shape(leaf)), residual_dtype(leaf)
        limit = max(bucket_bytes // dtype.itemsize, 1)
        if size == 0:
            continue
        if by_leaf or size >= limit or (layout == "tree" and size >= SMALL):
            filled = flush(run_dtype)
            parts.append(alone(i, dtype))
            continue
        if run and (run_dtype != dtype or filled + size > limit):
            filled = flush(run_dtype)
        run.append(i)
        run_dtype, filled = dtype, filled + size
    flush(run_dtype)
    return tuple(parts)


def pack(parts: Sequence[Part], leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """One array per part from per-leaf arrays: a lone leaf reshaped, several concatenated.

    A lone leaf keeps its dtype (the loop casts it where it adds the
    residual); packed leaves are cast to the part's dtype.
    """
    out = []
    for p in parts:
        if len(p.leaves) == 1:
            out.append(jnp.reshape(leaves[p.leaves[0]], p.shape))
        else:
            out.append(jnp.concatenate([jnp.ravel(leaves[i]).astype(p.dtype) for i in p.leaves]))
    return out


def unpack(parts: Sequence[Part], arrays: Sequence[jax.Array], like: Sequence) -> dict:
    """``{leaf position: array}`` cut from the parts' ``arrays``, shaped and typed as ``like``."""
    out = {}
    for p, x in zip(parts, arrays, strict=True):
        x, start = jnp.ravel(x) if len(p.leaves) > 1 else x, 0
        for i in p.leaves:
            size = math.prod(np.shape(like[i]))
            piece = x[start : start + size] if len(p.leaves) > 1 else x
            out[i] = jnp.reshape(piece, np.shape(like[i])).astype(like[i].dtype)
            start += size
    return out


def regroup(arrays: Sequence, shapes: Sequence[tuple[int, ...]], copies: int) -> list[np.ndarray]:
    """Cuts residual ``arrays`` anew into ``shapes``, on the host.

    ``arrays`` hold, in order, the residual of ``copies`` devices, each array
    stacking their pieces along its first axis (as global arrays do); the
    result does the same with pieces of the per-device ``shapes``. Both
    layouts order the entries alike, so this converts one to the other.
    """
    rows = [np.asarray(a).reshape(copies, -1) for a in arrays if np.size(a)]
    rows = np.concatenate(rows, axis=1) if rows else np.zeros((copies, 0), np.float32)
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        piece = rows[:, start : start + size]
        out.append(piece.reshape((copies * shape[0], *shape[1:])) if shape else piece)
        start += size
    return out
