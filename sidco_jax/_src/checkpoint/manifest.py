"""The manifest of a checkpoint: every array's shape, dtype and checksums, checked at restore.

Orbax and tensorstore read a flipped byte of a compressed chunk back as other
values without a word, and a checkpoint says nothing of the per-device shapes
its residuals were saved with. So :func:`write` puts a manifest next to the
arrays, inside orbax's temporary directory, before orbax renames it: a save
that did not finish leaves no manifest behind, and a checkpoint is complete
only with its manifest.

Each process writes ``sidco_manifest/process_<i>.json``: every leaf's path,
global shape, dtype and per-device shape, and the CRC-32 of each array shard
it holds (replica 0 only, so every element is checked once). Plain JSON: it is
read with :func:`json.loads` and checked field by field, never unpickled.
"""

import json
import math
import os
import zlib
from typing import NamedTuple

import jax
import numpy as np

from sidco_jax._src.base import CompressState
from sidco_jax._src.loop import residuals
from sidco_jax._src.loop.residuals import names as key

DIRECTORY = "sidco_manifest"
FORMAT = 1
CHECKSUM = "crc32"  # fast on one core (docs/design.md); misses random damage at 2^-32


class Leaf(NamedTuple):
    """What the manifest says of one saved array.

    Attributes:
      name: the leaf's path, as ``jax.tree_util.keystr`` wrote it at save.
      shape: the global shape.
      dtype: the dtype's name.
      device_shape: the shape one device held (None for a host array).
      shards: the CRC-32 of each shard, keyed by its region: one ``(start,
        stop)`` pair per axis.
    """

    name: str
    shape: tuple
    dtype: str
    device_shape: tuple | None
    shards: dict


def incomplete(path: str, reason: str) -> ValueError:
    """The error for a directory that is not a whole checkpoint of ``sidco_jax.save``."""
    return ValueError(f"{path} is not a complete checkpoint written by sidco_jax.save: {reason}")


def _region(index, shape) -> tuple:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _checksum(array) -> int:
    # A view of the bytes, whatever the dtype (bfloat16 has no buffer format of its own).
    return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _describe(keys, leaf) -> dict:
    """One leaf's entry: shapes, dtype and the checksums of the shards this process wrote."""
    entry = {"path": list(key(keys)), "name": jax.tree_util.keystr(keys)}
    if isinstance(leaf, jax.Array):
        entry |= {"shape": list(leaf.shape), "dtype": str(leaf.dtype)}
        entry["device_shape"] = list(leaf.sharding.shard_shape(leaf.shape))
        shards = [s for s in leaf.addressable_shards if s.replica_id == 0]
        pieces = [(_region(s.index, leaf.shape), s.data) for s in shards]
    else:  # NumPy arrays and Python scalars: the same in every process, written once
        host = np.asarray(leaf)
        entry |= {"shape": list(host.shape), "dtype": str(host.dtype), "device_shape": None}
        whole = tuple((0, n) for n in host.shape)
        pieces = [(whole, host)] if jax.process_index() == 0 else []
    entry["shards"] = [
        {"region": [list(r) for r in region], CHECKSUM: _checksum(data)} for region, data in pieces
    ]
    return entry


def _is_state(node) -> bool:
    return isinstance(node, CompressState)


def _cuts(tree) -> list[dict]:
    """What each compressor state's residual was cut from: its form and :class:`residuals.Cut`."""
    out = []
    for keys, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_state)[0]:
        if _is_state(node) and node.residual is not None:
            form = residuals.form_of(node.residual)
            cut = form.cut(node.residual).to_json()
            out.append({"state": list(key(keys)), "form": form.name, **cut})
    return out


