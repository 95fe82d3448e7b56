"""Dense warm-up: ``warmup_steps`` dense steps, then compression, on every compressor."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    AXIS,
    SELECTING,
    gradient_stream,
    one_of_each_kind,
    params_tree,
    quick_first,
    run_local,
    run_shard_map,
)

import sidco_jax as sidco

WARMUP = 3


def _trees_equal(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# Warm-up is the loop's: one compressor of each kind of rule.
@pytest.mark.parametrize("name", quick_first(one_of_each_kind(SELECTING)))
def test_the_first_steps_are_dense_then_compression_starts_losing_nothing(rng, name):
    stream = gradient_stream(rng, WARMUP + 3)
    tx = sidco.compressor(name, 0.05, warmup_steps=WARMUP)
    updates, states = run_local(tx, stream)
    dense_updates, dense_states = run_local(sidco.dense(), stream)
    zero = sidco.compressor(name, 0.05).init(params_tree())
    for t in range(WARMUP):
        chex.assert_trees_all_equal(updates[t], dense_updates[t], custom_message=f"step {t}")
        m, d = sidco.metrics(states[t]), sidco.metrics(dense_states[t])
        assert int(m["bytes"]) == int(d["bytes"]) == 4 * 2260
        assert float(m["density"]) == 1.0
        assert float(m["target_density"]) == np.float32(0.05)
        assert int(m["step"]) == t + 1
        # The residual and the rule's state are those of a fresh compressor.
        chex.assert_trees_all_equal(states[t].residual, zero.residual)
        chex.assert_trees_all_equal(states[t].rule, zero.rule)
    # Step N compresses: at most the payload's capacity of entries, not the dense mean.
    m = sidco.metrics(states[WARMUP])
    assert float(m["density"]) <= 0.1
    assert int(m["bytes"]) < 4 * 2260
    assert not _trees_equal(updates[WARMUP], dense_updates[WARMUP])
    # Through warm-up and after: sent + new residual == gradient + old residual, bit for bit.
    residual = zero.residual
    for grads, sent, state in zip(stream, updates, states, strict=True):
        jax.tree.map(
            lambda s, r, x, old: np.testing.assert_array_equal(
                np.asarray(s) + np.asarray(r), np.asarray(x) + np.asarray(old)
            ),
            sent,
            state.residual,
            jax.tree.map(lambda x: x[0], grads),
            residual,
        )
        residual = state.residual


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", one_of_each_kind(n for n in SELECTING if not sidco.traits(n).random)
)
def test_after_warmup_a_deterministic_rule_compresses_as_from_a_fresh_start(rng, name):
    stream = gradient_stream(rng, WARMUP + 2)
    updates, states = run_local(sidco.compressor(name, 0.05, warmup_steps=WARMUP), stream)
    fresh, fresh_states = run_local(sidco.compressor(name, 0.05), stream[WARMUP:])
    for t in range(2):
        chex.assert_trees_all_equal(updates[WARMUP + t], fresh[t])
        chex.assert_trees_all_equal(states[WARMUP + t].residual, fresh_states[t].residual)


# One rule of each kind: a threshold, exact top-k, a sampled threshold, shared indices.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sidco-e", "topk", "dgc", "randomk"])
def test_warmup_under_shard_map_equals_dense_then_compresses(rng, name):
    stream = gradient_stream(rng, WARMUP + 1)
    tx = sidco.compressor(name, 0.05, axis_name=AXIS, warmup_steps=WARMUP)
    updates, states, _ = run_shard_map(tx, stream)
    dense_updates, _, _ = run_shard_map(sidco.dense(axis_name=AXIS), stream)
    for t in range(WARMUP):
        chex.assert_trees_all_equal(updates[t], dense_updates[t], custom_message=f"step {t}")
        assert int(sidco.metrics(states[t])["bytes"]) == 4 * 2260
        assert not np.any(jax.tree.leaves(jax.tree.map(np.any, states[t].residual)))
    assert float(sidco.metrics(states[WARMUP])["density"]) <= 0.1
    assert not _trees_equal(updates[WARMUP], dense_updates[WARMUP])


def test_warmup_compiles_one_step_for_every_count(rng):
    tx = sidco.compress(0.05, warmup_steps=2)
    traces = []

    @jax.jit
    def step(g, state):
        traces.append(1)
        return tx.update(g, state)

    state = tx.init(params_tree())
    for grads in gradient_stream(rng, 4):
        _, state = step(jax.tree.map(lambda x: x[0], grads), state)
    assert len(traces) == 1


def test_the_step_count_saturates_rather_than_wrap_back_into_warmup(rng):
    g = {"w": jnp.asarray(rng.normal(size=100), jnp.float32), "n": jnp.int32(1)}
    last = 2**31 - 1
    for tx, grads, sent in (
        (sidco.topk(0.1, warmup_steps=WARMUP), g, 10),  # compressed, not the dense warm-up
        (sidco.topk(0.1), {"n": g["n"]}, None),  # no floating-point leaf: counted all the same
    ):
        state = tx.init(grads)._replace(count=jnp.int32(last - 1))
        update = jax.jit(tx.update)
        for _ in range(3):
            out, state = update(grads, state)
            assert int(state.count) == last
            if sent is not None:
                assert int(jnp.count_nonzero(out["w"])) == sent


@pytest.mark.parametrize("name", SELECTING)
@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (-1, ValueError, r"warmup_steps must be an integer in \[0, 2\*\*31 - 1\], got -1"),
        (1.5, TypeError, r"warmup_steps must be an integer in \[0, 2\*\*31 - 1\], got 1.5"),
        (True, TypeError, r"warmup_steps must be an integer in \[0, 2\*\*31 - 1\], got True"),
        ("10", TypeError, r"warmup_steps must be an integer in \[0, 2\*\*31 - 1\], got '10'"),
    ],
)
def test_a_bad_warmup_is_refused_at_construction(name, value, error, message):
    with pytest.raises(error, match=message):
        sidco.compressor(name, 0.05, warmup_steps=value)


def test_every_compressor_takes_every_loop_option():
    # The loop's options are defined once, and every factory's signature lists them.
    loop = set(sidco.typing.LoopOptions.__annotations__)
    for name in sidco.COMPRESSORS:
        assert loop <= set(sidco.traits(name).options), name
