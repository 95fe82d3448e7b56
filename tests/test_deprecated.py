"""Renamed public functions: the old name warns, naming the new one, and gives what it gives."""

import jax.numpy as jnp
import pytest

import sidco_jax as sidco


def test_costs_messages_is_rounds():
    with pytest.warns(DeprecationWarning, match="renamed sidco.costs.rounds"):
        old = sidco.costs.messages("sparse_allreduce", 8)
    assert old == sidco.costs.rounds("sparse_allreduce", 8) == 14


def test_parallel_is_residual_is_is_per_device():
    tx = sidco.accumulate(sidco.compress(0.5), 2)
    state = tx.init({"w": jnp.zeros(4)})
    with pytest.warns(DeprecationWarning, match="renamed sidco.parallel.is_per_device"):
        old = sidco.parallel.is_residual(state)
    assert old == sidco.parallel.is_per_device(state)
