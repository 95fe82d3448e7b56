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

Every checkpoint carries a manifest (:mod:`sidco_jax._src.checkpoint.manifest`): the
shapes each array was saved with, per device for the residuals, and a checksum
of every shard, so that :func:`restore` refuses a changed model or damaged
data instead of reading them back as other numbers.
"""

import contextlib
import fcntl
import math
import os
import threading
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sidco_jax._src.base import CompressState
from sidco_jax._src.checkpoint import manifest, storage
from sidco_jax._src.loop import layout as layout_lib
from sidco_jax._src.loop import residuals
from sidco_jax._src.parallel import is_per_device


class ResidualWarning(UserWarning):
    """A restore redistributed the residuals, or found non-finite entries in them."""


class RatioWarning(UserWarning):
    """A restore put a compressor state saved at one ratio into a compressor with another."""


def _check_destination(path: str) -> None:
    """Raises before orbax starts if ``path`` cannot become a new checkpoint directory."""
    if os.path.lexists(path):
        raise FileExistsError(
            f"cannot save to {path}: it already exists; save writes a new directory, "
            "give a path that does not exist"
        )
    # Orbax creates missing parents: the nearest existing one must take a new directory.
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"cannot save to {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot save to {path}: {parent} is not writable")


def _is_empty(leaf) -> bool:
    return getattr(leaf, "size", 1) == 0


def save(path: str | os.PathLike, tree: Any) -> None:
    """Saves a pytree of (sharded) arrays, for example ``{"params": ..., "opt_state": ...}``.

    Every process of a multi-process run must call it with the same path. It
    returns once the checkpoint is complete; when it fails, nothing it started
    is left running. With the arrays it writes a manifest of their shapes and
    of a CRC-32 checksum of every shard, which :func:`restore` checks. Needs
    orbax, the ``checkpoint`` extra (``pip install 'sidco_jax[checkpoint]'``).

    Args:
      path: a directory that does not exist yet; missing parents are created.
      tree: the pytree (NamedTuple states included) of JAX or NumPy arrays and
        Python scalars (``bool``, ``int``, ``float``); ``None`` is an empty
        subtree.

    Raises:
      FileExistsError: if ``path`` already exists, or another save to it is
        running (one wins; what restores is what it saved).
      NotADirectoryError: if an existing ancestor of ``path`` is a file.
      PermissionError: if the nearest existing ancestor of ``path`` is not
        writable.
    """
    storage.orbax()  # before anything else: without it, say which extra to install

    path = os.path.abspath(path)
    _check_destination(path)
    # Orbax refuses zero-size arrays (the residual of an integer parameter is one):
    # they hold nothing, and restore rebuilds them from the target.
    tree = jax.tree.map(lambda leaf: None if _is_empty(leaf) else leaf, tree)
    with _claimed(path), storage.checkpointer() as checkpointer:
        _check_destination(path)  # again, now that no other save can start
        try:
            storage.save(checkpointer, path, tree)
        except Exception as error:
            error.add_note(f"sidco_jax.save: saving to {path} failed")
            raise


_SAVING: set[str] = set()  # the paths this process is saving to
_SAVING_LOCK = threading.Lock()
_CLAIM = ".sidco-saving"  # beside the checkpoint, while a save to it runs


@contextlib.contextmanager
def _claimed(path: str):
    """Holds ``path`` for one save: another save to it, from this process (a thread) or
    another job, raises instead of sharing orbax's temporary directory.

    Process 0 of a run holds an exclusive ``flock`` on ``<path>.sidco-saving``
    (every process of a multi-process run saves to the same path). The kernel
    releases it when a process dies, so a save killed mid-way blocks no later one.

    Raises:
      FileExistsError: if a save to ``path`` is running.
    """
    with _SAVING_LOCK:
        if path in _SAVING:
            raise FileExistsError(f"cannot save to {path}: another save to it is running")
        _SAVING.add(path)
    claim = None
    try:
        if jax.process_index() == 0:
            claim = _lock(path)
        yield
    finally:
        if claim is not None:
            os.remove(path + _CLAIM)
            os.close(claim)  # the lock goes with it
        with _SAVING_LOCK:
            _SAVING.discard(path)


def _lock(path: str) -> int:
    """An open descriptor holding the exclusive lock of ``path``'s claim file."""
    parent = os.path.dirname(path)
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:  # a file on the way, as _check_destination says
        raise NotADirectoryError(f"cannot save to {path}: {parent} is not a directory") from None
    claim = os.open(path + _CLAIM, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Locked, but perhaps a file another save removed since we opened it.
        if os.fstat(claim).st_ino != os.stat(path + _CLAIM).st_ino:
            raise BlockingIOError
    except (BlockingIOError, FileNotFoundError):
        os.close(claim)
        raise FileExistsError(f"cannot save to {path}: another process is saving to it") from None
    return claim


def _abstract(leaf):
    """What orbax is asked to read for ``leaf``: its shape, dtype and sharding, or a scalar."""
    if isinstance(leaf, bool | int | float):  # orbax reads Python scalars back as such
        return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=getattr(leaf, "sharding", None))


