import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    AXIS,
    DEVICES,
    copies,
    gradient_stream,
    mesh_of,
    params_tree,
    quick_first,
    run_shard_map,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco
from sidco_jax._src.rules import control


def run(adaptation, response, windows, stages=3, max_stages=6, period=5):
    """Closes the loop: each step reports ``response(stages)``; returns stages per window."""
    adapt = jax.jit(
        lambda s, c, r: control.adapt(
            s, c, r, adaptation=adaptation, period=period, band=0.2, max_stages=max_stages
        )
    )
    s, c = jnp.int32(stages), control.init()
    out = []
    for _ in range(windows):
        for _ in range(period):
            s, c = adapt(s, c, jnp.float32(response(int(s))))
        out.append(int(s))
    return out


def test_paper_adaptation_moves_one_stage_per_window_and_clamps():
    assert run("paper", lambda m: 3.0, 4) == [2, 1, 1, 1]
    assert run("paper", lambda m: 0.1, 5) == [4, 5, 6, 6, 6]
    assert run("paper", lambda m: 1.15, 3) == [3, 3, 3]  # inside the band


def test_directional_rule_reverses_after_a_move_that_did_not_help():
    # Data on which more stages lower the count: the paper adaptation runs the wrong way.
    fewer_is_better = {1: 1.0, 2: 0.7, 3: 0.5, 4: 0.3, 5: 0.2, 6: 0.1}.get
    assert run("paper", fewer_is_better, 5) == [4, 5, 6, 6, 6]
    assert run("directional", fewer_is_better, 5) == [4, 3, 2, 1, 1]
    # One stage over-selects: the paper adaptation asks for fewer stages and is stuck.
    over = {1: 4.0, 2: 2.5, 3: 1.5, 4: 1.1, 5: 1.0, 6: 1.0}.get
    assert run("paper", over, 5, stages=1) == [1, 1, 1, 1, 1]
    assert run("directional", over, 5, stages=1) == [1, 2, 3, 4, 4]


