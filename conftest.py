"""Test set-up for every test directory: 8 forced CPU devices, set before JAX starts its backends.

At the root so that ``tests/``, the doctests and the examples' ``train_test.py``
all see the same devices, whichever of them pytest is given.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite compiles far more than it computes: LLVM's cheaper pipeline cut a
# compile-bound file's time by 30%, and XLA's legacy CPU fusion emitters, which
# compile faster than the default MLIR ones, cut the quick tier's to 0.7x
# (docs/design.md, "The test suite"; they run slower, so they are for the
# suite only). They change the generated machine code, and with it the last bit of
# some float results, never XLA's HLO passes; every bit-for-bit comparison in
# the suite runs under these same flags (the multiprocess workers inherit them),
# and tests/test_default_codegen.py runs the compressors under XLA's defaults.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    + " --xla_cpu_use_fusion_emitters=false"
).strip()

# Many tests compile the same computation through fresh transformation objects,
# which jit's in-memory cache cannot match; JAX's persistent cache keys on the
# computation itself. One directory per run (the multiprocess workers inherit
# it), removed at exit, so no run reads another's entries.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="sidco-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import chex  # after JAX_PLATFORMS: chex imports jax
import pytest

chex.set_n_cpu_devices(8)  # only sets XLA_FLAGS: no backend has started yet


@pytest.fixture(autouse=True)
def _xla_flags_kept():
    """Fails a test that changes ``XLA_FLAGS``: the processes later tests start inherit it,
    and would run other code generation than the suite's (their last bits differ)."""
    flags = os.environ["XLA_FLAGS"]
    yield
    assert os.environ["XLA_FLAGS"] == flags, f"XLA_FLAGS changed: {os.environ['XLA_FLAGS']!r}"
