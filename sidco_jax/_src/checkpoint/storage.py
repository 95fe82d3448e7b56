"""Orbax, as :func:`sidco_jax.save` and :func:`sidco_jax.restore` use it.

Orbax's standard handler, extended to write the manifest of
:mod:`sidco_jax._src.checkpoint.manifest` into the checkpoint before orbax commits it; the
parts a checkpoint must hold, checked before orbax reads anything; and
tensorstore's errors for damaged data, said as such, with what orbax leaves
behind when a read fails cleared away.
"""

import functools
import gc
import glob
import json
import os
import re
import sys
import time
import types

from sidco_jax._src.checkpoint import manifest

# Orbax writes into ``<path>`` + this suffix and renames it when the save completes.
_UNFINISHED = ".orbax-checkpoint-tmp"
# What every checkpoint of :func:`sidco_jax.save` holds: the tree's metadata, the
# root and data files of the OCDBT database holding the arrays, and the manifest.
_LAYOUT = ("_METADATA", "manifest.ocdbt", "d", manifest.DIRECTORY)
# Orbax's JSON files besides the per-process ones in array_metadatas/.
_JSON = ("_METADATA", "_CHECKPOINT_METADATA", "_sharding")
# Tensorstore's codes for stored data that is missing or cannot be decoded.
_DAMAGE = re.compile(r"^(NOT_FOUND|OUT_OF_RANGE|FAILED_PRECONDITION|DATA_LOSS): ")


def orbax():
    """``orbax.checkpoint``, imported only here: it is slow to import and an optional extra."""
    try:
        import orbax.checkpoint as ocp
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "sidco_jax.save and sidco_jax.restore need orbax: pip install 'sidco_jax[checkpoint]'"
        ) from error
    return ocp


@functools.cache
def _handler():
    """Orbax's handler writing the manifest too, and its save and restore arguments."""
    ocp = orbax()

    class Handler(ocp.StandardCheckpointHandler):
        def save(self, directory, *args, **kwargs):
            super().save(directory, *args, **kwargs)
            # Into orbax's temporary directory, renamed only once every process is done:
            # a checkpoint never exists without its manifest.
            manifest.write(directory, kwargs["args"].item)

    # Orbax finds a handler's arguments by their class: subclasses of its own, for this one.
    @ocp.args.register_with_handler(Handler, for_save=True)
    class Save(ocp.args.StandardSave):
        pass

    @ocp.args.register_with_handler(Handler, for_restore=True)
    class Restore(ocp.args.StandardRestore):
        pass

    return Handler, Save, Restore


def checkpointer():
    """A synchronous orbax checkpointer whose saves write the manifest too."""
    ocp = orbax()

    # The synchronous checkpointer creates the directory before any writer starts.
    # The asynchronous one starts writers that wait for the directory: when its
    # creation failed they kept the process alive for orbax's 300 s timeout.
    return ocp.Checkpointer(_handler()[0]())


def check_source(path: str) -> None:
    """Raises unless ``path`` is a directory holding every part of a whole checkpoint."""
    if not os.path.exists(path):
        unfinished = glob.glob(glob.escape(path + _UNFINISHED) + "*")
        hint = f": a save to it started and did not finish ({unfinished[0]})" if unfinished else ""
        raise FileNotFoundError(f"no checkpoint at {path}: the directory does not exist{hint}")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"no checkpoint at {path}: {path} is a file, not a directory")
    if not os.listdir(path):
        raise ValueError(f"no checkpoint at {path}: {path} is empty")
    # Checked here and not left to orbax: its failing reads leave tensorstore
    # callbacks that print "Event loop is closed" long after the error.
    missing = [name for name in _LAYOUT if not os.path.exists(os.path.join(path, name))]
    if missing:
        raise manifest.incomplete(path, f"it lacks {', '.join(missing)}")
    # Orbax's own reading of these fails with a KeyError, or a UnicodeDecodeError naming
    # no file, on anything but the JSON objects it wrote.
    others = glob.glob(os.path.join(glob.escape(path), "array_metadatas", "*"))
    names = [n for n in _JSON if os.path.exists(os.path.join(path, n))]
    for name in names + sorted(os.path.relpath(other, path) for other in others):
        record = _json_object(path, name)
        if name == "_METADATA" and not isinstance(record.get("tree_metadata"), dict):
            raise manifest.incomplete(path, "its _METADATA holds no tree_metadata object")


