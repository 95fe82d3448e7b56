"""Test fixtures; the 8 forced CPU devices are set up in the root ``conftest.py``."""

import jax
import numpy as np
import pytest


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, jax.devices()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def samples(rng):
    """Synthetic gradients of the shapes the paper discusses."""
    n = 2**18
    sign = rng.choice([-1.0, 1.0], n)
    return {
        "laplace": rng.laplace(size=n),
        "student_t3": rng.standard_t(3, size=n),
        "normal": rng.normal(size=n),
        "gamma0.3": sign * rng.gamma(0.3, size=n),
    }
