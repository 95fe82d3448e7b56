"""What both trainers' loops call: the optimizer, and one compressor's run around the step.

Each ``train.py`` writes out its data-parallel step and its loop; what does not
depend on the model is here, once: :func:`create_optimizer`, and :class:`Run`,
which draws the batches, shows a progress bar (``loss``; ``density``, the
fraction of gradient entries sent; ``examples/s``, training throughput),
records the :class:`History`, evaluates on the held-out data, saves and resumes
checkpoints (:mod:`examples.common.checkpoints`) and captures whole-model gradients.
"""

import dataclasses
import importlib
import pathlib
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
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
    state_bytes: int = 0  # a device's parameters and optimizer state (the residual included)


def create_optimizer(
    config: Config, compressor: str, axis_name: str | None = parallel.AXIS, **options
) -> optax.GradientTransformation:
    """The compressor, averaging over the devices of ``axis_name``, then SGD with momentum.

    With ``config.outer_every`` the SGD steps each device's own parameters and
    the compressor averages the pseudo-gradients every ``outer_every`` steps
    (:func:`sidco_jax.diloco`), an outer SGD with Nesterov momentum stepping
    the shared parameters.

    Args:
      config: the options (ratio, learning rates, momenta, ``outer_every``).
      compressor: a name of ``sidco_jax.COMPRESSORS``.
      axis_name: the mesh axis the compressor averages over; None gives the
        same optimizer on one device, with no communication.
      **options: keywords of :func:`sidco_jax.compressor` (``warmup_steps=50``, ...).
    """
    if compressor != "dense":  # dense sends no sparse message
        options = {"values": config.values, "indices": config.indices, **options}
    compress = sidco.compressor(compressor, config.ratio, axis_name=axis_name, **options)
    sgd = optax.sgd(config.learning_rate, momentum=config.momentum)
    if not config.outer_every:
        return optax.chain(compress, sgd)
    momentum = config.outer_momentum or None
    outer = optax.sgd(config.outer_learning_rate, momentum=momentum, nesterov=bool(momentum))
    return sidco.diloco(sgd, outer, config.outer_every, compress)


