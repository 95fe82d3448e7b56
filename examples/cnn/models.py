"""A small ResNet-style CNN in Flax NNX (GroupNorm: no batch statistics to synchronise)."""

import jax
from flax import nnx


class Block(nnx.Module):
    """Two 3x3 convolutions with a residual connection (a 1x1 projection when shapes change)."""

    def __init__(self, channels_in: int, channels: int, stride: int, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(channels_in, channels, (3, 3), strides=stride, rngs=rngs)
        self.norm1 = nnx.GroupNorm(channels, num_groups=min(8, channels), rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), rngs=rngs)
        self.norm2 = nnx.GroupNorm(channels, num_groups=min(8, channels), rngs=rngs)
        self.project = (
            nnx.Conv(channels_in, channels, (1, 1), strides=stride, rngs=rngs)
            if stride != 1 or channels_in != channels
            else None
        )

    def __call__(self, x):
        y = jax.nn.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return jax.nn.relu(y + (x if self.project is None else self.project(x)))


class CNN(nnx.Module):
    """Stem, ``len(widths)`` residual stages (stride 2 after the first), mean pool, classifier."""

    def __init__(self, channels_in: int, classes: int, widths=(32, 64), *, rngs: nnx.Rngs):
        self.stem = nnx.Conv(channels_in, widths[0], (3, 3), rngs=rngs)
        blocks, width = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(Block(width, w, 1 if i == 0 else 2, rngs=rngs))
            width = w
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))
