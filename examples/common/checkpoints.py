"""Checkpoints of a trainer's run, and resuming it from the newest complete one.

With ``--checkpoint-dir DIR`` each compressor's run saves
``DIR/<compressor>/step_<t>`` with :func:`sidco_jax.save` every
``--checkpoint-every`` steps and at the last: the parameters, the optimizer
state (every device's residual included) and the history so far. A save is
atomic (orbax writes into ``step_<t>.orbax-checkpoint-tmp`` and renames it
once complete, manifest included), so every ``step_<t>`` is a complete
checkpoint, and a run killed at any point, in the middle of a save included,
resumes from the newest one: the same run, rerun, finishes bit for bit as if
it had never stopped.
"""

import os
import re

import numpy as np

import sidco_jax as sidco

_STEP = re.compile(r"step_(\d+)")


def latest(directory: str | os.PathLike, at_most: int) -> int:
    """The newest complete checkpoint's step in ``directory``, up to ``at_most``; 0 without."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = (int(m.group(1)) for name in names if (m := _STEP.fullmatch(name)))
    return max((step for step in steps if step <= at_most), default=0)


def path(directory: str | os.PathLike, step: int) -> str:
    """Where the checkpoint of ``step`` goes."""
    return os.path.join(directory, f"step_{step}")


def save(directory, step: int, params, opt_state, history, seconds: float) -> None:
    """Saves the run after ``step`` steps; ``seconds`` is its training time so far.

    The history is saved as arrays of one entry a step (its steps are 1 to
    ``step``), so that restoring needs no more than ``step`` to shape them.
    """
    evaluated = np.zeros(step, bool)
    evaluated[np.asarray(history.eval_steps, int) - 1] = True
    evals = np.zeros(step)
    evals[evaluated] = history.evals
    lists = {
        "loss": np.asarray(history.loss, np.float64),
        "achieved": np.asarray(history.achieved, np.float64),
        "evaluated": evaluated,
        "evals": evals,
    }
    tree = {"params": params, "opt_state": opt_state, "history": lists, "seconds": seconds}
    sidco.save(path(directory, step), tree)


def restore(directory, step: int, params, opt_state, history):
    """The run saved after ``step`` steps: ``(params, opt_state, seconds)``; fills ``history`` in.

    Args:
      directory: the run's checkpoints.
      step: the checkpoint to restore.
      params: the run's initial parameters (shapes and shardings to restore).
      opt_state: its initial optimizer state.
      history: an empty history, filled in place.
    """
    lists = {name: np.zeros(step) for name in ("loss", "achieved", "evals")}
    lists["evaluated"] = np.zeros(step, bool)
    target = {"params": params, "opt_state": opt_state, "history": lists, "seconds": 0.0}
    restored = sidco.restore(path(directory, step), target)
    lists = restored["history"]
    history.steps = list(range(1, step + 1))
    history.loss, history.achieved = lists["loss"].tolist(), lists["achieved"].tolist()
    history.eval_steps = (np.flatnonzero(lists["evaluated"]) + 1).tolist()
    history.evals = lists["evals"][lists["evaluated"]].tolist()
    return restored["params"], restored["opt_state"], restored["seconds"]
