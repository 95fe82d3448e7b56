"""Where the residual lives between steps: three forms behind one protocol.

The loop works on *parts* (:mod:`layout`); between steps the error-feedback
residual is stored in one of three forms, chosen once at ``init``:

* ``"tree"``: a tree like the parameters (``layout="tree"``);
* ``"buckets"``: :class:`Buckets`, one flat vector per bucket (``layout="buckets"``);
* ``"slices"``: :class:`Slices`, this device's slice of each bucket (``inner_shards``);
* ``"shards"``: :class:`Shards`, buckets of this device's shard of the parameters
  (``inner_shards="params"``).

Each form is a :class:`Form`: it makes the zero residual, hands the loop the
residual's parts, stores the new ones, checks a gradient against what
``init`` saw, and says what the residual was cut from (a :class:`Cut`, which
checkpoints record and convert from). The loop and the checkpoint code call
the form; :func:`form_of` is the one place that asks which form a residual is.

Buckets and slices carry their :class:`Cut` as static pytree metadata: the
check needs no leaf of the tree ``init`` saw, and ``jax.jit`` retraces for a
state cut from another model rather than adding its residual to the wrong
entries.
"""

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidco_jax._src.base import is_float
from sidco_jax._src.loop import layout as layout_lib
from sidco_jax._src.loop.slices import PARAMS, length


def names(keys) -> tuple[str, ...]:
    """A key path as names, the same in a tree and in orbax's metadata of it.

    Orbax turns NamedTuples into dicts, tuples into lists and int dict keys
    (Flax NNX's layer indices) into str ones: every name is a str.
    """
    return tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", None)))) for k in keys)


