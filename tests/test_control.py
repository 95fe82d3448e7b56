import math

import chex
import jax
import jax.numpy as jnp
import pytest
from harness import AXIS, copies, gradient_stream, run_shard_map

import sidco_jax as sidco
from sidco_jax._src import control


def run(rule, response, windows, stages=3, max_stages=6, period=5):
    """Closes the loop: each step reports ``response(stages)``; returns stages per window."""
    adapt = jax.jit(
        lambda s, c, r: control.adapt(
            s, c, r, rule=rule, period=period, band=0.2, max_stages=max_stages
        )
    )
    s, c = jnp.int32(stages), control.init()
    out = []
    for _ in range(windows):
        for _ in range(period):
            s, c = adapt(s, c, jnp.float32(response(int(s))))
        out.append(int(s))
    return out


def test_paper_rule_moves_one_stage_per_window_and_clamps():
    assert run("paper", lambda m: 3.0, 4) == [2, 1, 1, 1]
    assert run("paper", lambda m: 0.1, 5) == [4, 5, 6, 6, 6]
    assert run("paper", lambda m: 1.15, 3) == [3, 3, 3]  # inside the band


def test_directional_rule_reverses_after_a_move_that_did_not_help():
    # Data on which more stages lower the count: the paper rule runs the wrong way.
    fewer_is_better = {1: 1.0, 2: 0.7, 3: 0.5, 4: 0.3, 5: 0.2, 6: 0.1}.get
    assert run("paper", fewer_is_better, 5) == [4, 5, 6, 6, 6]
    assert run("directional", fewer_is_better, 5) == [4, 3, 2, 1, 1]
    # One stage over-selects: the paper rule asks for fewer stages and is stuck.
    over = {1: 4.0, 2: 2.5, 3: 1.5, 4: 1.1, 5: 1.0, 6: 1.0}.get
    assert run("paper", over, 5, stages=1) == [1, 1, 1, 1, 1]
    assert run("directional", over, 5, stages=1) == [1, 2, 3, 4, 4]


def test_partial_window_does_not_decide():
    adapt = lambda s, c, r: control.adapt(s, c, r, rule="paper", period=5, band=0.2, max_stages=6)  # noqa: E731
    s, c = jnp.int32(3), control.init()
    for _ in range(4):
        s, c = adapt(s, c, jnp.float32(10.0))
    assert int(s) == 3 and int(c.steps) == 4


def test_changing_stage_count_never_recompiles(rng):
    tx = sidco.compress(0.01, adaptation="paper", stages=1, period=1)
    g = rng.standard_t(3, size=20_000).astype("float32")

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, g):
        return tx.update(g, state)[1]

    state = tx.init(g)
    seen = set()
    for _ in range(6):
        state = step(state, g)
        seen.add(int(state.rule.stages))
    assert len(seen) > 1


def test_rule_names_are_checked():
    with pytest.raises(ValueError, match="adaptation must be None or one of"):
        sidco.compress(0.01, adaptation="fast")


def test_fill_steers_the_selection_to_a_little_above_capacity():
    # A plant with the count falling as threshold**-5: the factor settles where
    # selected == FILL_AIM x capacity, i.e. log factor = log(2 / 1.1) / 5.
    fill = jax.jit(control.fill)
    scale = jnp.float32(0.0)
    for _ in range(400):
        scale = fill(scale, 2.0 * jnp.exp(-5.0 * scale), jnp.bool_(False))
    assert float(scale) == pytest.approx(math.log(2.0 / control.FILL_AIM) / 5.0, rel=1e-3)


def test_fill_moves_at_most_gain_x_clip_per_step_and_not_on_a_skipped_step():
    step = control.FILL_GAIN * control.FILL_STEP
    assert float(control.fill(jnp.float32(0.0), jnp.float32(1e9), jnp.bool_(False))) == (
        pytest.approx(step)
    )
    assert float(control.fill(jnp.float32(0.0), jnp.float32(0.0), jnp.bool_(False))) == (
        pytest.approx(-step)
    )
    assert float(control.fill(jnp.float32(0.3), jnp.float32(1e9), jnp.bool_(True))) == (
        pytest.approx(0.3)
    )
    top = jnp.float32(control.FILL_LIMIT)
    assert float(control.fill(top, jnp.float32(1e9), jnp.bool_(False))) == control.FILL_LIMIT


def test_fill_factor_scales_the_threshold_without_recompiling(rng):
    tx = sidco.compress(0.01, adaptation="fill")
    paper = sidco.compress(0.01, adaptation="paper")
    g = rng.standard_t(3, size=20_000).astype("float32")

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, g):
        return tx.update(g, state)[1]

    state, reference = tx.init(g), paper.init(g)
    assert float(state.rule.scale) == 0.0
    # With a zero factor the first step is the paper rule's, threshold included.
    state = step(state, g)
    reference = paper.update(g, reference)[1]
    assert float(state.last.threshold) == float(reference.last.threshold)
    scales = {float(state.rule.scale)}
    for _ in range(5):
        state = step(state, g)
        scales.add(float(state.rule.scale))
    assert len(scales) > 1
    # The factor multiplies the fitted threshold of the next step.
    scaled = state.rule._replace(scale=jnp.float32(0.5))
    unscaled = state.rule._replace(scale=jnp.float32(0.0))
    eta = [
        float(tx.update(g, state._replace(rule=rule))[1].last.threshold)
        for rule in (scaled, unscaled)
    ]
    assert eta[0] == pytest.approx(eta[1] * math.exp(0.5), rel=1e-6)


def test_fill_factor_is_the_same_on_every_device(rng):
    tx = sidco.compress(0.01, adaptation="fill", axis_name=AXIS)
    _, states, _ = run_shard_map(tx, gradient_stream(rng, 6))
    scales = [copies(s.rule.scale) for s in states]
    assert len({float(x) for x in scales[-1]}) == 1
    assert len({float(s[0]) for s in scales}) > 1  # it moved
