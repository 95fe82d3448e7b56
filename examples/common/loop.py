"""The training loop both example trainers share: one run per compressor, same data and seed.

A :class:`Task` says what is trained (parameters, loss, batches, evaluation);
:func:`train` runs it under every compressor of the config with a progress bar
(loss, achieved/target density, throughput), records the history, optionally
captures whole-model gradients, and :mod:`examples.common.report` turns the
histories into a table and plots.
"""

import dataclasses
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from tqdm.auto import tqdm

import sidco_jax as sidco
from examples.common import parallel
from examples.common.config import Config


class Task(NamedTuple):
    """What a trainer trains.

    Attributes:
      init: ``init(seed) -> params`` (host or device arrays).
      loss: ``loss(params, batch) -> scalar`` on a per-device batch.
      sample: ``sample(rng, size) -> batch`` of ``size`` examples (NumPy).
      evaluate: ``evaluate(params) -> float`` on held-out data.
      metric: name of what ``evaluate`` returns (``"accuracy"``, ``"perplexity"``).
    """

    init: Callable
    loss: Callable
    sample: Callable
    evaluate: Callable
    metric: str


@dataclasses.dataclass
class History:
    """One compressor's run."""

    compressor: str
    steps: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    achieved: list[float] = dataclasses.field(default_factory=list)  # density / target
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    evals: list[float] = dataclasses.field(default_factory=list)
    seconds_per_step: float = 0.0
    bytes_per_step: int = 0
    parameters: int = 0


def run_one(config: Config, task: Task, name: str, workdir: pathlib.Path) -> History:
    """Trains ``task`` with compressor ``name``; returns its history."""
    tx = optax.chain(
        parallel.compressor(name, config.ratio),
        optax.sgd(config.learning_rate, momentum=config.momentum),
    )
    params = task.init(config.seed)
    global_batch = config.batch_per_device * config.devices
    data = np.random.default_rng(config.seed)  # the same batches for every compressor
    trainer = parallel.build(task.loss, params, task.sample(data, global_batch), tx, config.devices)
    params = parallel.place(trainer.mesh, params, parallel.P())
    opt_state = trainer.opt_state
    history = History(name, bytes_per_step=trainer.bytes_per_step)
    history.parameters = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    captured = {}
    bar = tqdm(range(1, config.steps + 1), desc=name, disable=not config.progress, leave=False)
    start = time.perf_counter()
    for t in bar:
        batch = task.sample(data, global_batch)
        if t in config.capture_steps:
            local = jax.tree.map(lambda x: x[: config.batch_per_device], batch)
            grad = parallel.flat_gradient(task.loss, _host(params), local)
            residual = parallel.first_residual(opt_state)
            captured[f"grad_step{t}"] = grad
            captured[f"u_step{t}"] = grad if residual is None else grad + residual
        params, opt_state, loss = trainer.step(
            params, opt_state, parallel.place(trainer.mesh, batch, parallel.P(parallel.AXIS))
        )
        metrics = sidco.metrics(opt_state)
        history.steps.append(t)
        history.loss.append(float(parallel.replicated_value(loss)))
        density = float(parallel.replicated_value(metrics["density"]))
        history.achieved.append(density / config.ratio if name != "dense" else 1.0)
        if t % config.eval_every == 0 or t == config.steps:
            history.eval_steps.append(t)
            history.evals.append(float(task.evaluate(_host(params))))
        if t % 10 == 0 or t == config.steps:
            rate = t * global_batch / (time.perf_counter() - start)
            bar.set_postfix(
                loss=f"{history.loss[-1]:.3f}", density=f"{density:.4f}", ex_s=f"{rate:.0f}"
            )
    history.seconds_per_step = (time.perf_counter() - start) / config.steps
    if captured:
        np.savez(workdir / f"gradients_{name}.npz", **captured)
    return history


def _host(params) -> Any:
    return jax.tree.map(parallel.replicated_value, params)


def train(config: Config, task: Task, workdir: str | pathlib.Path) -> list[History]:
    """Runs every compressor of ``config`` on ``task``; writes ``results.json`` to ``workdir``."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    histories = [run_one(config, task, name, workdir) for name in config.compressors]
    record = {"config": dataclasses.asdict(config), "metric": task.metric}
    record["runs"] = [dataclasses.asdict(h) for h in histories]
    (workdir / "results.json").write_text(json.dumps(record, indent=1))
    return histories