def write(directory, tree) -> None:
    """Writes this process's manifest of ``tree``, as orbax saved it, into ``directory``."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    record = {
        "format": FORMAT,
        "checksum": CHECKSUM,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "leaves": [_describe(keys, leaf) for keys, leaf in flat],
        "residuals": _cuts(tree),
    }
    folder = os.path.join(directory, DIRECTORY)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"process_{jax.process_index()}.json"), "w") as sink:
        json.dump(record, sink)
        sink.flush()
        os.fsync(sink.fileno())  # as durable as orbax's own files before the rename


def _naturals(value, what: str, length: int | None = None) -> tuple:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} is not a list of non-negative integers")
    if length is not None and len(value) != length:
        raise ValueError(f"{what} has {len(value)} entries, not {length}")
    return tuple(value)


def _field(record, name: str, kind: type, what: str):
    value = record.get(name) if isinstance(record, dict) else None
    if type(value) is not kind:
        raise ValueError(f"{what} has no {kind.__name__} {name!r}")
    return value


def _leaf(entry, what: str) -> tuple[tuple, Leaf]:
    """``(key, Leaf)`` of one manifest entry, every field checked."""
    name = _field(entry, "name", str, what)
    what = f"{what}, leaf {name}"
    path = _field(entry, "path", list, what)
    if not all(type(p) is str for p in path):
        raise ValueError(f"{what}: its path holds something other than names")
    shape = _naturals(entry.get("shape"), f"{what}: its shape")
    device = entry.get("device_shape")
    device = None if device is None else _naturals(device, f"{what}: its device_shape", len(shape))
    shards = {}
    for shard in _field(entry, "shards", list, what):
        pairs = _field(shard, "region", list, what)
        region = tuple(_naturals(p, f"{what}: a region", 2) for p in pairs)
        crc = _field(shard, CHECKSUM, int, what)
        if len(region) != len(shape) or any(
            not a <= b <= n for (a, b), n in zip(region, shape, strict=True)
        ):
            raise ValueError(f"{what}: region {pairs} is not inside its shape {list(shape)}")
        shards[region] = crc
    return tuple(path), Leaf(name, shape, _field(entry, "dtype", str, what), device, shards)


def _load(folder: str, process: int) -> dict:
    """One process's manifest, its top-level fields checked."""
    name = f"{DIRECTORY}/process_{process}.json"
    what = f"its {name}"
    try:
        with open(os.path.join(folder, f"process_{process}.json"), "rb") as source:
            record = json.loads(source.read().decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"it lacks {name}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ValueError(f"{what} is not JSON ({type(error).__name__})") from None
    if (_field(record, "format", int, what), record.get("checksum")) != (FORMAT, CHECKSUM):
        raise ValueError(f"{what} is not format {FORMAT} with {CHECKSUM} checksums")
    if _field(record, "process", int, what) != process:
        raise ValueError(f"{what} says it is process {record['process']}'s")
    _field(record, "processes", int, what)
    _field(record, "leaves", list, what)
    return record


def read(path: str) -> dict[tuple, Leaf]:
    """Every saved leaf of the checkpoint at ``path``, by :func:`key`, from all processes' files.

    Raises:
      ValueError: if a process's file is missing, is not JSON or not the
        manifest's format, or if the files together miss a part of an array.
    """
    folder = os.path.join(path, DIRECTORY)
    try:
        first = _load(folder, 0)
        records = [first, *(_load(folder, i) for i in range(1, max(first["processes"], 1)))]
        leaves = {}
        for record in records:
            what = f"its {DIRECTORY}/process_{record['process']}.json"
            for entry in record["leaves"]:
                name, leaf = _leaf(entry, what)
                leaves.setdefault(name, leaf).shards.update(leaf.shards)
        for leaf in leaves.values():
            covered = sum(math.prod(b - a for a, b in region) for region in leaf.shards)
            if covered != math.prod(leaf.shape):
                raise ValueError(
                    f"its manifest covers {covered} of the {math.prod(leaf.shape)} "
                    f"entries of {leaf.name}"
                )
    except ValueError as error:
        raise incomplete(path, str(error)) from None
    return leaves


def _cut(entry, what: str) -> tuple[tuple, residuals.Form, residuals.Cut]:
    """``(state key, form, cut)`` of one residual's record, every field checked."""
    state = _field(entry, "state", list, what)
    if not all(type(p) is str for p in state):
        raise ValueError(f"{what}: a residual's state path holds something other than names")
    what = f"{what}, the residual of {'/'.join(state) or '(root)'}"
    form = residuals.FORMS.get(entry.get("form"))
    if form is None:
        raise ValueError(f"{what} has no form of {sorted(residuals.FORMS)}")
    paths = _field(entry, "paths", list, what)
    if not all(isinstance(p, list) and all(type(n) is str for n in p) for p in paths):
        raise ValueError(f"{what}: its paths are not lists of names")
    shapes = [_naturals(s, f"{what}: a shape") for s in _field(entry, "shapes", list, what)]
    dtypes = _field(entry, "dtypes", list, what)
    parts = [_naturals(p, f"{what}: a part") for p in _field(entry, "parts", list, what)]
    shards = _field(entry, "shards", int, what)
    if len({len(paths), len(shapes), len(dtypes)}) != 1 or shards < 1:
        raise ValueError(f"{what}: its paths, shapes and dtypes differ in length")
    if not all(type(d) is str for d in dtypes) or any(i >= len(paths) for p in parts for i in p):
        raise ValueError(f"{what}: its dtypes or parts are not the leaves'")
    cut = residuals.Cut(
        tuple(map(tuple, paths)), tuple(shapes), tuple(dtypes), tuple(parts), shards
    )
    return tuple(state), form, cut


def cuts(path: str) -> dict[tuple, tuple[residuals.Form, residuals.Cut]]:
    """Each saved residual's form and cut, by its state's :func:`key`.

    Empty for a checkpoint of a sidco_jax that did not record them.

    Raises:
      ValueError: if the record is not the manifest's format.
    """
    what = f"its {DIRECTORY}/process_0.json"
    try:
        record = _load(os.path.join(path, DIRECTORY), 0).get("residuals", [])
        if not isinstance(record, list):
            raise ValueError(f"{what} holds no list 'residuals'")
        found = [_cut(entry, what) for entry in record]
    except ValueError as error:
        raise incomplete(path, str(error)) from None
    return {state: (form, cut) for state, form, cut in found}


def _pieces(value) -> list:
    """``(region, data)`` of every part of ``value`` this process holds, the whole one last."""
    whole = tuple((0, n) for n in np.shape(value))
    if not isinstance(value, jax.Array):
        return [(whole, value)]
    pieces = [(_region(s.index, value.shape), s.data) for s in value.addressable_shards]
    return [*pieces, (whole, value)] if value.is_fully_addressable else pieces


def _inside(region, have) -> bool:
    return all(h0 <= a and b <= h1 for (a, b), (h0, h1) in zip(region, have, strict=True))


def verify_all(path: str, pairs) -> None:
    """Raises, in every process alike, unless every ``(Leaf, value)`` holds what was saved.

    Each process checks the shards it holds (see :func:`verify`). A process
    that found none damaged still raises when another did: one that went on
    alone would train with processes that fall back to another checkpoint.
    """
    damage = None
    for leaf, value in pairs:
        try:
            verify(path, leaf, value)
        except ValueError as error:
            damage = error
            break
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        found = multihost_utils.process_allgather(np.int32(damage is not None))
        if damage is None and found.any():
            processes = ", ".join(map(str, np.flatnonzero(found)))
            damage = ValueError(
                f"{path} is damaged: process {processes} found arrays that do not hold what "
                "was saved (its error names them); restore another checkpoint"
            )
    if damage is not None:
        raise damage


def verify(path: str, leaf: Leaf, value) -> None:
    """Raises unless every saved shard of ``value`` this process holds has its saved checksum.

    A shard split across processes more finely than it was saved is checked by
    none of them; everything else is checked by the processes that hold it.
    """
    if np.shape(value) != leaf.shape:
        raise incomplete(
            path,
            f"its manifest says {leaf.name} has shape {leaf.shape}, its data {np.shape(value)}",
        )
    pieces, host = _pieces(value), {}
    for region, crc in leaf.shards.items():
        i = next((i for i, (have, _) in enumerate(pieces) if _inside(region, have)), None)
        if i is None:  # held by other processes only
            continue
        if i not in host:  # one copy to the host per piece, however many shards it holds
            host[i] = np.asarray(pieces[i][1])
        start = pieces[i][0]
        part = tuple(slice(a - h0, b - h0) for (a, b), (h0, _) in zip(region, start, strict=True))
        if _checksum(host[i][part]) != crc:
            whole = region == tuple((0, n) for n in leaf.shape)
            where = "" if whole else f"[{', '.join(f'{a}:{b}' for a, b in region)}]"
            raise ValueError(
                f"{path} is damaged: {leaf.name}{where} does not hold what was saved (its "
                "CRC-32 differs from the one written at save); restore another checkpoint"
            )
