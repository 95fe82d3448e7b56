"""Test set-up for every test directory: 8 forced CPU devices, set before JAX starts its backends.

At the root so that ``tests/``, the doctests and the examples' ``train_test.py``
all see the same devices, whichever of them pytest is given.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles far more than it computes: LLVM's cheaper pipeline cut a
# compile-bound file's time by 30%. It changes the generated machine code, and
# with it the last bit of some float results, never XLA's HLO passes; every
# bit-for-bit comparison in the suite runs under these same flags (the
# multiprocess workers inherit them).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()

import chex  # after JAX_PLATFORMS: chex imports jax

chex.set_n_cpu_devices(8)  # only sets XLA_FLAGS: no backend has started yet
