"""Test set-up for every test directory: 8 forced CPU devices, set before JAX starts its backends.

At the root so that ``tests/``, the doctests and the examples' ``train_test.py``
all see the same devices, whichever of them pytest is given.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chex  # after JAX_PLATFORMS: chex imports jax

chex.set_n_cpu_devices(8)  # only sets XLA_FLAGS: no backend has started yet
