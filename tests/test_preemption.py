"""A trainer killed at any point, mid-save included, resumes and ends bit for bit as if unkilled.

The CNN example trains SIDCo-E on 8 forced CPU devices, checkpointing every
3 steps (``--checkpoint-dir``). It is killed with SIGKILL at seeded random
points: halfway through a save (the arrays written, the manifest not), and a
random time after a checkpoint completed. Each rerun resumes from the newest
complete checkpoint; the last one's state, residuals included, and history
must equal an uninterrupted run's.
"""

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

import chex
import numpy as np
import pytest

import sidco_jax as sidco
from examples.cnn import main, train
from examples.cnn.configs import tiny
from examples.common import checkpoints, parallel, training

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 3
FLAGS = ["--config", "tiny", "--compressors", "sidco-e", "--steps", str(STEPS)]
FLAGS += ["--checkpoint-every", str(EVERY), "--capture-steps", "--no-progress"]
ROOT = pathlib.Path(__file__).parent.parent
LIMIT = 60  # seconds a run may take

# The trainer, killing itself halfway through the save of step $KILL_IN_SAVE: orbax has
# written the arrays into step_<t>.orbax-checkpoint-tmp, and the manifest comes next.
DRIVER = """
import os, signal, sys
from sidco_jax._src.checkpoint import manifest
from examples.cnn import main

write, doomed = manifest.write, os.environ.get("KILL_IN_SAVE")

def write_or_die(directory, tree):
    if doomed and os.path.basename(str(directory)).startswith(f"step_{doomed}."):
        os.kill(os.getpid(), signal.SIGKILL)
    write(directory, tree)

manifest.write = write_or_die
main.main(sys.argv[1:])
"""


def start(tmp_path, run: int, kill_in_save: int | None = None) -> subprocess.Popen:
    """The trainer in a new process (the suite's XLA flags and 8 devices, inherited)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), KILL_IN_SAVE=str(kill_in_save or ""))
    argv = [*FLAGS, "--checkpoint-dir", str(tmp_path / "ckpt"), "--workdir", str(tmp_path)]
    with (tmp_path / f"run{run}.log").open("w") as log:
        return subprocess.Popen(
            [sys.executable, "-c", DRIVER, *argv], env=env, cwd=ROOT, stdout=log, stderr=log
        )


def finish(process: subprocess.Popen, tmp_path, run: int) -> int:
    try:
        return process.wait(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"run {run} still going after {LIMIT} s:\n{tmp_path / f'run{run}.log'}")


def kill_after_checkpoint(process, folder, step: int, delay: float) -> None:
    """SIGKILLs ``process`` ``delay`` seconds after its checkpoint of ``step`` is complete."""
    deadline = time.monotonic() + LIMIT
    while not os.path.isdir(checkpoints.path(folder, step)) and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.005)
    time.sleep(delay)
    process.kill()


def final_state(folder):
    """The params, optimizer state and history saved at the last step under ``folder``."""
    config = dataclasses.replace(tiny.get_config(), steps=STEPS, capture_steps=())
    task = train.create_task(config)
    mesh = parallel.mesh(config.devices)
    params = sidco.parallel.place(task.init(config.seed), mesh)
    tx = training.create_optimizer(config, "sidco-e")
    opt_state = sidco.parallel.shard_init(tx, params, mesh, parallel.AXIS)
    history = training.History("sidco-e")
    params, opt_state, _ = checkpoints.restore(folder, STEPS, params, opt_state, history)
    return params, opt_state, dataclasses.replace(history, seconds_per_step=0.0)


def test_a_killed_run_resumes_bit_identically(tmp_path, capsys):
    want = tmp_path / "uninterrupted"
    main.main([*FLAGS, "--checkpoint-dir", str(want / "ckpt"), "--workdir", str(want)])
    capsys.readouterr()
    folder = tmp_path / "ckpt" / "sidco-e"
    rng = np.random.default_rng(36)
    for run in range(2):  # one kill of each kind
        done = checkpoints.latest(folder, STEPS)
        step = done + EVERY * int(rng.integers(1, 3))  # one of the next two checkpoints
        if run % 2 == 0:  # halfway through that checkpoint's save
            code = finish(start(tmp_path, run, kill_in_save=step), tmp_path, run)
            assert not os.path.exists(checkpoints.path(folder, step))
            with pytest.raises(FileNotFoundError, match="a save to it started and did not finish"):
                sidco.restore(checkpoints.path(folder, step), None)
            unfinished = f"{checkpoints.path(folder, step)}.orbax-checkpoint-tmp"
            with pytest.raises(ValueError, match=r"not a complete checkpoint .*: it lacks"):
                sidco.restore(unfinished, None)
        else:  # a random time after that checkpoint completed
            process = start(tmp_path, run)
            kill_after_checkpoint(process, folder, step, float(rng.uniform(0, 0.2)))
            code = finish(process, tmp_path, run)
            assert checkpoints.latest(folder, STEPS) >= step
        assert code == -signal.SIGKILL, (tmp_path / f"run{run}.log").read_text()[-3000:]
        assert checkpoints.latest(folder, STEPS) < STEPS
    assert finish(start(tmp_path, 2), tmp_path, 2) == 0, (tmp_path / "run2.log").read_text()
    assert "sidco-e: resumed at step" in (tmp_path / "run2.log").read_text()
    got, wanted = final_state(folder), final_state(want / "ckpt" / "sidco-e")
    chex.assert_trees_all_equal(got[:2], wanted[:2])  # params, optimizer state, residuals
    assert got[2] == wanted[2]  # losses, densities, accuracies
