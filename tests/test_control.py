import chex
import jax
import jax.numpy as jnp
import pytest

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