def _shape_dtype(leaf) -> tuple[tuple, np.dtype]:
    if _has_shape(leaf):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    value = np.asarray(leaf)  # a Python scalar, as save wrote it
    return value.shape, value.dtype


def restore(path: str | os.PathLike, target: Any) -> Any:
    """Restores a checkpoint written by :func:`save` with the shardings of ``target``.

    Args:
      path: the checkpoint directory.
      target: a pytree like the saved one, of arrays, ``jax.ShapeDtypeStruct``
        with shardings (for example :func:`sidco_jax.parallel.state_shardings`) or
        Python scalars: the devices, and their number, may differ from the
        saved run. Each leaf's shape and dtype must be the saved ones, and
        each residual's shape per device (where the target gives its
        sharding). Where a compressor state in ``target`` holds values (for
        example ``tx.init(params)``), its ratio is compared with the saved one;
        an abstract state holds no ratio to compare.

    Returns:
      The restored pytree, each leaf with the sharding of ``target`` (a Python
      scalar as the saved one). Residuals saved on ``d`` devices and restored
      on ``d' != d`` are redistributed: every new device gets the mean of the
      ``d`` old residuals. Compressor states keep the saved values, ratio
      (``last.target_density``) included.

    Raises:
      FileNotFoundError: if ``path`` does not exist.
      NotADirectoryError: if ``path`` is a file.
      ValueError: if ``path`` is empty or not a complete checkpoint (a part or
        a data file missing, truncated or not what :func:`save` writes), if
        an array's checksum differs from the one written at save (damaged
        data), if a leaf's saved dtype or shape differs from the target's, or
        if a residual's saved shape per device differs from the target's (the
        model changed).

    Warns:
      ResidualWarning: when the residuals are redistributed, or hold NaN or
        inf entries (the next update sets them to zero and counts them in
        ``metrics()["dropped"]``).
      RatioWarning: when a compressor state of ``target`` holding values has
        another ratio than the saved one.
    """
    path = os.path.abspath(path)
    storage.check_source(path)
    described, cuts = manifest.read(path), manifest.cuts(path)
    with storage.checkpointer() as checkpointer:
        tree = storage.metadata(checkpointer, path)
        # A residual saved in another layout is read as saved, converted below.
        as_saved = _as_saved(target, tree, cuts)
        flat, treedef = jax.tree_util.tree_flatten_with_path(as_saved)
        abstract = [_abstract(leaf) for _, leaf in flat]
        marks = jax.tree.leaves(is_per_device(as_saved))
        saved, entries = _by_name(tree), [described.get(manifest.key(k)) for k, _ in flat]
        for (keys, _), leaf, sliced, entry in zip(
            flat, abstract, jax.tree.leaves(_in_slices(as_saved)), entries, strict=True
        ):
            if sliced and entry is not None:
                _check_slice(jax.tree_util.keystr(keys), entry, leaf)
        wanted = [
            _request(path, keys, leaf, mark, saved.get(manifest.key(keys)), entry)
            for (keys, _), leaf, mark, entry in zip(flat, abstract, marks, entries, strict=True)
        ]
        # Orbax stores each array in a folder named after its path, joined with dots.
        folders = {".".join(manifest.key(keys)): jax.tree_util.keystr(keys) for keys, _ in flat}
        values = storage.read(checkpointer, path, treedef.unflatten(wanted), folders)
    values = treedef.flatten_up_to(values)
    # Checked as read, before any redistribution; zero-size leaves were not saved.
    checked = zip(entries, values, wanted, strict=True)
    manifest.verify_all(path, [(e, value) for e, value, asked in checked if asked is not None])
    leaves = [
        _zeros(leaf) if asked is None else _redistribute(value, leaf) if mark else value
        for value, leaf, asked, mark in zip(values, abstract, wanted, marks, strict=True)
    ]
    _check_finite(leaves, marks)
    restored = _converted(treedef.unflatten(leaves), target, cuts)
    _check_ratios(restored, target)
    return restored


