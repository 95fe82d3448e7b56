"""Test set-up for every test directory: 8 forced CPU devices, set before JAX starts its backends.

At the root so that ``tests/``, the doctests and the examples' ``train_test.py``
all see the same devices, whichever of them pytest is given.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
