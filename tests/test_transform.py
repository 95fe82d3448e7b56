import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized
from harness import (
    constant_fills,
    equations,
    flat_residual,
    full_size_copies,
    one_of_each_kind,
    quick_first,
    sorted_sizes,
)

import sidco_jax as sidco
from sidco_jax._src.rules.control import FILL_WIDE


def tree(rng):
    return {
        "dense": {
            "w": rng.standard_t(3, size=(64, 48)).astype(np.float32),
            "b": np.zeros(48, np.float32),
        },
        "half": jnp.asarray(rng.normal(size=300), jnp.bfloat16),
        "step": np.int32(7),
    }


def float_leaves(t):
    return [
        np.asarray(x, np.float32).ravel()
        for x in jax.tree.leaves(t)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
    ]


# The loop's error feedback, whatever the estimator: SIDCo-E at both granularities here;
# test_conformance.py runs every estimator (SIDCo-E, -P, -GP) through it at model
# granularity in both layouts, with hostile input.
@pytest.mark.parametrize("granularity", quick_first(sidco.GRANULARITIES))
def test_error_feedback_keeps_everything(rng, granularity):
    tx = sidco.compress(0.05, granularity=granularity, capacity_factor=1.0)
    params = tree(rng)
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(12):
        grads = tree(rng)
        old = flat_residual(state)
        sent, state = update(grads, state)
        assert sent["step"] == grads["step"]  # integer leaves pass through
        assert sent["half"].dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.concatenate(float_leaves(sent)) + flat_residual(state),
            np.concatenate(float_leaves(grads)) + old,
        )
        m = sidco.metrics(state)
        assert 0 < float(m["density"]) <= 0.05 * 1.0 + 1e-3


def test_metrics_match_a_numpy_oracle(rng):
    ratio, factor = 0.02, 1.5
    tx = sidco.compress(
        ratio, estimator="gpareto", stages=2, capacity_factor=factor, adaptation="paper"
    )
    g = rng.standard_t(3, size=5000).astype(np.float32)
    r0 = rng.normal(scale=0.1, size=5000).astype(np.float32)
    state = tx.init(g)._replace(residual=jnp.asarray(r0))
    sent, state = jax.jit(tx.update)(g, state)
    m = sidco.metrics(state)
    u = g + r0
    eta = float(m["threshold"])
    assert eta == pytest.approx(float(sidco.threshold(u, ratio, estimator="gpareto", stages=2)))
    above = np.flatnonzero(np.abs(u) > eta)
    cap = math.ceil(factor * ratio * u.size)
    kept = above[:cap]
    want = np.zeros_like(u)
    want[kept] = u[kept]
    np.testing.assert_array_equal(sent, want)
    assert float(m["density"]) == pytest.approx(kept.size / u.size)
    assert float(m["selected_density"]) == pytest.approx(above.size / u.size)
    assert int(m["overflow"]) == above.size - kept.size
    assert int(m["bytes"]) == cap * 8
    assert float(m["target_density"]) == pytest.approx(ratio)
    assert int(m["stages"]) == 2 and int(m["step"]) == 1 and not bool(m["nonfinite"])


def test_zero_gradients_give_zero_updates():
    tx = sidco.compress(0.01, estimator="gamma")
    params = {"a": jnp.zeros(1000), "b": jnp.zeros((3, 3))}
    sent, state = tx.update(params, tx.init(params))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(sent))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


