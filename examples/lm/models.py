"""Character-level language models in Flax NNX: the paper's LSTM benchmark, small, and a
GPT-style transformer."""

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


class Block(nnx.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each added back."""

    def __init__(self, embed: int, heads: int, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.LayerNorm(embed, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, embed, decode=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(embed, rngs=rngs)
        self.up = nnx.Linear(embed, 4 * embed, rngs=rngs)
        self.down = nnx.Linear(4 * embed, embed, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.attention_norm(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class Transformer(nnx.Module):
    """A GPT-style decoder: token and position embeddings, ``layers`` blocks, and the token
    embedding read back out (tied, as GPT-2 does)."""

    def __init__(
        self, vocab: int, embed: int, heads: int, layers: int, sequence: int, *, rngs: nnx.Rngs
    ):
        self.embed = nnx.Embed(vocab, embed, rngs=rngs)
        self.position = nnx.Embed(sequence, embed, rngs=rngs)
        self.blocks = nnx.List([Block(embed, heads, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(embed, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[-1]))
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))
