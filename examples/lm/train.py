"""Character-level LSTM language model, data-parallel with a sidco_jax compressor (library).

``train_and_evaluate(config, workdir)`` trains ``models.LSTM`` on the text of
``input_pipeline.py`` once per compressor of the config, with the same
batches and seed, and reports validation perplexity (per character).
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sidco_jax as sidco
from examples.common import loop, parallel, report
from examples.lm import input_pipeline, models


def create_task(config) -> loop.Task:
    """The language-modelling :class:`~examples.common.loop.Task` for ``config``."""
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

    return loop.Task(init, loss, sample, evaluate, "perplexity", held_out="validation")


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