def _by_name(metadata) -> dict:
    """Orbax's metadata of every saved leaf, by :func:`manifest.key` of its path.

    The metadata tree has dicts for NamedTuples, lists for tuples and str keys
    for int ones: leaves are matched by their paths' names, not by order.
    """
    flat = jax.tree_util.tree_flatten_with_path(metadata, is_leaf=_has_shape)[0]
    return {manifest.key(keys): leaf for keys, leaf in flat}


def _request(path: str, keys, leaf, mark: bool, stored, entry: manifest.Leaf | None):
    """What orbax reads for one target leaf, after checking it against the saved one.

    None for a zero-size leaf (not saved); the saved shape, unsharded, for a
    residual saved on another number of devices (redistributed after).
    """
    if _is_empty(leaf):
        return None
    if stored is None:  # orbax names the missing leaf
        return leaf
    name, (shape, dtype) = jax.tree_util.keystr(keys), _shape_dtype(leaf)
    if entry is None:
        raise manifest.incomplete(path, f"its manifest has no entry for {name}")
    saved_shape, saved_dtype = tuple(stored.shape), np.dtype(stored.dtype or dtype)
    if saved_dtype != dtype:
        # Orbax would cast silently, but a state of another dtype is another model.
        raise ValueError(
            f"{name} was saved as {saved_dtype} and the target asks for {dtype}: give the "
            "target the saved dtypes"
        )
    if mark:
        _check_residual(name, saved_shape, entry.device_shape, leaf)
    elif saved_shape != shape:  # orbax would fail naming neither the leaf nor the model
        raise ValueError(
            f"{name} was saved with shape {saved_shape} and the target's is {shape}: the "
            "model changed; give the target the saved shapes"
        )
    if saved_shape != shape:  # read it whole, redistribute after
        return jax.ShapeDtypeStruct(saved_shape, dtype)
    return leaf


def _check_residual(name: str, saved_shape: tuple, saved_device: tuple | None, target) -> None:
    """Raises where a residual leaf was saved for another model leaf than ``target``'s.

    A device's residual has its model leaf's shape, so another number of
    devices changes only the global first axis. Where the target gives no
    sharding (a layout being converted, an abstract leaf) only the other axes
    are compared.
    """
    sharding = getattr(target, "sharding", None)
    device = None if sharding is None else tuple(sharding.shard_shape(target.shape))
    if saved_shape[1:] == tuple(target.shape[1:]) and (
        None in (device, saved_device) or device == saved_device
    ):
        return
    saved = f"{saved_shape}" + (f", {saved_device} per device" if saved_device else "")
    wanted = f"{tuple(target.shape)}" + (f", {device} per device" if device else "")
    raise ValueError(
        f"{name} is a per-device residual saved as {saved} and the target's is {wanted}: a "
        "device's residual is shaped like its model leaf, so the model changed; restore it "
        "into the model it was saved with"
    )


def _in_slices(tree) -> Any:
    """A tree like ``tree`` with True at every leaf of a residual kept per device of a node
    (``inner_shards``: the sharded hierarchy's slices, sharded parameters' shards)."""

    def mark(node):
        marks = jax.tree.map(lambda _: False, node)
        if _is_state(node) and residuals.form_of(node.residual).per_node_device:
            marks = marks._replace(residual=jax.tree.map(lambda _: True, node.residual))
        return marks

    return jax.tree.map(mark, tree, is_leaf=_is_state)


def _check_slice(name: str, entry: manifest.Leaf, target) -> None:
    """Refuses a residual slice saved for another node size, or on another number of devices.

    Each device held ``1/inner_shards`` of its node's residual: on a node of
    another size the slices cut the buckets elsewhere, and the mean that
    redistributes residuals over a new number of devices would mix slices.
    """
    sharding = getattr(target, "sharding", None)
    device = tuple(sharding.shard_shape(target.shape)) if sharding else None
    if entry.device_shape and device and entry.device_shape != device:
        raise ValueError(
            f"{name} is a slice of a node's residual saved with {entry.device_shape[0]} entries "
            f"per device and the target's slices have {device[0]}: inner_shards (the devices "
            "of a node sharing its compression) differs from the saved run's; restore onto "
            "nodes of the saved size"
        )
    if tuple(entry.shape) != tuple(target.shape):
        raise ValueError(
            f"{name} is a slice of a node's residual saved for {entry.shape[0]} entries over "
            f"all devices and the target's is for {target.shape[0]}: a residual sharded over "
            "a node's devices (inner_shards) restores only onto the saved number of devices"
        )