def test_stage_rules_average_what_was_sent_not_what_was_selected():
    # docs/optax.md: the payload caps what is sent at capacity_factor x target,
    # so with the default factor of 1 a threshold that over-selects reads as on
    # target and the count only rises; the reference code averages the selection.
    from sidco_jax._src.loop.sparsifier import step_metrics
    from sidco_jax._src.rules import sidco as sidco_lib

    n, ratio, capacity = 10_000, 0.01, 100
    for factor, over_selected_moves_to in ((1.0, 3), (2.0, 2)):
        rule = sidco_lib.rule(
            ratio,
            estimator="exponential",
            stages=3,
            adaptation="paper",
            first_ratio=0.25,
            capacity_factor=factor,
            period=1,
            band=0.2,
        )
        figures = functools.partial(
            step_metrics, ratio, n=n, eta=jnp.float32(1.0), message=0, finite=jnp.bool_(True)
        )
        full = figures(round(factor * capacity), 3 * capacity)  # 3x the target selected
        assert int(rule.observe(rule.init(None), full).stages) == over_selected_moves_to
        half = figures(capacity // 2, capacity // 2)
        assert int(rule.observe(rule.init(None), half).stages) == 4


def test_partial_window_does_not_decide():
    def adapt(s, c, r):
        return control.adapt(s, c, r, adaptation="paper", period=5, band=0.2, max_stages=6)

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


@pytest.mark.parametrize(
    ("scale", "settles"),
    [
        (0.3, math.log(0.3) / 5.0),  # never fills: lowered until it does
        (2.0, 0.0),  # fills, under FILL_OVER x capacity: left alone
        (10.0, math.log(10.0 / control.FILL_OVER) / 5.0),  # far too many: raised
    ],
)
def test_fill_factor_moves_only_outside_the_band_the_bracket_handles(scale, settles):
    # A plant whose selection falls as threshold**-5 from `scale` x capacity.
    fill = jax.jit(control.fill)
    log_factor = jnp.float32(0.0)
    for _ in range(400):
        log_factor = fill(log_factor, scale * jnp.exp(-5.0 * log_factor), jnp.bool_(False))
    assert float(log_factor) == pytest.approx(settles, abs=1e-3)


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


@pytest.mark.parametrize("law", ["student_t3", "normal", "gamma0.3"])
@pytest.mark.parametrize("capacity", [10, 200, 3000])
def test_bracket_takes_the_highest_threshold_that_fills_the_payload(samples, law, capacity):
    x = np.abs(samples[law][:40_000]).astype(np.float32)
    fitted = float(np.sort(x)[-capacity])  # so that the answer lies inside the bracket
    for eta in (fitted * 0.6, fitted, fitted * 1.7):
        chosen, count = control.bracket([jnp.asarray(x)], jnp.float32(eta), capacity)
        chosen = float(chosen)
        assert eta / control.BRACKET_SPAN <= chosen <= eta * control.BRACKET_SPAN
        assert int(count) == np.sum(x > chosen)
        # A NumPy oracle: it fills the payload, and the next threshold of the
        # fine grid (2**(1/32) higher) would not.
        assert np.sum(x > chosen) >= capacity
        assert np.sum(x > chosen * 2 ** (1 / 32) * (1 + 1e-5)) < capacity


def test_bracket_falls_back_to_its_ends_and_keeps_a_zero_threshold():
    x = jnp.arange(1.0, 101.0)
    # Too few even at eta / 2: the lowest; too many even at 2 eta: the highest.
    assert float(control.bracket([x], jnp.float32(150.0), 50)[0]) == pytest.approx(75.0)
    assert float(control.bracket([x], jnp.float32(10.0), 50)[0]) == pytest.approx(20.0)
    assert [int(v) for v in control.bracket([x], jnp.float32(0.0), 50)] == [0, 100]
    # Several vectors count together, as one.
    halves = [x[:50], x[50:]]
    one, two = control.bracket(halves, jnp.float32(60.0), 30), control.bracket([x], 60.0, 30)
    assert [float(v) for v in one] == [float(v) for v in two]


def test_fill_fills_where_the_paper_adaptation_does_not_without_recompiling(rng):
    tx = sidco.compress(0.01, adaptation="fill")
    paper = sidco.compress(0.01, adaptation="paper")
    g = rng.standard_t(3, size=20_000).astype("float32")
    capacity = sidco.capacity(g.size, 0.01)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, g):
        return tx.update(g, state)[1]

    state, reference = tx.init(g), paper.init(g)
    assert float(state.rule.scale) == 0.0
    state = step(state, g)
    reference = paper.update(g, reference)[1]
    # The same fitted threshold, then bracketed to the highest that fills the payload.
    fitted, chosen = float(reference.last.threshold), float(state.last.threshold)
    assert fitted / control.BRACKET_SPAN <= chosen <= fitted * control.BRACKET_SPAN
    assert np.sum(np.abs(g) > chosen) >= capacity
    assert float(state.last.density) * g.size == pytest.approx(capacity)
    # The factor moves the bracket's centre: with a factor of 4 it searches
    # [2, 8] x the fitted threshold instead of [1/2, 2] x, from the same state
    # (with no last threshold to try first).
    for _ in range(3):
        state = step(state, g)
    etas = [
        float(
            step(
                state._replace(
                    rule=state.rule._replace(scale=jnp.float32(s), previous=jnp.float32(0.0))
                ),
                g,
            ).last.threshold
        )
        for s in (0.0, math.log(4.0))
    ]
    assert etas[1] > etas[0]


@pytest.mark.slow
def test_fill_factor_is_the_same_on_every_device(rng):
    tx = sidco.compress(0.01, adaptation="fill", axis_name=AXIS)
    mesh = mesh_of(DEVICES)
    params = jax.device_put(params_tree(), NamedSharding(mesh, P()))
    state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
    # A factor of 1/16 centres the bracket far too low: the devices select far
    # more than FILL_OVER x their capacity, so the factor goes up, from the
    # devices' summed figures.
    state = state._replace(rule=state.rule._replace(scale=jnp.float32(-math.log(16.0))))
    _, states, _ = run_shard_map(tx, gradient_stream(rng, 6), start=(params, state))
    scales = [copies(s.rule.scale) for s in states]
    assert len({float(x) for x in scales[-1]}) == 1
    assert len({float(s[0]) for s in scales}) > 1  # it moved
    # The last threshold, tried first by every device, is the devices' mean.
    previous = [copies(s.rule.previous) for s in states]
    assert all(len({float(x) for x in p}) == 1 for p in previous)
    assert float(previous[-1][0]) == pytest.approx(float(copies(states[-1].last.threshold)[0]))


