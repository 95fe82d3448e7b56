"""A character-level LSTM language model in Flax NNX (the paper's LSTM benchmark, small)."""

import itertools

import jax.numpy as jnp
from flax import nnx


class LSTM(nnx.Module):
    """Embedding, ``layers`` stacked LSTMs, and a linear read-out to the vocabulary."""

    def __init__(self, vocab: int, embed: int, hidden: int, layers: int = 1, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, embed, rngs=rngs)
        sizes = [embed] + [hidden] * layers
        self.layers = nnx.List(
            [
                nnx.RNN(nnx.OptimizedLSTMCell(a, b, rngs=rngs), rngs=False)
                for a, b in itertools.pairwise(sizes)
            ]
        )
        self.out = nnx.Linear(hidden, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            # An explicit zero carry: the cell's own initializer draws from RNG state,
            # which would be mutated inside the jitted step. Built from x so that it
            # varies across devices like x under shard_map.
            zero = jnp.zeros_like(x[..., 0, :1]) + jnp.zeros(layer.cell.hidden_features, x.dtype)
            x = layer(x, initial_carry=(zero, zero))
        return self.out(x)
