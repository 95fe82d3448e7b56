"""CNN image classification, data-parallel, with one sidco_jax compressor.

``train_and_evaluate(config, workdir, compressor)`` trains the model of
``models.py`` on the dataset of ``input_pipeline.py`` and evaluates it on the
test set. Its step, :func:`create_train_step`, is the one to read: each device
takes the gradient of its own shard of the batch, and the compressor, first in
the optax chain, sends the entries that matter and averages them over the
devices. ``main.py`` runs it once per compressor and compares them
(:mod:`examples.common.compare`); what the loop calls around the step
(batches, history, evaluation, checkpoints) is :class:`examples.common.training.Run`.
"""

import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import sidco_jax as sidco
from examples.cnn import input_pipeline, models
from examples.common import parallel, training


def create_task(config) -> training.Task:
    """The classification :class:`~examples.common.training.Task` for ``config``."""
    data = input_pipeline.load(config.dataset, config.data_dir)
    classes = int(data.train_y.max()) + 1
    graphdef, _ = nnx.split(
        models.CNN(data.train_x.shape[-1], classes, config.widths, rngs=nnx.Rngs(0))
    )

    def init(seed):
        model = models.CNN(data.train_x.shape[-1], classes, config.widths, rngs=nnx.Rngs(seed))
        return nnx.split(model)[1]

    def logits(params, x):
        return nnx.merge(graphdef, params)(x)

    def loss(params, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()

    def sample(rng, size):
        index = rng.integers(0, len(data.train_x), size)
        return data.train_x[index], data.train_y[index]

    @jax.jit
    def correct(params, x, y):
        return jnp.sum(jnp.argmax(logits(params, x), -1) == y)

    def evaluate(params, chunk=1000):
        hits = sum(
            int(correct(params, data.test_x[i : i + chunk], data.test_y[i : i + chunk]))
            for i in range(0, len(data.test_x), chunk)
        )
        return hits / len(data.test_x)

    return training.Task(init, loss, sample, evaluate, "accuracy")


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
    """Trains with ``compressor`` for ``config.steps`` steps, evaluating on the test set.

    Args:
      config: the options (``configs/``).
      workdir: where captured gradients go (``--capture-steps``).
      compressor: a name of ``sidco_jax.COMPRESSORS``.
      task: :func:`create_task`'s, if already made (comparing compressors loads the data once).
      options: keywords of :func:`sidco_jax.compressor` (``{"warmup_steps": 50}``, ...).

    Returns:
      The run's history: loss, density and test accuracy over the steps.
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
    raise SystemExit(f"{__file__} holds the trainer; run python -m examples.cnn.main (--help)")
