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

from examples.cnn import input_pipeline, models
from examples.common import loop, report


def task(config) -> loop.Task:
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


def train_and_evaluate(config, workdir: str | pathlib.Path) -> list[loop.History]:
    """Trains every compressor of ``config``; writes results, summary and plots to ``workdir``."""
    histories = loop.train(config, task(config), workdir)
    summary = report.table(histories, "accuracy", config.ratio)
    (pathlib.Path(workdir) / "summary.md").write_text(summary + "\n")
    report.plots(histories, "accuracy", workdir)
    print(summary)
    return histories
