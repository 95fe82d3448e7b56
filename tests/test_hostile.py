"""Hostile gradients and states: each test reproduces a defect found by probing the public API."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    AXIS,
    DEVICES,
    gradient_stream,
    mesh_of,
    params_tree,
    per_device_step,
    quick_first,
    run_local,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco


def steps(tx, grads, state=None, count=1):
    """``count`` jitted updates of ``grads``; returns the updates and states after each."""
    state = tx.init(grads) if state is None else state
    update = jax.jit(tx.update)
    out = []
    for _ in range(count):
        sent, state = update(grads, state)
        out.append((sent, state))
    return out


def assert_no_loss(grads, before, sent, after):
    """Error feedback: what was sent plus what is left is the gradient plus what was owed."""
    for g, r0, s, r1 in zip(
        jax.tree.leaves(grads),
        jax.tree.leaves(before.residual),
        jax.tree.leaves(sent),
        jax.tree.leaves(after.residual),
        strict=True,
    ):
        owed = np.asarray(g, np.float32).reshape(r0.shape) + np.asarray(r0)
        got = np.asarray(s, np.float32).reshape(r1.shape) + np.asarray(r1)
        np.testing.assert_array_equal(got, owed)


@pytest.mark.parametrize(("dtype", "value"), [(jnp.float16, 40000.0), (jnp.bfloat16, 3e38)])
def test_a_half_precision_update_saturates_and_keeps_the_rest(dtype, value):
    # Defect 1: an accumulated residual above the leaf's range was sent as inf,
    # the residual became -inf, and every later step was skipped.
    grads = {"w": jnp.full(8, value, dtype)}
    tx = sidco.topk(0.25)
    state = tx.init(grads)
    top = float(jnp.finfo(dtype).max)
    for _ in range(6):
        before = state
        sent, state = jax.jit(tx.update)(grads, state)
        m = sidco.metrics(state)
        assert np.all(np.isfinite(np.asarray(sent["w"], np.float32)))
        assert np.all(np.abs(np.asarray(sent["w"], np.float32)) <= top)
        assert not bool(m["nonfinite"]) and float(m["density"]) == 0.25
        assert np.all(np.isfinite(state.residual["w"]))
        if dtype == jnp.float16:  # float32 holds every sum here: nothing is lost
            assert_no_loss(grads, before, sent, state)


def test_a_nonfinite_residual_is_dropped_reported_and_training_goes_on():
    # Defect 2: a NaN in the residual (a bad checkpoint, a user's state) made
    # every later step "non-finite": nothing was ever sent again.
    g = jnp.arange(100.0) - 50.0
    tx = sidco.compress(0.1)
    state = tx.init(g)
    state = state._replace(residual=state.residual.at[3].set(jnp.nan).at[7].set(-jnp.inf))
    ((sent, state),) = steps(tx, g, state)  # counted, not warned about (see test_checkpoint)
    m = sidco.metrics(state)
    assert int(m["dropped"]) == 2 and not bool(m["nonfinite"]) and float(m["density"]) > 0
    assert np.all(np.isfinite(sent)) and np.all(np.isfinite(state.residual))
    # The gradient of that step is kept whole: only the bad residual entries are lost.
    np.testing.assert_array_equal(np.asarray(sent) + np.asarray(state.residual), np.asarray(g))
    ((_, state),) = steps(tx, g, state)
    assert int(sidco.metrics(state)["dropped"]) == 0


def run_8_devices(tx, grads):
    """One step on 8 devices (``grads`` with a leading device axis); per-device updates."""
    mesh = mesh_of(DEVICES)
    params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)
    state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
    grads = jax.device_put(grads, NamedSharding(mesh, P(AXIS)))
    return per_device_step(tx, mesh, state)(state, grads)


@pytest.mark.parametrize("name", ["sidco-e", "topk", "dense"])
def test_complex_leaves_are_averaged_densely_over_the_axis(name, rng):
    # Defect 3: complex leaves were left out of the collective: replicas diverged.
    shape = (DEVICES, 6)
    grads = {
        "c": (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(np.complex64),
        "w": rng.normal(size=(DEVICES, 50)).astype(np.float32),
    }
    updates, _ = run_8_devices(sidco.compressor(name, 0.1, axis_name=AXIS), grads)
    got = np.asarray(updates["c"])
    np.testing.assert_allclose(got, np.broadcast_to(grads["c"].mean(0), got.shape), rtol=1e-6)
    assert np.all(got == got[:1])  # bit-identical replicas


def test_complex_leaves_follow_the_nonfinite_gate():
    grads = {"c": jnp.full(4, 1 + 1j, jnp.complex64), "w": jnp.arange(10.0)}
    tx = sidco.compress(0.2)
    ((sent, state),) = steps(tx, {**grads, "c": grads["c"].at[0].set(jnp.nan)})
    assert bool(sidco.metrics(state)["nonfinite"]) and not np.any(np.asarray(sent["c"]))
    ((sent, state),) = steps(tx, grads, state)
    np.testing.assert_array_equal(sent["c"], grads["c"])


def test_dense_skips_nonfinite_steps_on_every_device(rng):
    # Defect 4: dense() let NaN through while reporting nonfinite.
    grads = rng.normal(size=(DEVICES, 20)).astype(np.float32)
    grads[3, 2] = np.inf
    updates, state = run_8_devices(sidco.dense(axis_name=AXIS), grads)
    assert not np.any(np.asarray(updates)) and bool(np.asarray(state.last.nonfinite))


@pytest.mark.parametrize("communication", quick_first(["sparse_allreduce", "sparse", "dense"]))
def test_large_finite_gradients_on_every_device_give_a_finite_update(communication):
    # The sparse all-reduce's owners summed the devices' values before dividing: 8 x 1e38
    # gave an infinite update and a non-finite residual, with the nonfinite flag down.
    grads = {"w": np.full((DEVICES, 64), 1e38, np.float32)}
    tx = sidco.compress(0.25, axis_name=AXIS, communication=communication)
    updates, state = run_8_devices(tx, grads)
    np.testing.assert_allclose(np.asarray(updates["w"]).max(), 1e38, rtol=1e-6)
    assert np.all(np.isfinite(updates["w"])) and np.all(np.isfinite(state.residual["w"]))
    assert not bool(np.asarray(state.last.nonfinite).any())


def zeros(**shapes):
    """A tree of float32 zeros; an int shape entry ``("int", n)`` gives an int32 leaf."""
    return {
        k: jnp.zeros(v[1], jnp.int32) if v[0] == "int" else jnp.zeros(v, jnp.float32)
        for k, v in shapes.items()
    }


@pytest.mark.parametrize(
    ("seen", "given", "tree", "buckets"),
    [
        (
            zeros(a=(10,), b=(5,)),
            zeros(a=(5,), b=(10,)),  # as many entries
            r"\['a'\].*\(5,\).*init saw.*\(10,\)",
            r"init saw: leaf a is \(5,\) float32, not \(10,\)",
        ),
        (
            zeros(a=(10,), b=(5,)),
            zeros(a=(10,), b=(6,)),
            r"\['b'\].*\(6,\).*init saw.*\(5,\)",
            r"init saw: leaf b is \(6,\)",
        ),
        (
            zeros(a=(10,), b=(5,)),
            zeros(a=(10,), c=(5,)),
            r"structure.*does not match.*init",
            "init saw: leaf c stands where b was",
        ),
        (zeros(a=(10,)), zeros(a=(10,), b=(5,)), "structure.*does not match.*init", "b is new"),
        (
            zeros(a=(4,), i=("int", 3)),
            zeros(a=(4,), i=(3,)),
            r"\['i'\].*float32.*init saw a non-",
            "init saw: leaf i is new",
        ),
    ],
)
@pytest.mark.parametrize("layout", ["tree", "buckets"])
def test_a_gradient_tree_unlike_the_one_given_to_init_is_refused(
    seen, given, tree, buckets, layout
):
    # Defect 5: the same total size silently applied the residual to the wrong entries.
    for name in ["sidco-e", "topk", "randomk"]:
        tx = sidco.compressor(name, 0.1, layout=layout)
        state = tx.init(seen)
        with pytest.raises(ValueError, match=tree if layout == "tree" else buckets):
            tx.update(given, state)


def test_all_equal_gradients_are_sent_round_robin():
    # Defect 6: jnp.ones(10000) for 30 steps sent nothing (every compressor but
    # top-k and random-k; the conformance grid checks each at step 1).
    grads = jnp.ones(10000)
    tx = sidco.compress(0.01)
    state = tx.init(grads)
    sent_total = np.zeros(10000, np.float32)
    for _ in range(30):
        before = state
        sent, state = jax.jit(tx.update)(grads, state)
        assert_no_loss(grads, before, sent, state)
        assert float(sidco.metrics(state)["density"]) == np.float32(0.01)
        sent_total += np.asarray(sent)
    # The ties fill the payload in index order, so the residual is sent round robin.
    assert np.count_nonzero(sent_total) == 3000


def test_gaussiank_statistics_are_scale_free(rng):
    # Defect 7: the variance of 1e20-scale gradients overflowed: nothing was sent.
    g = rng.normal(size=4000).astype(np.float32)
    tx = sidco.gaussiank(0.01)
    update = jax.jit(tx.update)
    densities = []
    for scale in [1.0, 1e20, 1e-20]:
        _, state = update(g * np.float32(scale), tx.init(g))
        assert not bool(sidco.metrics(state)["nonfinite"])
        densities.append(float(sidco.metrics(state)["density"]))
    assert densities[0] > 0.005 and densities == [densities[0]] * 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "granularity"),
    [("topk", "leaf"), ("dgc", "leaf"), ("redsync", "model"), ("randomk", "leaf")],
)
def test_zero_size_leaves_take_no_part(name, granularity, rng):
    # Defect 8: zero-size leaves crashed top-k, DGC, RedSync and random-k
    # (the conformance grid runs every compressor with one).
    options = {"granularity": granularity}
    grads = {"a": rng.normal(size=200).astype(np.float32), "z": jnp.zeros((0, 3))}
    tx = sidco.compressor(name, 0.1, **options)
    alone = sidco.compressor(name, 0.1, **options)
    ((sent, state),) = steps(tx, grads)
    ((want, want_state),) = steps(alone, {"a": grads["a"]})
    np.testing.assert_array_equal(sent["a"], want["a"])
    assert sent["z"].shape == (0, 3) and not bool(sidco.metrics(state)["nonfinite"])
    assert float(sidco.metrics(state)["density"]) == float(sidco.metrics(want_state)["density"])


def test_only_zero_size_leaves_is_a_no_op():
    grads = {"z": jnp.zeros((0,))}
    for name in sidco.COMPRESSORS:
        ((sent, state),) = steps(sidco.compressor(name, 0.1), grads)
        assert sent["z"].shape == (0,) and int(state.count) == 1


def test_an_unbound_axis_name_says_what_to_do():
    # Defect 11: NameError: unbound axis name, from deep inside psum.
    tx = sidco.compress(0.1, axis_name="data")
    g = jnp.ones(10)
    with pytest.raises(NameError, match=r"'data'.*jax.shard_map or jax.pmap.*axis_name=None"):
        tx.update(g, tx.init(g))


def test_more_than_2_31_entries_are_refused_with_a_clear_error():
    tx = sidco.compress(0.01)
    big = {
        "a": jax.ShapeDtypeStruct((2**30,), jnp.float32),
        "b": jax.ShapeDtypeStruct((2**30,), jnp.float32),
    }
    with pytest.raises(ValueError, match=r"2147483648 floating-point entries.*at most 2\*\*31 - 1"):
        jax.eval_shape(tx.init, big)


# Quick with top-k (SIDCo's update is the slowest op by op); every compressor in the slow tier.
@pytest.mark.parametrize("name", quick_first(sorted(sidco.COMPRESSORS, key="topk".__ne__)))
def test_the_update_runs_under_disable_jit_as_it_does_jitted(name, rng):
    # Defect: under jax.disable_jit() SIDCo's later stages failed with "'int' object
    # has no attribute 'astype'": lax.fori_loop hands its body a Python int then.
    tx = sidco.compressor(name, 0.05)
    stream = gradient_stream(rng, 2)
    want_updates, want_states = run_local(tx, stream)
    state = tx.init(params_tree())
    with jax.disable_jit():
        for grads, want_update, want_state in zip(stream, want_updates, want_states, strict=True):
            update, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
            chex.assert_trees_all_equal(update, want_update)
            chex.assert_trees_all_equal(state.residual, want_state.residual)
            # A figure that a division makes (a density, the stage controller's window) may
            # round apart by a unit in the last place: compiled, XLA multiplies by the
            # reciprocal of a divisor that it knows; op by op, it divides.
            for got, want in zip(
                jax.tree.leaves(state._replace(residual=None)),
                jax.tree.leaves(want_state._replace(residual=None)),
                strict=True,
            ):
                if jnp.issubdtype(want.dtype, jnp.floating):
                    np.testing.assert_array_max_ulp(np.asarray(got), np.asarray(want), maxulp=1)
                else:
                    np.testing.assert_array_equal(got, want)
    assert any(np.count_nonzero(u) for u in jax.tree.leaves(want_updates[-1]))