class Run:
    """One compressor's run around a trainer's step: batches, history, checkpoints, captures.

    A trainer's loop calls, in this order::

        run = Run(config, task, compressor, mesh, workdir)
        train_step = run.compile(train_step, params, opt_state)
        params, opt_state = run.resume(params, opt_state)
        for t in run.steps():
            host, batch = run.batch()
            run.capture(t, params, opt_state, host)
            params, opt_state, loss = train_step(params, opt_state, batch)
            run.record(t, params, opt_state, loss)
        history = run.finish()

    Every run of a config draws the same batches, whatever its compressor, and
    a resumed run draws again those its checkpoint has trained on, so it
    finishes bit for bit as an uninterrupted one.
    """

    def __init__(self, config: Config, task: Task, compressor: str, mesh, workdir):
        self.config, self.task, self.mesh = config, task, mesh
        self.workdir = pathlib.Path(workdir)
        self.history = History(compressor)
        self.global_batch = config.batch_per_device * config.devices
        self.data = np.random.default_rng(config.seed)
        self.folder = config.checkpoint_dir and pathlib.Path(config.checkpoint_dir) / compressor
        self.done, self.seconds = 0, 0.0  # steps and training seconds a checkpoint holds
        self.bar, self.start = None, 0.0  # set by steps()
        self.captured = {}

    def batch(self) -> tuple[Any, Any]:
        """The next batch: on the host, and split over every device of the mesh."""
        host = self.task.sample(self.data, self.global_batch)
        return host, sidco.parallel.place(host, self.mesh, jax.P(self.mesh.axis_names))

    def compile(self, train_step: Callable, params, opt_state) -> Callable:
        """``train_step`` compiled once for every step; its HLO says what a step sends.

        The batch it is compiled with is drawn and not trained on, as in every
        run so far, so it comes before :meth:`resume`.
        """
        batch = self.batch()[1]
        compiled, sent = parallel.compile_step(train_step, self.mesh, params, opt_state, batch)
        self.history.bytes_per_step = sent // max(self.config.outer_every, 1)  # an exchange's share
        # With outer steps each device holds its own copy: count one.
        self.history.parameters = sum(int(np.size(x)) for x in jax.tree.leaves(self._host(params)))
        self.history.state_bytes = parallel.device_bytes((params, opt_state))
        return compiled

    def resume(self, params, opt_state):
        """``(params, opt_state)`` of the newest checkpoint of this run, or those given.

        With ``config.checkpoint_dir`` it restores the newest complete checkpoint
        up to ``config.steps`` with its history, and draws again the batches its
        steps trained on.
        """
        if self.folder:
            self.done = checkpoints.latest(self.folder, self.config.steps)
        if not self.done:
            return params, opt_state
        params, opt_state, self.seconds = checkpoints.restore(
            self.folder, self.done, params, opt_state, self.history
        )
        print(f"{self.history.compressor}: resumed at step {self.done} from {self.folder}")
        for _ in range(self.done):
            self.task.sample(self.data, self.global_batch)
        return params, opt_state

    def steps(self) -> Iterable[int]:
        """The steps left to train, 1-based, with a progress bar; starts the clock."""
        config = self.config
        self.bar = tqdm(
            range(self.done + 1, config.steps + 1),
            desc=self.history.compressor,
            disable=not config.progress,
            leave=False,
        )
        self.start = time.perf_counter()
        return self.bar

    def capture(self, t: int, params, opt_state, host) -> None:
        """At ``config.capture_steps``, keeps device 0's whole-model gradient and its residual.

        Device 0's gradient on its shard of ``host`` (``grad_step<t>``), and the
        vector its compressor thresholds, gradient plus residual (``u_step<t>``).
        """
        if t not in self.config.capture_steps:
            return
        local = jax.tree.map(lambda x: x[: self.config.batch_per_device], host)
        grad = parallel.flat_gradient(self.task.loss, self._host(params), local)
        residual = parallel.first_residual(opt_state)
        self.captured[f"grad_step{t}"] = grad
        self.captured[f"u_step{t}"] = grad if residual is None else grad + residual

    def record(self, t: int, params, opt_state, loss) -> None:
        """Records step ``t``'s loss and density; evaluates and saves a checkpoint when due.

        It evaluates every ``config.eval_every`` steps and saves every
        ``config.checkpoint_every`` (with ``--checkpoint-dir``), both also at the last step.
        """
        config, history = self.config, self.history
        last = t == config.steps
        history.steps.append(t)
        history.loss.append(float(parallel.replicated_value(loss)))
        density = float(parallel.replicated_value(sidco.metrics(opt_state)["density"]))
        history.achieved.append(density / config.ratio if history.compressor != "dense" else 1.0)
        if t % config.eval_every == 0 or last:
            history.eval_steps.append(t)
            history.evals.append(float(self.task.evaluate(self._host(params))))
        if self.folder and (t % config.checkpoint_every == 0 or last):
            checkpoints.save(self.folder, t, params, opt_state, history, self._elapsed())
        if t % 10 == 0 or last:
            rate = (t - self.done) * self.global_batch / (time.perf_counter() - self.start)
            self.bar.set_postfix(
                loss=f"{history.loss[-1]:.3f}",
                density=f"{density:.4f}",
                **{"examples/s": f"{rate:.0f}"},
            )

    def finish(self) -> History:
        """The history, with seconds per step; writes the captures (``gradients_<name>.npz``)."""
        self.history.seconds_per_step = self._elapsed() / self.config.steps
        if self.captured:
            self.workdir.mkdir(parents=True, exist_ok=True)
            np.savez(self.workdir / f"gradients_{self.history.compressor}.npz", **self.captured)
        return self.history

    def _elapsed(self) -> float:
        """Training seconds so far, those before a resumed checkpoint included."""
        return self.seconds + time.perf_counter() - self.start

    def _host(self, params) -> Any:
        """The parameters on the host; with outer steps the first copy's, the anchor after an
        exchange."""
        if self.config.outer_every:
            return jax.tree.map(_first_copy, params)
        return jax.tree.map(parallel.replicated_value, params)


def _first_copy(x) -> np.ndarray:
    """The first of per-device copies (a leading axis), gathered where it is sharded."""
    own = x.addressable_data(0)
    if own.shape[1:] == x.shape[1:]:  # whole on its device
        return np.asarray(own)[0]
    return parallel.replicated_value(x)[0]


def example(job: str) -> tuple[Task, Config]:
    """``(task, config)`` of an example job such as ``"lm:large"`` (``<example>:<config>``)."""
    model, name = job.split(":")
    config = importlib.import_module(f"examples.{model}.configs.{name}").get_config()
    return importlib.import_module(f"examples.{model}.train").create_task(config), config