@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_fill_sends_exactly_the_top_capacity_when_the_bracket_reaches_it(rng, ratio):
    g = rng.standard_t(3, size=50_000).astype(np.float32)
    tx = sidco.compress(ratio, adaptation="fill", error_feedback=False)
    update, state = jax.jit(tx.update)(g, tx.init(g))
    capacity = sidco.capacity(g.size, ratio)
    selected = round(float(state.last.selected_density) * g.size)
    assert capacity <= selected <= control.FILL_WIDE * capacity
    # A NumPy oracle: the indices of the capacity largest magnitudes.
    top = np.argsort(-np.abs(g), kind="stable")[:capacity]
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(update)), np.sort(top))


@pytest.mark.parametrize("estimator", quick_first(sidco.ESTIMATORS))
def test_fill_loses_nothing(rng, estimator):
    # sent + new residual == gradient + old residual, bit for bit, step after step.
    tx = sidco.compress(0.01, estimator=estimator, adaptation="fill")
    params = {"w": np.zeros((60, 50), np.float32), "b": np.zeros(300, np.float32)}
    state, update = tx.init(params), jax.jit(tx.update)
    for _ in range(6):
        grads = jax.tree.map(lambda x: rng.standard_t(3, size=x.shape).astype(np.float32), params)
        old = jax.tree.map(np.asarray, state.residual)
        sent, state = update(grads, state)
        chex.assert_trees_all_equal(
            jax.tree.map(np.add, jax.tree.map(np.asarray, sent), state.residual),
            jax.tree.map(np.add, grads, old),
        )
        assert float(state.last.density) > 0


@pytest.mark.parametrize("ratio", [0.01, 0.001])
def test_fill_tries_the_last_threshold_first_and_refits_only_where_it_misses(rng, ratio):
    g = rng.standard_t(3, size=50_000).astype(np.float32)
    tx = sidco.compress(ratio, adaptation="fill", error_feedback=False)
    capacity = sidco.capacity(g.size, ratio)
    top = np.sort(np.argsort(-np.abs(g), kind="stable")[:capacity])  # a NumPy oracle
    magnitudes = np.sort(np.abs(g))[::-1]
    update = jax.jit(tx.update)
    fresh = update(g, tx.init(g))[1].last.threshold  # no last threshold: fitted and bracketed
    for rank, kept in [
        (2 * capacity, True),  # 2x the capacity pass it: in hand
        (control.FILL_WIDE * capacity, True),
        (capacity // 2, False),  # too few: the fit and the bracket
        (control.FILL_WIDE * capacity + 1, False),  # too many for the wide payload
    ]:
        last = magnitudes[rank]  # exactly `rank` entries are above it
        state = tx.init(g)
        state = state._replace(rule=state.rule._replace(previous=jnp.float32(last)))
        sent, state = update(g, state)
        assert (float(state.last.threshold) == last) == kept
        if not kept:
            assert float(state.last.threshold) == float(fresh)
        # Either way the payload holds the exact top-capacity.
        np.testing.assert_array_equal(np.flatnonzero(np.asarray(sent)), top)


@pytest.mark.slow
def test_fill_per_leaf_has_no_last_threshold(rng):
    params = {"w": np.zeros((60, 50), np.float32), "b": np.zeros(300, np.float32)}
    tx = sidco.compress(0.01, adaptation="fill", granularity="leaf")
    model = sidco.compress(0.01, adaptation="fill")
    state, by_model = tx.init(params), model.init(params)
    update, update_by_model = jax.jit(tx.update), jax.jit(model.update)  # eager took 20-40 s
    for _ in range(3):
        grads = jax.tree.map(lambda x: rng.standard_t(3, size=x.shape).astype(np.float32), params)
        state = update(grads, state)[1]
        by_model = update_by_model(grads, by_model)[1]
    assert float(state.rule.previous) == 0.0
    assert float(by_model.rule.previous) == float(by_model.last.threshold) > 0
