"""Character-level language model, data-parallel, with one sidco_jax compressor.

``train_and_evaluate(config, workdir, compressor)`` trains ``models.LSTM`` (or,
with ``--model transformer``, ``models.Transformer``) on the text of
``input_pipeline.py`` and reports validation perplexity (per character).
With ``--shard-params`` on a mesh of nodes the parameters and the optimizer
state are sharded over each node's devices (FSDP within a node) and each
device compresses its shard across the nodes. Its step is the library's,
:func:`sidco_jax.parallel.data_parallel_step`: each device takes the gradient
of its own shard of the batch, and the compressor, first in the optax chain,
sends the entries that matter and averages them over the devices
(``examples/cnn/train.py`` writes the same step out). ``main.py`` runs it once
per compressor and compares them
(:mod:`examples.common.compare`); what the loop calls around the step
(batches, history, evaluation, checkpoints) is :class:`examples.common.training.Run`.
"""

import pathlib

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
        rngs = nnx.Rngs(seed)
        if config.model == "transformer":
            width, heads, sequence = config.embed, config.heads, config.sequence
            return models.Transformer(vocab, width, heads, config.layers, sequence, rngs=rngs)
        return models.LSTM(vocab, config.embed, config.hidden, config.layers, rngs=rngs)

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


def train_and_evaluate(
    config,
    workdir: str | pathlib.Path,
    compressor: str = "sidco-e",
    *,
    task: training.Task | None = None,
    options: dict | None = None,
) -> training.History:
    """Trains with ``compressor`` for ``config.steps`` steps, evaluating on the validation set.

    The arguments and the history are :func:`examples.cnn.train.train_and_evaluate`'s, with
    validation perplexity for test accuracy.
    """
    task = create_task(config) if task is None else task
    mesh = parallel.mesh(config.devices, config.nodes)
    # With --nodes: compressed across the nodes only; with --shard-params each device holds
    # and compresses its shard of the parameters (None: every device holds them whole).
    axes = parallel.compressor_axes(mesh, config.shard_params)
    params = task.init(config.seed)
    specs = parallel.param_specs(params, mesh) if config.shard_params else None
    tx = training.create_optimizer(config, compressor, **axes, **(options or {}))
    params = sidco.parallel.place(params, mesh, specs)
    opt_state = sidco.parallel.shard_init(tx, params, mesh, mesh.axis_names, specs)
    local = bool(config.outer_every)  # outer steps: each device trains its own copy,
    if local:  # or with --shard-params each node its own, sharded over its devices
        copies = parallel.NODE if specs is not None else mesh.axis_names
        params = sidco.parallel.per_device(task.init(config.seed), mesh, copies, specs)
    # The library's step: each device's gradient of its shard of the batch, then the
    # compressor's update (averaged over the mesh) and SGD; the state is updated in place.
    train_step = sidco.parallel.data_parallel_step(
        task.loss,
        tx,
        opt_state,
        mesh,
        mesh.axis_names,
        local_params=local,
        param_specs=specs,
        donate_state=True,
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
