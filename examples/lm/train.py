"""Character-level LSTM language model, data-parallel, with one sidco_jax compressor.

``train_and_evaluate(config, workdir, compressor)`` trains ``models.LSTM`` on
the text of ``input_pipeline.py`` and reports validation perplexity (per
character). Its step, :func:`create_train_step`, is the one to read: each
device takes the gradient of its own shard of the batch, and the compressor,
first in the optax chain, sends the entries that matter and averages them over
the devices. ``main.py`` runs it once per compressor and compares them
(:mod:`examples.common.compare`); what the loop calls around the step
(batches, history, evaluation, checkpoints) is :class:`examples.common.training.Run`.
"""

import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sidco_jax as sidco
from examples.common import parallel, training
from examples.lm import input_pipeline, models


def create_task(config) -> training.Task:
    """The language-modelling :class:`~examples.common.training.Task` for ``config``."""
    text = input_pipeline.load(config.text, config.text_limit)
    vocab = len(text.vocab)

    def build(seed):
        return models.LSTM(vocab, config.embed, config.hidden, config.layers, rngs=nnx.Rngs(seed))

    # Only the parameters are trained (and compressed); the rest (RNG state) is constant.
    graphdef, _, rest = nnx.split(build(0), nnx.Param, ...)

    def init(seed):
        return nnx.split(build(seed), nnx.Param, ...)[1]

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def windows(tokens, starts):
        return np.stack([tokens[s : s + config.sequence + 1] for s in starts])

    def sample(rng, size):
        return windows(text.train, rng.integers(0, len(text.train) - config.sequence - 1, size))

    # A fixed validation set: evenly spaced windows over the held-out text.
    starts = np.linspace(0, len(text.valid) - config.sequence - 1, config.eval_windows).astype(int)
    held_out = windows(text.valid, starts)
    mean_loss = jax.jit(loss)

    def evaluate(params):
        return float(np.exp(mean_loss(params, jnp.asarray(held_out))))

    return training.Task(init, loss, sample, evaluate, "perplexity", held_out="validation")


def create_train_step(loss, tx: optax.GradientTransformation, opt_state, mesh) -> Callable:
    """The jitted data-parallel step: ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    The parameters are replicated, the batch is split over the devices and the
    optimizer state keeps one error-feedback residual per device, as
    :func:`sidco_jax.parallel.shard_init` made it (:func:`sidco_jax.parallel.state_specs`).
    """
    axis = mesh.axis_names  # the batch is split over every device of the mesh
    state_specs = sidco.parallel.state_specs(opt_state, axis)

    def train_step(params, opt_state, batch):  # on each device, with its shard of the batch
        # Varying parameters keep the gradient this device's own: replicated ones would
        # make the backward pass sum it densely over the devices before compression.
        varying = jax.lax.pcast(params, axis, to="varying")
        value, grads = jax.value_and_grad(loss)(varying, batch)
        # The compressor sends the entries that matter and averages them over `axis`.
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, jax.lax.pmean(value, axis)

    train_step = jax.shard_map(
        train_step,
        mesh=mesh,
        in_specs=(jax.P(), state_specs, jax.P(axis)),
        out_specs=(jax.P(), state_specs, jax.P()),
    )
    return jax.jit(train_step, donate_argnums=1)  # the state's buffers are reused in place


def train_and_evaluate(
    config,
    workdir: str | pathlib.Path,
    compressor: str = "sidco-e",
    *,
    task: training.Task | None = None,
    options: dict | None = None,
) -> training.History:
    """Trains with ``compressor`` for ``config.steps`` steps, evaluating on the validation set.

    Args:
      config: the options (``configs/``).
      workdir: where captured gradients go (``--capture-steps``).
      compressor: a name of ``sidco_jax.COMPRESSORS``.
      task: :func:`create_task`'s, if already made (comparing compressors loads the data once).
      options: keywords of :func:`sidco_jax.compressor` (``{"warmup_steps": 50}``, ...).

    Returns:
      The run's history: loss, density and validation perplexity over the steps.
    """
    task = create_task(config) if task is None else task
    mesh = parallel.mesh(config.devices, config.nodes)
    axes = parallel.compressor_axes(mesh)  # with --nodes: compressed across the nodes only
    tx = training.create_optimizer(config, compressor, **axes, **(options or {}))
    params = sidco.parallel.place(task.init(config.seed), mesh)  # replicated on every device
    opt_state = sidco.parallel.shard_init(tx, params, mesh, mesh.axis_names)  # residual per device
    train_step = create_train_step(task.loss, tx, opt_state, mesh)
    if config.outer_every:  # outer steps: each device trains its own copy between exchanges
        params = sidco.parallel.per_device(task.init(config.seed), mesh, mesh.axis_names)
        train_step = sidco.parallel.data_parallel_step(
            task.loss, tx, opt_state, mesh, mesh.axis_names, local_params=True, donate_state=True
        )

    run = training.Run(config, task, compressor, mesh, workdir)
    train_step = run.compile(train_step, params, opt_state)  # bytes sent per step, from its HLO
    params, opt_state = run.resume(params, opt_state)  # from --checkpoint-dir, if saved there
    for t in run.steps():
        host, batch = run.batch()
        run.capture(t, params, opt_state, host)  # at --capture-steps
        params, opt_state, loss = train_step(params, opt_state, batch)
        run.record(t, params, opt_state, loss)  # evaluates and checkpoints when due
    return run.finish()


if __name__ == "__main__":  # the trainer's library: the command line is main.py's
    raise SystemExit(f"{__file__} holds the trainer; run python -m examples.lm.main (--help)")
