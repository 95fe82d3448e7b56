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

from examples.common import loop, report
from examples.lm import input_pipeline, models


def task(config) -> loop.Task:
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

    return loop.Task(init, loss, sample, evaluate, "perplexity")


def train_and_evaluate(config, workdir: str | pathlib.Path) -> list[loop.History]:
    """Trains every compressor of ``config``; writes results, summary and plots to ``workdir``."""
    histories = loop.train(config, task(config), workdir)
    summary = report.table(histories, "perplexity", config.ratio)
    (pathlib.Path(workdir) / "summary.md").write_text(summary + "\n")
    report.plots(histories, "perplexity", workdir)
    print(summary)
    return histories
