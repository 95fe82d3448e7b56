"""CNN image classification, data-parallel with a sidco_jax compressor (library code).

``train_and_evaluate(config, workdir)`` trains the model of ``models.py`` on
the dataset of ``input_pipeline.py`` once per compressor of the config, with
the same batches and seed, and writes ``results.json``, a summary table
(``summary.md``), plots and, at ``capture_steps``, whole-model gradients.
"""

import pathlib

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import sidco_jax as sidco
from examples.cnn import input_pipeline, models
from examples.common import loop, parallel, report


def create_task(config) -> loop.Task:
    """The classification :class:`~examples.common.loop.Task` for ``config``."""
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

    return loop.Task(init, loss, sample, evaluate, "accuracy")


def create_optimizer(
    config, compressor: str, axis_name: str | None = parallel.AXIS
) -> optax.GradientTransformation:
    """The compressor, averaging over the devices of ``axis_name``, then SGD with momentum.

    ``axis_name=None`` gives the same optimizer on one device, with no communication.
    """
    return optax.chain(
        sidco.compressor(compressor, config.ratio, axis_name=axis_name),
        optax.sgd(config.learning_rate, momentum=config.momentum),
    )


def train_and_evaluate(config, workdir: str | pathlib.Path) -> list[loop.History]:
    """Trains every compressor of ``config``; writes results, summary and plots to ``workdir``."""
    workdir = pathlib.Path(workdir)
    task = create_task(config)
    mesh = parallel.mesh(config.devices)
    histories = []
    for name in config.compressors:
        tx = create_optimizer(config, name)
        params = sidco.place(task.init(config.seed), mesh)  # replicated on every device
        opt_state = sidco.shard_init(tx, params, mesh, parallel.AXIS)  # a residual per device
        # Per device: gradient of its shard of the batch, compressed update, apply.
        train_step = sidco.data_parallel_step(
            task.loss, tx, opt_state, mesh, parallel.AXIS, donate_state=True
        )
        histories.append(loop.fit(config, task, name, train_step, params, opt_state, mesh, workdir))
    report.write(config, task, histories, workdir)
    return histories