def _json_object(path: str, name: str) -> dict:
    """The JSON object in ``path/name``; raises unless it holds one."""
    try:
        with open(os.path.join(path, name), "rb") as source:
            record = json.loads(source.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise manifest.incomplete(
            path, f"its {name} is not JSON ({type(error).__name__})"
        ) from None
    if not isinstance(record, dict):
        raise manifest.incomplete(path, f"its {name} holds no JSON object")
    return record


def metadata(checkpointer, path: str):
    """Orbax's metadata tree of the saved leaves (shape, dtype): dicts, lists and leaves."""
    from etils import epath  # orbax's own path type, installed with it

    try:
        return checkpointer.handler.metadata(epath.Path(path)).tree
    except Exception as error:
        damaged = _damaged(path, error, "reading its metadata")
        if damaged is error:
            raise
    _collect_abandoned_reads()
    raise damaged


def save(checkpointer, path: str, tree) -> None:
    """Saves ``tree`` to ``path``, its manifest with it."""
    checkpointer.save(path, args=_handler()[1](tree))


def read(checkpointer, path: str, wanted, folders: dict):
    """Orbax's restore of ``wanted``, its errors for damaged data said as such.

    Args:
      checkpointer: from :func:`checkpointer`.
      path: the checkpoint.
      wanted: what to read (shapes, dtypes and shardings).
      folders: the leaves' names (``jax.tree_util.keystr``) by the folder
        orbax stores each in: its path joined with dots.
    """
    try:
        return checkpointer.restore(path, args=_handler()[2](wanted))
    except Exception as error:
        damaged = _damaged(path, error, "reading", folders)
        if damaged is error:
            raise
    _collect_abandoned_reads()
    raise damaged


def _damaged(path: str, error: Exception, doing: str, folders=None) -> Exception:
    """A ValueError naming ``path`` (and the array) where tensorstore found damaged data,
    or where orbax met JSON it did not write (a key or a type its files never hold).

    Otherwise ``error`` itself: anything else is not the checkpoint's fault.
    The ValueError does not chain ``error``, whose traceback holds orbax's
    abandoned reads (see :func:`_collect_abandoned_reads`).
    """
    if isinstance(error, KeyError | NotImplementedError):  # JSON still valid after damage
        reason = f"orbax met {type(error).__name__}: {error} in its JSON files"
        return manifest.incomplete(path, f"{doing} failed: {reason}")
    cause = error
    while cause is not None and not _DAMAGE.match(str(cause)):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return error
    # Tensorstore appends its whole JSON spec to the message: keep the sentence.
    reason = str(cause).split(" [tensorstore_spec=")[0]
    found = re.search(r'Error reading "([^"]*)/', reason)
    name = (folders or {}).get(found.group(1)) if found else None
    which = "" if name is None else f" {name}"
    return manifest.incomplete(path, f"{doing}{which} failed with: {reason}")


def _orbax_coroutine(thing) -> bool:
    return (
        isinstance(thing, types.CoroutineType)
        and f"{os.sep}orbax{os.sep}" in thing.cr_code.co_filename
    )


def _collect_abandoned_reads(patience: float = 2.0) -> None:
    """Waits, quietly, for the reads of other arrays that orbax abandoned when one failed.

    They finish in tensorstore's threads after the failure, their callbacks
    find orbax's event loop closed, and once collected each raises from its
    ``GeneratorExit``: Python reports both as unraisable exceptions, far from
    here (errors under pytest's ``filterwarnings = error``). The error raised
    after this says all there is, so they are awaited and collected here, for
    up to ``patience`` seconds.
    """

    def hook(unraisable):
        closed = unraisable.exc_type is RuntimeError and "Event loop is closed" in str(
            unraisable.exc_value
        )
        if not (closed or _orbax_coroutine(unraisable.object)):
            default(unraisable)

    default, sys.unraisablehook = sys.unraisablehook, hook
    deadline = time.monotonic() + patience
    try:
        gc.collect()
        while any(map(_orbax_coroutine, gc.get_objects())) and time.monotonic() < deadline:
            time.sleep(0.01)
            gc.collect()
    finally:
        sys.unraisablehook = default