def _subtree(tree, names: tuple):
    """The node of a metadata tree (dicts and lists) at ``names`` (of ``manifest.key``), or None."""
    for name in names:
        try:
            tree = tree[int(name)] if isinstance(tree, list) else tree[name]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return tree


def _leaf_names(tree, is_leaf=None) -> set:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {manifest.key(keys) for keys, leaf in flat if not _is_empty(leaf)}


def _as_saved(target, saved, cuts: dict):
    """``target``, where a compressor state's residual was saved in another layout, as saved.

    The manifest records what each residual was cut from (:class:`residuals.Cut`):
    one saved for the target's leaves but in another layout (a tree saved and
    buckets asked for, or the other way round, or buckets of another size) is
    read in its saved form, unsharded, and converted by :func:`_converted`; one
    saved for other leaves is refused, naming the first that changed.
    """

    def as_saved(keys, node):
        if not _is_state(node) or node.residual is None:
            return node
        name = f"{jax.tree_util.keystr(keys)}.residual"
        form, stored = (
            residuals.form_of(node.residual),
            _subtree(saved, (*manifest.key(keys), "residual")),
        )
        if manifest.key(keys) not in cuts:  # a sidco_jax that recorded no cut: as saved
            if stored is None or _leaf_names(stored, _has_shape) == _leaf_names(node.residual):
                return node  # the same layout (orbax names anything missing)
            raise ValueError(
                f"{name} was saved in another layout than the target's by a sidco_jax that did "
                "not record what it was cut from: restore it into the layout it was saved in"
            )
        held, cut = cuts[manifest.key(keys)]
        if held is form is residuals.TREE:
            return node  # each leaf is checked as read (_request)
        if held is not form and (held.per_node_device or form.per_node_device):
            raise ValueError(
                f"{name} was saved in the {held.name!r} layout and the target's is "
                f"{form.name!r}: a residual kept per device of a node (inner_shards) "
                "converts to no other layout"
            )
        want = form.cut(node.residual)
        cut = _per_device(cut, want) if held is residuals.TREE else cut
        moved = cut.moved(want)
        if moved is not None and form is residuals.SHARDS:
            raise ValueError(
                f"{name} was saved for other shards of the parameters than the target's "
                f"({moved}): a device's residual follows its shards, so restore onto nodes of "
                "the saved size with the parameters sharded as saved"
            )
        if moved is not None:
            raise ValueError(
                f"{name} was saved for another model than the target's ({moved}): restore it "
                "into the model it was saved with"
            )
        if held is form and cut == want:
            return node
        if form.per_node_device:  # held is form
            raise ValueError(
                f"{name} was saved as {form.name} of other buckets than the target's "
                f"({cut.difference(want)}): a residual kept per device of a node "
                "(inner_shards) restores only into buckets cut as saved (the same bucket_bytes "
                "and inner_shards)"
            )
        shape = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)),
            stored,
            is_leaf=_has_shape,
        )
        return node._replace(residual=shape)

    return jax.tree_util.tree_map_with_path(as_saved, target, is_leaf=_is_state)