WRAPPED = {  # the compressor inside each optax wrapper metrics() must see through
    "chain": lambda: optax.chain(sidco.compress(0.05), optax.sgd(0.1)),
    "named_chain": lambda: optax.named_chain(
        ("sidco", sidco.compress(0.05)), ("sgd", optax.sgd(0.1))
    ),
    "inject": lambda: optax.inject_hyperparams(
        sidco.compress, static_args=("ratio", "capacity_factor", "stages")
    )(0.05, stages=2),
    "multi_steps": lambda: optax.MultiSteps(optax.chain(sidco.compress(0.05), optax.sgd(0.1)), 2),
    "apply_if_finite": lambda: optax.apply_if_finite(
        optax.chain(sidco.compress(0.05), optax.sgd(0.1)), 3
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", WRAPPED)
def test_metrics_found_through_optax_wrappers(rng, wrapper):
    params = rng.normal(size=400).astype(np.float32)
    tx = WRAPPED[wrapper]()
    state = tx.init(params)
    for _ in range(2):
        _, state = jax.jit(tx.update)(params, state, params)
    assert float(sidco.metrics(state)["density"]) == pytest.approx(0.05, abs=0.02)


def test_metrics_explain_a_missing_or_unusable_compressor_state(rng):
    params = rng.normal(size=400).astype(np.float32)
    forgot = optax.inject_hyperparams(sidco.compress)(0.05)
    with pytest.raises(ValueError, match="ratio sets the payload shape"):
        jax.jit(forgot.update)(params, forgot.init(params))
    with pytest.raises(ValueError, match="no sidco_jax compressor state"):
        sidco.metrics(optax.sgd(0.1).init(params))


@pytest.mark.slow
def test_least_squares_converges_like_dense(rng):
    a = rng.normal(size=(256, 512)).astype(np.float32) / 16
    x_true = rng.normal(size=512).astype(np.float32)
    b = a @ x_true

    def loss(x):
        return 0.5 * jnp.mean((a @ x - b) ** 2) * 256

    def train(tx, steps=1500):
        def step(carry, _):
            x, state = carry
            u, state = tx.update(jax.grad(loss)(x), state, x)
            return (optax.apply_updates(x, u), state), None

        x = jnp.zeros(512)
        # One scan, compiled once: the same steps as a Python loop, without 1500 dispatches.
        (x, _), _ = jax.jit(lambda c: jax.lax.scan(step, c, None, length=steps))((x, tx.init(x)))
        return float(loss(x))

    start = float(loss(jnp.zeros(512)))
    dense = train(optax.sgd(0.2))
    sparse = train(optax.chain(sidco.compress(0.05), optax.sgd(0.2)))
    assert dense < 0.01 * start and sparse < 0.05 * start, (start, dense, sparse)


@pytest.mark.parametrize("granularity", sidco.GRANULARITIES)
def test_trees_without_float_leaves_pass_through(granularity):
    tx = sidco.compress(0.1, granularity=granularity)
    params = {"n": jnp.arange(4), "flag": jnp.array(True)}
    state = tx.init(params)
    out, new_state = jax.jit(tx.update)(params, state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    chex.assert_trees_all_equal(out, params)


@pytest.mark.slow
class SameUpdateEverywhere(chex.TestCase):
    """An update is a pure function: eager, jitted and pmapped runs give one answer."""

    # One compressor of each kind of rule: a kind's rules share the loop's code and differ
    # in their formulas only (test_hostile.py runs every compressor under disable_jit).
    @chex.variants(without_jit=True, with_pmap=True)  # with_jit: the reference itself
    @parameterized.parameters(*one_of_each_kind(sidco.COMPRESSORS))
    def test_two_steps_match_the_jitted_reference(self, name):
        rng = np.random.default_rng(7)
        params = {
            "w": rng.standard_t(3, size=(40, 25)).astype(np.float32),
            "b": np.zeros(25, np.float32),
        }
        tx = sidco.compressor(name, 0.05)
        update = jax.jit(tx.update)
        variant = self.variant(tx.update)
        want = got = tx.init(params)
        for _ in range(2):
            grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(x.dtype), params)
            expected, want = update(grads, want)
            out, got = variant(grads, got)
            # pmap broadcasts the arguments to every device and returns the first
            # device's result; eager and compiled arithmetic may round differently.
            chex.assert_trees_all_close((out, got), (expected, want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("adaptation, widest", [("paper", 1), ("fill", FILL_WIDE)])
@pytest.mark.parametrize("estimator", ["exponential", "gpareto", "gamma"])
def test_sidco_update_sorts_nothing_of_gradient_size(estimator, adaptation, widest):
    # The starved-payload fill ran lax.top_k over every leaf in a lax.cond
    # branch: rarely taken, but on a GPU its sort reserved three gradient
    # sizes of temporaries in every update. "fill" picks the capacity's
    # largest out of FILL_WIDE x the capacity.
    grads = {"a": jnp.ones((64, 512)), "b": jnp.ones(1000)}
    tx = sidco.compress(0.01, estimator=estimator, adaptation=adaptation)
    sizes = sorted_sizes(jax.make_jaxpr(tx.update)(grads, tx.init(grads)).jaxpr)
    assert max(sizes, default=0) <= widest * sidco.capacity(33768, 0.01), sizes


@pytest.mark.parametrize("name", sidco.COMPRESSORS)
def test_no_update_calls_back_to_the_host(name):
    # A jax.debug.callback in a branch that seldom ran (the dropped-residual
    # warning) cost about a sixth of every update on XLA's CPU backend.
    grads = {"a": jnp.ones((64, 512)), "b": jnp.ones(1000)}
    tx = sidco.compressor(name, 0.01)
    jaxpr = jax.make_jaxpr(tx.update)(grads, tx.init(grads)).jaxpr
    assert [e.primitive.name for e in equations(jaxpr) if "callback" in e.primitive.name] == []


@pytest.mark.parametrize(
    "name, scopes",
    [
        ("sidco-e", {"error_feedback", "select", "payload", "aggregate", "write_back"}),
        ("topk", {"error_feedback", "select", "payload", "aggregate", "write_back"}),
        ("dense", {"error_feedback", "aggregate"}),
    ],
)
def test_the_compiled_update_names_its_phases(name, scopes):
    # Profiles (and benchmarks.overhead's phases) attribute the update's time
    # through these named scopes, kept in the compiled instructions' op_name.
    grads = {"a": jnp.ones((64, 512)), "b": jnp.ones(1000)}
    tx = sidco.compressor(name, 0.01)
    text = jax.jit(tx.update).lower(grads, tx.init(grads)).compile().as_text()
    found = {part for op in re.findall(r'op_name="([^"]*)"', text) for part in op.split("/")}
    assert scopes <= found, scopes - found


# The write-back is the loop's: one compressor of each kind of rule.
@pytest.mark.parametrize("name", quick_first(one_of_each_kind(sidco.COMPRESSORS)))
def test_equal_leaves_are_written_without_copies(name):
    # Constant zero targets of equal shapes were merged by XLA into one buffer,
    # copied for each leaf's in-place scatter (and, with the update returned
    # first, the new residual was copied as well). docs/optax.md: random-k.
    grads = {
        "a": jnp.linspace(-1.0, 1.0, 32768).reshape(64, 512),
        "b": jnp.linspace(2.0, -2.0, 32768).reshape(64, 512),
    }
    tx = sidco.compressor(name, 0.01)
    state_first = jax.jit(lambda g, s: tx.update(g, s)[::-1], donate_argnums=1)
    assert full_size_copies(state_first, grads, tx.init(grads), shape=(64, 512)) == []
    if name != "randomk":  # jitted as it is, the donated residual goes to the update
        plain = jax.jit(tx.update, donate_argnums=1)
        assert full_size_copies(plain, grads, tx.init(grads), shape=(64, 512)) == []


@pytest.mark.parametrize(
    "options",
    quick_first(
        # The state's buffers are the loop's and the kind of rule's: one of each kind.
        [{"name": name} for name in one_of_each_kind(sidco.COMPRESSORS)]
        + [{"name": "sidco-e", "adaptation": rule} for rule in (*sidco.ADAPTATIONS, None)]
        + [{"name": "sidco-e", "warmup_steps": 1}]
    ),
    ids=lambda o: ",".join(f"{v}" for v in o.values()),
)
def test_a_fresh_state_can_be_donated(options):
    # Two leaves of a state sharing one buffer make XLA refuse the donation
    # ("donate the same buffer twice"): the examples' steps donate the state.
    options = dict(options)
    tx = sidco.compressor(options.pop("name"), 0.01, **options)
    grads = {"a": jnp.linspace(-1.0, 1.0, 4096).reshape(64, 64), "b": jnp.ones(100)}
    state = tx.init(grads)
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    assert len(set(pointers)) == len(pointers)
    step = jax.jit(lambda g, s: tx.update(g, s)[::-1], donate_argnums=1)
    for _ in range(2):
        state, _ = step(grads, state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: sidco.dense(),
        lambda: sidco.compress(0.01, error_feedback=False),
        lambda: sidco.compress(0.01),
        lambda: sidco.compressor("topk", 0.01),
    ],
    ids=["dense", "no-error-feedback", "sidco-e", "topk"],
)
def test_no_update_fills_a_gradient_sized_array_with_constants(make):
    # Without a residual, a full-size zero stood in for it: every dense() step
    # wrote it and read it back (19 against 12 ms on the lm:large tree).
    grads = {"a": jnp.linspace(-1.0, 1.0, 32768).reshape(64, 512), "b": jnp.ones(1000)}
    tx = make()
    step = jax.jit(lambda g, s: tx.update(g, s)[::-1], donate_argnums=1)
    assert constant_fills(step, grads, tx.init(grads), shape=(64, 512)) == []


def test_an_injected_stage_count_takes_effect_when_fixed(rng):
    grads = rng.laplace(size=4000).astype(np.float32)
    tx = optax.inject_hyperparams(sidco.compress, static_args=("ratio", "capacity_factor"))(
        0.01, adaptation=None, stages=1
    )
    step = jax.jit(tx.update)
    _, state = step(grads, tx.init(grads))
    state.hyperparams["stages"] = jnp.asarray(3)
    out, after = step(grads, state)
    # The same step of a compressor built with stages=3, from the same state.
    built = {s: sidco.compress(0.01, adaptation=None, stages=s) for s in (1, 3)}
    expected = {s: jax.jit(tx.update)(grads, state.inner_state)[0] for s, tx in built.items()}
    assert not np.array_equal(expected[1], expected[3])  # the count matters here
    np.testing.assert_array_equal(out, expected[3])
    assert int(after.inner_state.rule.stages) == 3


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: optax.inject_hyperparams(
                sidco.compress, static_args=("ratio", "capacity_factor")
            )(0.01, stages=2),
            "stages is where an adaptation starts, read by init only",
        ),
        (
            lambda: optax.inject_hyperparams(lambda ratio: sidco.compressor("dense", ratio))(0.01),
            "ratio is ignored by 'dense'",
        ),
    ],
)
def test_injecting_a_hyperparameter_that_would_change_nothing_is_refused(rng, make, message):
    params = rng.normal(size=400).astype(np.float32)
    tx = make()
    with pytest.raises(ValueError, match=message + ".*static_args"):
        jax.jit(tx.update)(params, tx.init(params))