class Cut(NamedTuple):
    """What a residual was cut from: the model's leaves and the arrays that hold them.

    Attributes:
      paths: each floating-point leaf's path (:func:`names`), in
        ``jax.tree.leaves`` order; leaves without entries are left out.
      shapes: each leaf's shape (a scalar as ``(1,)``).
      dtypes: each leaf's residual dtype, by name.
      parts: the leaves (positions in ``paths``) each stored array holds, in order.
      shards: the devices sharing each array (``inner_shards``; 1 otherwise).
    """

    paths: tuple[tuple[str, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    parts: tuple[tuple[int, ...], ...]
    shards: int = 1

    def leaves(self) -> list[tuple]:
        return list(zip(self.paths, self.shapes, self.dtypes, strict=True))

    def moved(self, other: "Cut") -> str | None:
        """Which leaf ``other`` (a gradient's, a target's) changes, or None: another model."""
        for (path, *mine), (there, *theirs) in zip(self.leaves(), other.leaves(), strict=False):
            if path != there:
                return f"leaf {_name(there)} stands where {_name(path)} was"
            if mine != theirs:
                return f"leaf {_name(path)} is {_leaf(*theirs)}, not {_leaf(*mine)}"
        mine, theirs = len(self.paths), len(other.paths)
        if theirs > mine:
            return f"leaf {_name(other.paths[mine])} is new"
        return f"leaf {_name(self.paths[theirs])} is missing" if theirs < mine else None

    def difference(self, other: "Cut") -> str | None:
        """What ``other`` changes: a leaf (:meth:`moved`), the sharing or the buckets; or None."""
        if moved := self.moved(other):
            return moved
        if self.shards != other.shards:
            return f"its buckets are shared by {other.shards} devices, not {self.shards}"
        if self.parts != other.parts:
            return "the leaves are grouped into other buckets (another bucket_bytes)"
        return None

    def to_json(self) -> dict:
        """The cut as JSON (a checkpoint's manifest records it)."""
        return {
            "paths": [list(p) for p in self.paths],
            "shapes": [list(s) for s in self.shapes],
            "dtypes": list(self.dtypes),
            "parts": [list(p) for p in self.parts],
            "shards": self.shards,
        }


def device_shape(x) -> tuple[int, ...]:
    """The shape of one device's piece of ``x`` (an array or a shape struct), where sharded."""
    sharding = getattr(x, "sharding", None)
    return tuple(sharding.shard_shape(x.shape) if sharding is not None else np.shape(x))


def _name(path) -> str:
    return "/".join(path) or "(root)"


def _leaf(shape, dtype) -> str:
    return f"{tuple(shape)} {dtype}"


def cut(tree, parts: Sequence[layout_lib.Part], shards: int = 1) -> Cut:
    """The :class:`Cut` of ``tree``'s floating-point leaves, grouped as ``parts`` (of them all)."""
    floats = [(k, x) for k, x in jax.tree_util.tree_flatten_with_path(tree)[0] if is_float(x)]
    kept = [i for i, (_, x) in enumerate(floats) if math.prod(np.shape(x))]
    at = {i: j for j, i in enumerate(kept)}  # a part holds no leaf without entries
    return Cut(
        paths=tuple(names(floats[i][0]) for i in kept),
        shapes=tuple(tuple(np.shape(floats[i][1])) or (1,) for i in kept),
        dtypes=tuple(layout_lib.residual_dtype(floats[i][1]).name for i in kept),
        parts=tuple(tuple(at[i] for i in p.leaves) for p in parts),
        shards=shards,
    )


@functools.partial(jax.tree_util.register_dataclass, data_fields=["buckets"], meta_fields=["cut"])
@dataclasses.dataclass(frozen=True)
class Buckets:
    """A residual stored in the bucketed layout.

    Attributes:
      buckets: one flat float32 (or wider) vector per bucket; the leaves'
        entries in ``jax.tree.leaves`` order, packed.
      cut: what the buckets were cut from (static).
    """

    buckets: tuple[jax.Array, ...]
    cut: Cut


@functools.partial(jax.tree_util.register_dataclass, data_fields=["slices"], meta_fields=["cut"])
@dataclasses.dataclass(frozen=True)
class Slices:
    """A residual of the sharded hierarchy: this device's slice of each bucket.

    Attributes:
      slices: one flat float32 (or wider) vector per bucket, its
        ``ceil(size / inner_shards)`` entries at this device's position along
        ``inner_axis`` (zero-padded at the end of the last device's).
      cut: what the buckets were cut from, and ``inner_shards`` (static).
    """

    slices: tuple[jax.Array, ...]
    cut: Cut


@functools.partial(jax.tree_util.register_dataclass, data_fields=["shards"], meta_fields=["cut"])
@dataclasses.dataclass(frozen=True)
class Shards:
    """A residual of parameters sharded over a node's devices (``inner_shards="params"``).

    Attributes:
      shards: one flat float32 (or wider) vector per bucket of this device's
        shard of the parameters (its leaves as the device holds them).
      cut: what the buckets were cut from: the shards' leaves (static).
    """

    shards: tuple[jax.Array, ...]
    cut: Cut


class Form:
    """How one form stores the residual: what the loop and the checkpoints call.

    Attributes:
      name: ``"tree"``, ``"buckets"``, ``"slices"`` or ``"shards"``.
      layout: the loop's layout of the parts (:func:`layout.plan`).
      per_node_device: each device of a node holds other entries (``inner_shards``):
        the residual splits over the node's axis too, and restores only as saved.
    """

    name: str
    layout: str
    per_node_device: bool = False

    def empty(self, params, parts: Sequence[layout_lib.Part], shards: int):
        """The zero residual for ``params``, cut into ``parts``."""
        raise NotImplementedError

    def parts(self, residual, parts, floats: Sequence[int]) -> list[jax.Array]:
        """The residual as the loop's ``parts`` (``floats``: the float leaves' positions)."""
        raise NotImplementedError

    def store(self, residual, parts, left: Sequence[jax.Array], floats: Sequence[int]):
        """A residual like ``residual`` holding the parts ``left``."""
        raise NotImplementedError

    def check(self, residual, updates, parts) -> None:
        """Raises where ``updates`` is not the tree the residual was made for."""
        raise NotImplementedError

    def cut(self, residual) -> Cut:
        """What ``residual`` (arrays or shape structs) was cut from."""
        raise NotImplementedError

    def arrays(self, cut: Cut) -> list[tuple[str, ...]]:
        """The names (:func:`names`, under the residual) of the stored arrays, in order."""
        raise NotImplementedError


def _mismatch(difference: str) -> ValueError:
    return ValueError(
        f"the gradient is not the tree init saw: {difference}; the residual would be added to "
        "the wrong entries (call init with parameters like the gradients)"
    )


def _tree_shape(leaf) -> tuple[int, ...]:
    """A leaf's residual in the tree layout: its shape (a scalar's as ``(1,)``), or ``(0,)``
    for a leaf that is not floating point."""
    return (jnp.shape(leaf) or (1,)) if is_float(leaf) else (0,)


class _Tree(Form):
    name, layout = "tree", "tree"

    def empty(self, params, parts, shards):
        def zero(leaf):
            return jnp.zeros(_tree_shape(leaf), layout_lib.residual_dtype(leaf))

        return jax.tree.map(zero, params)

    def parts(self, residual, parts, floats):
        leaves = jax.tree.leaves(residual)
        return layout_lib.pack(parts, [leaves[i] for i in floats])

    def store(self, residual, parts, left, floats):
        leaves, treedef = jax.tree.flatten(residual)
        for j, x in layout_lib.unpack(parts, left, [leaves[i] for i in floats]).items():
            leaves[floats[j]] = x
        return jax.tree.unflatten(treedef, leaves)

    def check(self, residual, updates, parts):
        want, got = jax.tree.structure(residual), jax.tree.structure(updates)
        if want != got:
            raise ValueError(
                f"the gradient's tree structure {got} does not match the one given to init {want}"
            )
        paths = jax.tree_util.tree_flatten_with_path(updates)[0]
        for (path, leaf), r in zip(paths, jax.tree.leaves(residual), strict=True):
            if _tree_shape(leaf) != r.shape:
                seen = f"a leaf of shape {r.shape}" if r.size else "a non-floating-point leaf"
                raise ValueError(
                    f"gradient leaf {jax.tree_util.keystr(path)} has shape {jnp.shape(leaf)} and "
                    f"dtype {jnp.asarray(leaf).dtype}, but init saw {seen} there: the residual "
                    "would be added to the wrong entries (call init with parameters like the "
                    "gradients)"
                )

    def cut(self, residual):
        flat = jax.tree_util.tree_flatten_with_path(residual)[0]
        kept = [(k, x) for k, x in flat if math.prod(np.shape(x))]
        return Cut(
            paths=tuple(names(k) for k, _ in kept),
            shapes=tuple(device_shape(x) for _, x in kept),
            dtypes=tuple(np.dtype(x.dtype).name for _, x in kept),
            parts=tuple((j,) for j in range(len(kept))),
        )

    def arrays(self, cut):
        return list(cut.paths)


class _Flat(Form):
    """Buckets and slices: flat arrays, one per part, with their cut."""

    kind: type
    layout = "buckets"

    def empty(self, params, parts, shards):
        zeros = tuple(jnp.zeros((length(p.size, shards),), p.dtype) for p in parts)
        return self.kind(zeros, cut(params, parts, shards))

    def parts(self, residual, parts, floats):
        return list(self._arrays(residual))

    def store(self, residual, parts, left, floats):
        return self.kind(tuple(left), residual.cut)

    def check(self, residual, updates, parts):
        difference = residual.cut.difference(cut(updates, parts, residual.cut.shards))
        if difference is not None:
            raise _mismatch(difference)

    def cut(self, residual):
        return residual.cut

    def arrays(self, cut):
        return [(self.name, str(i)) for i in range(len(cut.parts))]

    def _arrays(self, residual):
        return getattr(residual, self.name)


class _Buckets(_Flat):
    name, kind = "buckets", Buckets


class _Slices(_Flat):
    name, kind, per_node_device = "slices", Slices, True


class _Shards(_Flat):
    name, kind, per_node_device = "shards", Shards, True

    def empty(self, params, parts, shards):  # each device's leaves are its own shards
        return super().empty(params, parts, 1)


TREE, BUCKETS, SLICES, SHARDS = _Tree(), _Buckets(), _Slices(), _Shards()
FORMS = {form.name: form for form in (TREE, BUCKETS, SLICES, SHARDS)}


def choose(layout: str, shards: int | str | None) -> Form:
    """The form for a resolved ``layout`` (``"tree"``, ``"buckets"``) and ``inner_shards``."""
    if shards is not None:
        return SHARDS if shards == PARAMS else SLICES
    return TREE if layout == "tree" else BUCKETS


def form_of(residual) -> Form:
    """The form ``residual`` is stored in."""
    kinds = {Slices: SLICES, Shards: SHARDS, Buckets: BUCKETS}
    return kinds.get(type(residual), TREE)


def convert(residual, params, layout: str, bucket_bytes: int = layout_lib.BUCKET_BYTES) -> Any:
    """A single device's ``residual`` (tree or buckets) in ``layout``, for ``params``.

    Args:
      residual: a residual tree like ``params`` or :class:`Buckets`.
      params: the parameters (or their shapes and dtypes) it was made for.
      layout: ``"tree"`` or ``"buckets"``.
      bucket_bytes: the bucket size of the bucketed layout.
    """
    floats = [leaf for leaf in jax.tree.leaves(params) if is_float(leaf)]
    form = choose(layout, None)
    parts = layout_lib.plan(floats, form.layout, bucket_bytes, by_leaf=False)
    target = form.empty(params, parts, 1)
    have = form_of(residual).cut(residual)
    moved = have.moved(form.cut(target))
    if moved is not None:
        raise ValueError(f"the residual was not made for these parameters: {moved}")
    leaves, treedef = jax.tree.flatten(target)
    stored = [x for x in jax.tree.leaves(residual) if np.size(x)]
    shapes = [x.shape for x in leaves]
    cut_up = layout_lib.regroup(stored, shapes, 1)
    return jax.tree.unflatten(
        treedef, [jnp.asarray(x, t.dtype) for x, t in zip(cut_up, leaves, strict=True)]
    )