def _per_device(cut: residuals.Cut, want: residuals.Cut) -> residuals.Cut:
    """A tree's ``cut`` saved from host arrays (each leaf's devices stacked), per device.

    Host arrays say nothing of devices: where the saved leaves hold a whole
    number of copies of the target's, that number is taken as the devices'.
    """
    total = lambda c: sum(math.prod(shape) for shape in c.shapes)  # noqa: E731
    copies, left = divmod(total(cut), max(total(want), 1))
    if copies <= 1 or left or any(shape[0] % copies for shape in cut.shapes):
        return cut
    return cut._replace(shapes=tuple((s[0] // copies, *s[1:]) for s in cut.shapes))


def _converted(restored, target, cuts: dict):
    """``restored`` with every residual read in another layout converted to ``target``'s."""
    flat = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_state)[0]
    structure = jax.tree.structure(target, is_leaf=_is_state)
    nodes = structure.flatten_up_to(restored)
    for i, (have, (keys, want)) in enumerate(zip(nodes, flat, strict=True)):
        moved = _is_state(want) and want.residual is not None
        if moved and jax.tree.structure(have.residual) != jax.tree.structure(want.residual):
            held, cut = cuts[manifest.key(keys)]
            residual = _relayout(have.residual, held, cut, want.residual)
            nodes[i] = have._replace(residual=residual)
    return structure.unflatten(nodes)


def _relayout(saved, held: residuals.Form, cut: residuals.Cut, target):
    """A residual read in the form ``held`` (cut as ``cut``), cut into ``target``'s.

    The saved arrays are taken in the order the cut records, by name (orbax
    returns dicts, ordered by key). Saved on ``d`` devices and restored on
    another number, every device then starts from their mean, as
    :func:`_redistribute` does.
    """
    by_name = {manifest.key(k): x for k, x in jax.tree_util.tree_flatten_with_path(saved)[0]}
    have = [np.asarray(by_name[name]) for name in held.arrays(cut)]
    want, treedef = jax.tree.flatten(target)
    want = [_abstract(t) for t in want]
    shapes = [t.sharding.shard_shape(t.shape) if t.sharding else t.shape for t in want]
    per_device = sum(math.prod(shape) for shape in shapes)
    cut_up = layout_lib.regroup(have, shapes, sum(x.size for x in have) // max(per_device, 1))
    leaves = [
        _zeros(t) if t.size == 0 else _place(_redistribute(x.astype(t.dtype), t), t)
        for x, t in zip(cut_up, want, strict=True)
    ]
    return treedef.unflatten(leaves)


def _place(value, target):
    """``value`` on ``target``'s sharding (already there if it is an array)."""
    if isinstance(value, jax.Array):
        return value
    if target.sharding is None:
        return jnp.asarray(value)
    return jax.make_array_from_callback(target.shape, target.sharding, lambda i: value[i])


@jax.jit
def _count_nonfinite(x):
    return jnp.sum(~jnp.isfinite(x))


def _check_finite(leaves, marks) -> None:
    """Warns where restored residuals hold NaN or inf: the next update drops those entries.

    Said here, on the host, because the update only counts them
    (``metrics()["dropped"]``): a warning from the device would cost every step.
    """
    bad = sum(
        int(_count_nonfinite(leaf))
        for leaf, mark in zip(leaves, marks, strict=True)
        if mark and leaf.size and jnp.issubdtype(leaf.dtype, jnp.inexact)
    )
    if bad:
        warnings.warn(
            f"the restored residuals hold {bad} non-finite entries: the next update sets them "
            "to zero and counts them in metrics()['dropped']; the rest of the residual and "
            "that step's gradient are kept",
            ResidualWarning,
            stacklevel=3,
        )


def _zeros(leaf):
    """A zero-size array like ``leaf``, on its sharding."""
    if leaf.sharding is None:
        return jnp.zeros(leaf.shape, leaf.dtype)
    return jax.make_array_from_callback(
        leaf.shape, leaf.sharding, lambda index: np.zeros(leaf.shape, leaf.dtype)[index]
    )


def _check_ratios(restored, target) -> None:
    """Warns where a compressor state of ``target`` holding values has another ratio."""
    flat = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_state)[0]
    got = jax.tree.leaves(restored, is_leaf=_is_state)
    for (keys, want), have in zip(flat, got, strict=True):
        if not _is_state(want) or isinstance(want.last.target_density, jax.ShapeDtypeStruct):
            continue
        old, new = float(have.last.target_density), float(want.last.target_density)
        if old != new:
            warnings.warn(
                f"the compressor state at {jax.tree_util.keystr(keys)} was saved with ratio "
                f"{old:.6g} and is restored into a compressor with ratio {new:.6g}: it sends "
                "the new ratio from now on, and its rule state (SIDCo's stage count), tuned "
                "for the saved ratio, re-adapts",
                RatioWarning,
                stacklevel=3,
            )


def _is_state(node) -> bool:
    return isinstance(node, CompressState)


def _has_shape(node) -> bool:
    return hasattr(node, "shape") and hasattr(node, "dtype")


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
        return jnp.asarray(tiled)
    return jax.make_array_from_callback(target.shape, target.sharding, lambda i: tiled[i])
