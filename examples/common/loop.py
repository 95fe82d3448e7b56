"""The training loop both example trainers share: one run per compressor, same data and seed.

A :class:`Task` says what is trained (parameters, loss, batches, evaluation);
:func:`fit` runs a trainer's data-parallel step on it with a progress bar
(``loss``; ``density``, the fraction of gradient entries sent; ``examples/s``,
training throughput), records the history and optionally captures whole-model gradients;
:mod:`examples.common.report` turns the histories into a table and plots.
"""

import dataclasses
import importlib
import json
import pathlib
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

import sidco_jax as sidco
from examples.common import checkpoints, parallel
from examples.common.config import Config


class Task(NamedTuple):
    """What a trainer trains.

    Attributes:
      init: ``init(seed) -> params`` (host or device arrays).
      loss: ``loss(params, batch) -> scalar`` on a per-device batch.
      sample: ``sample(rng, size) -> batch`` of ``size`` examples (NumPy).
      evaluate: ``evaluate(params) -> float`` on held-out data.
      metric: name of what ``evaluate`` returns (``"accuracy"``, ``"perplexity"``).
      held_out: the data ``evaluate`` reads (``"test"``, ``"validation"``).
    """

    init: Callable
    loss: Callable
    sample: Callable
    evaluate: Callable
    metric: str
    held_out: str = "test"


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


def fit(
    config: Config,
    task: Task,
    name: str,
    train_step: Callable,
    params,
    opt_state,
    mesh: jax.sharding.Mesh,
    workdir: pathlib.Path,
) -> History:
    """Runs ``train_step`` for ``config.steps`` steps; returns the history of compressor ``name``.

    With ``config.checkpoint_dir`` it saves the run there every
    ``config.checkpoint_every`` steps and at the last, and first resumes from
    the newest complete checkpoint of ``name`` there, if any
    (:mod:`examples.common.checkpoints`).

    Args:
      config: the options.
      task: what is trained.
      name: the compressor's name (``"dense"`` has no target density).
      train_step: ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``.
      params: the initial (replicated, global) parameters.
      opt_state: the initial optimizer state.
      mesh: the mesh the batches are split over (axis :data:`parallel.AXIS`).
      workdir: where captured gradients go.
    """
    global_batch = config.batch_per_device * config.devices
    data = np.random.default_rng(config.seed)  # the same batches for every compressor

    def next_batch():
        host = task.sample(data, global_batch)
        return host, sidco.place(host, mesh, jax.P(parallel.AXIS))

    # One compilation, used for every step; its HLO says what a step sends. (The batch it
    # is compiled with is drawn and not trained on, as in every run so far.)
    train_step, sent = parallel.compile_step(train_step, params, opt_state, next_batch()[1])
    history = History(name, bytes_per_step=sent)
    history.parameters = sum(int(np.size(x)) for x in jax.tree.leaves(params))
    folder = config.checkpoint_dir and pathlib.Path(config.checkpoint_dir) / name
    done = checkpoints.latest(folder, config.steps) if folder else 0
    seconds = 0.0
    if done:  # resume, with the batches those steps trained on drawn again
        params, opt_state, seconds = checkpoints.restore(folder, done, params, opt_state, history)
        for _ in range(done):
            task.sample(data, global_batch)
    captured = {}
    bar = tqdm(
        range(done + 1, config.steps + 1), desc=name, disable=not config.progress, leave=False
    )
    start = time.perf_counter()
    for t in bar:
        host, batch = next_batch()
        if t in config.capture_steps:
            local = jax.tree.map(lambda x: x[: config.batch_per_device], host)
            grad = parallel.flat_gradient(task.loss, _host(params), local)
            residual = parallel.first_residual(opt_state)
            captured[f"grad_step{t}"] = grad
            captured[f"u_step{t}"] = grad if residual is None else grad + residual
        params, opt_state, loss = train_step(params, opt_state, batch)
        density = _record(config, task, history, t, params, opt_state, loss)
        if folder and (t % config.checkpoint_every == 0 or t == config.steps):
            elapsed = seconds + time.perf_counter() - start
            checkpoints.save(folder, t, params, opt_state, history, elapsed)
        if t % 10 == 0 or t == config.steps:
            rate = (t - done) * global_batch / (time.perf_counter() - start)
            bar.set_postfix(
                loss=f"{history.loss[-1]:.3f}",
                density=f"{density:.4f}",
                **{"examples/s": f"{rate:.0f}"},
            )
    history.seconds_per_step = (seconds + time.perf_counter() - start) / config.steps
    if captured:
        workdir.mkdir(parents=True, exist_ok=True)
        np.savez(workdir / f"gradients_{name}.npz", **captured)
    return history


def _record(config: Config, task: Task, history: History, t: int, params, opt_state, loss):
    """Appends step ``t``'s loss, density and (when evaluated) metric; returns the density."""
    metrics = sidco.metrics(opt_state)
    history.steps.append(t)
    history.loss.append(float(parallel.replicated_value(loss)))
    density = float(parallel.replicated_value(metrics["density"]))
    history.achieved.append(density / config.ratio if history.compressor != "dense" else 1.0)
    if t % config.eval_every == 0 or t == config.steps:
        history.eval_steps.append(t)
        history.evals.append(float(task.evaluate(_host(params))))
    return density


def _host(params) -> Any:
    return jax.tree.map(parallel.replicated_value, params)


def save(config: Config, metric: str, histories: list[History], workdir: pathlib.Path) -> None:
    """Writes ``results.json``: the config, the metric's name and every history."""
    record = {"config": dataclasses.asdict(config), "metric": metric}
    record["runs"] = [dataclasses.asdict(h) for h in histories]
    (workdir / "results.json").write_text(json.dumps(record, indent=1))


def example(job: str) -> tuple[Task, Config]:
    """``(task, config)`` of an example job such as ``"lm:large"`` (``<example>:<config>``)."""
    model, name = job.split(":")
    config = importlib.import_module(f"examples.{model}.configs.{name}").get_config()
    return importlib.import_module(f"examples.{model}.train").create_task(config), config
