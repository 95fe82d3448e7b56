"""Checkpoints keep every device's residual and the controller, and training continues exactly."""

import jax
import numpy as np
import optax
import pytest
from harness import AXIS, assert_trees_equal, gradient_stream, mesh_of, run_shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco


def optimizer():
    return optax.chain(sidco.compress(0.02, axis_name=AXIS), optax.sgd(0.1, momentum=0.9))


def targets(params, state, devices):
    """Abstract params and state with the shardings of a ``devices``-device mesh."""
    mesh = mesh_of(devices)
    abstract = jax.eval_shape(lambda: (params, state))
    saved = len(jax.tree.leaves(state[0].residual)[0].sharding.device_set)
    shardings = (
        jax.tree.map(lambda _: NamedSharding(mesh, P()), params),
        sidco.state_shardings(state, mesh, AXIS),
    )

    def resize(leaf, residual):
        # Residual leaves stack the devices along their first axis.
        shape = (devices * leaf.shape[0] // saved, *leaf.shape[1:]) if residual else leaf.shape
        return jax.ShapeDtypeStruct(shape, leaf.dtype)

    marks = (jax.tree.map(lambda _: False, params), sidco.is_residual(state))
    shapes = jax.tree.map(resize, abstract, marks)
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes,
        shardings,
    )


@pytest.mark.parametrize("devices", [1, 8])
def test_training_continues_bit_identically_after_a_restore(tmp_path, rng, devices):
    stream = gradient_stream(rng, 10)
    tx = optimizer()
    want_updates, want_states, want_params = run_shard_map(tx, stream, devices)

    _, states, params = run_shard_map(tx, stream[:5], devices)
    sidco.save(tmp_path / "ckpt", (params, states[-1]))
    restored = sidco.restore(tmp_path / "ckpt", targets(params, states[-1], devices))
    assert_trees_equal(restored, (params, states[-1]))
    assert all(r.sharding.spec == P(AXIS) for r in jax.tree.leaves(restored[1][0].residual))
    updates, states, params = run_shard_map(tx, stream[5:], devices, start=restored)

    assert_trees_equal(updates, want_updates[5:])
    assert_trees_equal(states[-1], want_states[-1])
    assert_trees_equal(params, want_params)
    assert int(states[-1][0].count) == 10


@pytest.mark.parametrize("devices", [1, 4])
def test_restoring_on_fewer_devices_keeps_the_owed_update(tmp_path, rng, devices):
    tx = optimizer()
    _, states, params = run_shard_map(tx, gradient_stream(rng, 4))
    sidco.save(tmp_path / "ckpt", (params, states[-1]))
    with pytest.warns(sidco.ResidualWarning, match=f"saved on 8 devices restored on {devices}"):
        got_params, got_state = sidco.restore(
            tmp_path / "ckpt", targets(params, states[-1], devices)
        )
    for old, new in zip(
        jax.tree.leaves(states[-1][0].residual), jax.tree.leaves(got_state[0].residual), strict=True
    ):
        old = np.stack(np.split(np.asarray(old), 8))
        for row in np.split(np.asarray(new), devices):
            np.testing.assert_allclose(row, old.mean(axis=0), rtol=1e-6, atol=1e-7)
        assert len(new.sharding.device_set) == devices
    assert_trees_equal(got_params, params)
    assert_trees_equal(got_state[0]._replace(residual=0), states[-1][0]._replace(residual=0))
    assert_trees_equal(got_state[1], states[-1][1])  # momentum
    run_shard_map(tx, gradient_stream(rng, 2), devices, start=(got_params, got_state))


def test_a_residual_of_another_model_is_refused(tmp_path, rng):
    tx = optimizer()
    _, states, params = run_shard_map(tx, gradient_stream(rng, 1))
    sidco.save(tmp_path / "ckpt", (params, states[-1]))
    target = targets(params, states[-1], 8)
    residual = dict(target[1][0].residual, b=jax.ShapeDtypeStruct((8 * 7,), np.float32))
    bad = target[1][0]._replace(residual=residual)
    target = (target[0], (bad, *target[1][1:]))
    with pytest.raises(ValueError, match="not a whole number of devices' residuals"):
        sidco.restore(tmp_path / "ckpt", target)
