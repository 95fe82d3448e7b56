"""Every compressor through the same hostile inputs, checked for the same properties.

One gradient tree holds every kind of leaf (float32, bfloat16, float16 near
its range limit, int, bool, complex, zero-size, size-1, all-equal), so each
compressor compiles once per case and then runs a sequence of scenarios of the
same shapes: NaN and inf in the gradient and in the state, 1e30-scale and
denormal magnitudes, all-equal leaves. After every step:

* no exception;
* the update and the whole state are finite;
* error feedback loses nothing: ``sent + new residual == gradient + old
  residual`` exactly (less the non-finite residual entries, which are
  dropped and counted); a skipped step keeps the residual;
* a finite step with anything to send sends something (no starved payload);
* on 8 devices the replicas are identical.

docs/optax.md ("What happens when") tabulates the outcomes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    AXIS,
    DEVICES,
    SELECTING,
    SHAPES,
    WITH_INDICES,
    flat_residual,
    gradient_stream,
    mesh_of,
    one_of_each_kind,
    per_device_step,
    run_shard_map,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco
from sidco_jax._src.loop import layout as layout_lib
from sidco_jax._src.loop import residuals
from sidco_jax._src.loop.residuals import Buckets

pytestmark = pytest.mark.slow  # multi-device or benchmark runs: -m 'not slow' leaves them out

LEAVES = {  # name: (shape, dtype)
    "f32": ((6, 8), np.float32),
    "bf16": ((24,), jnp.bfloat16),
    "f16": ((16,), np.float16),
    "int": ((3,), np.int32),
    "bool": ((2,), np.bool_),
    "complex": ((4,), np.complex64),
    "empty": ((0, 3), np.float32),
    "one": ((1,), np.float32),
    "equal": ((32,), np.float32),
}
FLOATS = [k for k, (_, d) in LEAVES.items() if jnp.issubdtype(d, jnp.floating)]


def base_gradient(rng) -> dict:
    g = {}
    for name, (shape, dtype) in LEAVES.items():
        if name == "f16":  # near the float16 limit (65504): error feedback overflows it
            value = rng.choice([-1, 1], shape) * rng.uniform(30000, 60000, shape)
        elif name == "complex":
            value = rng.normal(size=shape) + 1j * rng.normal(size=shape)
        elif name == "equal":
            value = np.full(shape, 0.5)
        elif dtype == np.bool_:
            value = rng.integers(0, 2, shape)
        elif dtype == np.int32:
            value = rng.integers(-5, 5, shape)
        else:
            value = rng.normal(size=shape)
        g[name] = np.asarray(value).astype(dtype)
    return g


def scaled(g, factor, names=("f32", "bf16", "one", "equal", "complex")):
    """``g`` with the leaves ``names`` multiplied by ``factor`` (float16 cannot hold it)."""
    return {k: (v * np.float32(factor)).astype(v.dtype) if k in names else v for k, v in g.items()}


def poke(g, name, index, value):
    out = dict(g)
    out[name] = g[name].copy()
    out[name].reshape(-1)[index] = value
    return out


def equal_everywhere(g):
    return {k: np.full(v.shape, 0.25, v.dtype) if k in FLOATS else v for k, v in g.items()}


def float32_limit(g):
    """float32 leaves scaled to a largest magnitude of 3e38: their sums overflow, no entry does."""
    out = dict(g)
    for k in ("f32", "one"):
        out[k] = (g[k] / np.max(np.abs(g[k])) * np.float32(3e38)).astype(np.float32)
    return out


# (name, gradient from the base one, residual leaf to poison or None, gradient is non-finite)
SCENARIOS = [
    ("all equal", equal_everywhere, None, False),  # first: the residual is zero, u is tied
    ("plain", lambda g: g, None, False),
    ("nan in the gradient", lambda g: poke(g, "f32", 5, np.nan), None, True),
    ("inf in a bf16 gradient", lambda g: poke(g, "bf16", 0, np.inf), None, True),
    ("nan in a size-1 gradient", lambda g: poke(g, "one", 0, np.nan), None, True),
    ("inf in a complex gradient", lambda g: poke(g, "complex", 1, np.inf), None, True),
    ("nan and inf in the residual", lambda g: g, "f32", False),
    ("1e30 scale", lambda g: scaled(g, 1e30), None, False),
    ("denormal scale", lambda g: scaled(g, 1e-40), None, False),
    ("nan in the gradient and the residual", lambda g: poke(g, "f32", 0, np.nan), "one", True),
    ("float32 limit", float32_limit, None, False),
    ("plain again", lambda g: g, None, False),
]


def flush(x):
    """XLA's CPU arithmetic flushes denormals to zero: the reference does too."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)


def poison(residual, name):
    """The residual with NaN and -inf written into leaf ``name`` (first two entries)."""
    leaf = residual[name]
    flat = leaf.reshape(-1).at[0].set(np.nan)
    if flat.size > 1:
        flat = flat.at[1].set(-np.inf)
    return {**residual, name: flat.reshape(leaf.shape)}


def assert_finite_tree(tree, what):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = np.asarray(leaf)
        if np.issubdtype(leaf.dtype, np.inexact) or leaf.dtype == jnp.bfloat16:
            assert np.all(np.isfinite(leaf.astype(np.complex128))), (
                f"{what}{jax.tree_util.keystr(path)}"
            )


def check_step(name, g, before, sent, after, skipped):
    """The properties of one local step (a :class:`CompressState` before and after)."""
    m = after.last
    assert bool(m.nonfinite) == skipped, name
    assert_finite_tree(sent, "update")
    assert_finite_tree(after, "state")
    for k in ("int", "bool"):
        np.testing.assert_array_equal(sent[k], g[k])
    np.testing.assert_array_equal(sent["complex"], 0 if skipped else g["complex"])
    if before.residual is None:  # dense: the gradient itself, or nothing
        for k in FLOATS:
            want = np.zeros(g[k].shape) if skipped else np.asarray(g[k], np.float32)
            np.testing.assert_array_equal(np.asarray(sent[k], np.float32), want, err_msg=name)
        return
    dropped = 0
    for k in FLOATS:
        old = np.asarray(before.residual[k])
        clean = np.where(np.isfinite(old), old, np.float32(0))
        dropped += int(np.sum(~np.isfinite(old)))
        new = np.asarray(after.residual[k])
        if skipped:  # nothing sent; a bad gradient is dropped, the residual kept
            assert not np.any(np.asarray(sent[k], np.float32)), name
            np.testing.assert_array_equal(new, clean, err_msg=f"{name}: {k}")
        else:
            owed = flush(flush(g[k]).reshape(old.shape) + clean)
            got = np.asarray(sent[k], np.float32).reshape(old.shape) + new
            if name == "float32 limit":  # what float32 cannot hold saturates
                top = np.finfo(np.float32).max
                owed = np.clip(flush(g[k]).reshape(old.shape).astype(np.float64) + clean, -top, top)
                got = np.asarray(sent[k], np.float64).reshape(old.shape) + new
                np.testing.assert_allclose(got, owed, rtol=1e-6, err_msg=f"{name}: {k}")
                continue
            np.testing.assert_array_equal(got, owed, err_msg=f"{name}: {k}")
    assert int(m.dropped) == dropped, name
    anything = any(np.any(flush(g[k]) != 0) for k in FLOATS)
    if not skipped and anything:
        assert float(m.density) > 0, f"{name}: a starved payload"


# Leaf granularity runs the rule once per leaf: each kind of rule once keeps the grid fast.
LEAF_RULES = one_of_each_kind(SELECTING)
CASES = [(n, "model") for n in sidco.COMPRESSORS] + [(n, "leaf") for n in LEAF_RULES]


def as_tree(state, params):
    """``state`` with a bucketed residual as the tree of its entries (the checks read leaves)."""
    if not isinstance(state.residual, Buckets):
        return state
    return state._replace(residual=residuals.convert(state.residual, params, "tree"))


def poisoned_state(state, params, name):
    """``state`` with :func:`poison` written into leaf ``name`` of its residual, in its layout."""
    tree = poison(as_tree(state, params).residual, name)
    if isinstance(state.residual, Buckets):  # cut into the state's own buckets (one per leaf too)
        buckets = state.residual.buckets
        cut = layout_lib.regroup(jax.tree.leaves(tree), [b.shape for b in buckets], 1)
        return state._replace(
            residual=Buckets(
                tuple(jnp.asarray(x, b.dtype) for x, b in zip(cut, buckets, strict=True)),
                state.residual.cut,
            )
        )
    return state._replace(residual=tree)


# The bucketed layout packs every leaf kind above into one float32 bucket: each
# compressor through the same grid again, at model granularity.
LAYOUT_CASES = [(n, g, "tree") for n, g in CASES] + [
    (n, "model", "buckets") for n in sidco.COMPRESSORS
]


@pytest.mark.parametrize(("name", "granularity", "layout"), LAYOUT_CASES)
def test_every_compressor_survives_every_hostile_input(name, granularity, layout, rng):
    options = {"granularity": granularity} if name in SELECTING else {}
    tx = sidco.compressor(name, 0.1, layout=layout, **options)
    base = base_gradient(rng)
    state = tx.init(base)
    update = jax.jit(tx.update)
    for scenario, make, poisoned, skipped in SCENARIOS:
        g = make(base)
        if poisoned and state.residual is not None:
            state = poisoned_state(state, base, poisoned)
        sent, after = update(g, state)
        check_step(scenario, g, as_tree(state, base), sent, as_tree(after, base), skipped)
        state = after
    assert int(state.count) == len(SCENARIOS)


# Ratio 1 asks for every entry: each compressor must then be the dense mean, leaving
# nothing in the residual. A rule's ratio-1 case is its own: every compressor, over the
# whole model; the buckets and the per-leaf runs are the loop's (as above: each kind of
# rule once).
RATIO_ONE_CASES = (
    [(n, "model", "tree") for n in sidco.COMPRESSORS]
    + [(n, "model", "buckets") for n in one_of_each_kind(sidco.COMPRESSORS)]
    + [(n, "leaf", "tree") for n in LEAF_RULES]  # per leaf: one part each
)


@pytest.mark.parametrize(("name", "granularity", "layout"), RATIO_ONE_CASES)
def test_every_compressor_at_ratio_one_is_the_dense_mean(name, granularity, layout, rng):
    options = {"granularity": granularity} if name in SELECTING else {}
    tx, dense = sidco.compressor(name, 1.0, layout=layout, **options), sidco.dense()
    base = base_gradient(rng)
    state, dense_state = tx.init(base), dense.init(base)
    update, reference = jax.jit(tx.update), jax.jit(dense.update)
    for scenario, make, poisoned, _ in SCENARIOS:
        g = make(base)
        if poisoned and state.residual is not None:
            state = poisoned_state(state, base, poisoned)
        sent, state = update(g, state)
        want, dense_state = reference(g, dense_state)
        for k in LEAVES:  # denormals: dense passes them on, the loop's g + r flushes them
            got, dense_sent = (flush(x[k]) if k in FLOATS else x[k] for x in (sent, want))
            assert sent[k].dtype == want[k].dtype, k
            np.testing.assert_array_equal(got, dense_sent, err_msg=f"{scenario}: {k}")
        if state.residual is not None:
            for k in FLOATS:
                left = np.asarray(as_tree(state, base).residual[k])
                assert not np.any(left), f"{scenario}: {k} kept {np.count_nonzero(left)} entries"


# Each rule at ratio 1 is checked above (every compressor, granularity and layout); the
# mean over the devices is the loop's aggregation: one compressor of each kind of rule.
@pytest.mark.parametrize("name", one_of_each_kind(sidco.COMPRESSORS))
def test_each_kind_of_rule_at_ratio_one_is_the_mean_over_8_devices(name, rng):
    # Multiples of 1/64 below 4: sums of 8 are exact, so the mean is NumPy's to the bit.
    options = {"communication": "sparse"} if name in WITH_INDICES else {}
    stream = gradient_stream(rng, 2)
    updates, states, _ = run_shard_map(
        sidco.compressor(name, 1.0, axis_name=AXIS, **options), stream
    )
    for update, state, grads in zip(updates, states, stream, strict=True):
        for k in SHAPES:
            np.testing.assert_array_equal(update[k], grads[k].mean(0), err_msg=k)
        assert state.residual is None or not np.any(flat_residual(state))


def per_device(make, rng):
    """A gradient of every device (leading axis), ``make`` applied to device 3's only."""
    grads = [base_gradient(rng) for _ in range(DEVICES)]
    grads[3] = make(grads[3])
    return {k: np.stack([g[k] for g in grads]) for k in LEAVES}


# The aggregation modes are shared code: "dense" (psum) once per kind of payload. Each
# rule's hostile input is checked locally above; on 8 devices, one of each kind of rule.
MESH_CASES = (
    [(n, "model", "sparse") for n in one_of_each_kind(WITH_INDICES)]
    + [("sidco-e", "model", "dense"), ("dgc", "model", "dense")]
    + [("sidco-e", "model", "sparse_allreduce"), ("topk", "leaf", "sparse_allreduce")]
    + [("randomk", "model", "auto"), ("dense", "model", "auto")]
    + [(n, "leaf", "sparse") for n in ("sidco-e", "topk", "randomk")]
)


@pytest.mark.parametrize(("name", "granularity", "communication"), MESH_CASES)
def test_each_kind_of_rule_survives_hostile_input_on_8_devices(
    name, granularity, communication, rng
):
    options = {"granularity": granularity} if name in SELECTING else {}
    if name in WITH_INDICES:
        options["communication"] = communication
    tx = sidco.compressor(name, 0.1, axis_name=AXIS, **options)
    mesh = mesh_of(DEVICES)
    params = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in LEAVES.items()}
    state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
    step = per_device_step(tx, mesh, state)

    for scenario, make, poisoned, skipped in SCENARIOS:
        g = per_device(make, rng)
        if poisoned and state.residual is not None:  # device 5's residual only
            rows = np.split(np.asarray(state.residual[poisoned]), DEVICES)
            rows[5] = np.asarray(poison({poisoned: jnp.asarray(rows[5])}, poisoned)[poisoned])
            bad = jax.device_put(np.concatenate(rows), state.residual[poisoned].sharding)
            state = state._replace(residual={**state.residual, poisoned: bad})
        sent, after = step(state, jax.device_put(g, NamedSharding(mesh, P(AXIS))))
        assert bool(after.last.nonfinite) == skipped, scenario
        assert_finite_tree(sent, "update")
        assert_finite_tree(after, "state")
        for k in [*FLOATS, "complex"]:  # every device applies the same update, bit for bit
            u = sent[k]
            u = np.asarray(u.astype(np.float32) if u.dtype == jnp.bfloat16 else u)
            assert np.all(u == u[:1]) or (u.size == 0), f"{scenario}: {k} differs across devices"
        if after.residual is not None:
            for k in FLOATS:  # what all devices sent is what they owed, less what they kept
                old = np.asarray(state.residual[k]).reshape(DEVICES, -1)
                new = np.asarray(after.residual[k]).reshape(DEVICES, -1)
                clean = np.where(np.isfinite(old), old, np.float32(0))
                mean = np.asarray(sent[k], np.float32)[0].reshape(-1)
                if skipped:
                    np.testing.assert_array_equal(mean, 0)
                    owed = clean + np.where(
                        np.arange(DEVICES)[:, None] == 3, 0, flush(g[k]).reshape(DEVICES, -1)
                    )
                    np.testing.assert_array_equal(new, owed, err_msg=f"{scenario}: {k}")
                else:
                    given = flush(g[k]).reshape(DEVICES, -1) + clean - new
                    # In a sparse all-reduce an owner adds other devices' entries to its
                    # own residual, so the rounding scales with the residuals too.
                    moved = [given] + ([clean, new] if communication == "sparse_allreduce" else [])
                    # float32 sums of 8 terms, then the mean rounded to the leaf's dtype.
                    bound = float(jnp.finfo(LEAVES[k][1]).eps) * np.abs(mean) + 8 * float(
                        np.finfo(np.float32).eps
                    ) * np.max(np.abs(np.concatenate(moved)), axis=0)
                    error = np.abs(mean - given.sum(0) / DEVICES)
                    assert np.all(error <= bound), f"{scenario}: {k} {np.max(error - bound)}"
        state = after


@pytest.mark.parametrize("layout", ["tree", "buckets"])
@pytest.mark.parametrize("name", sidco.COMPRESSORS)
def test_float64_leaves_under_x64_lose_nothing(name, layout, rng):
    # The message is float32; a float64 leaf's residual keeps what float32 cannot carry.
    with jax.enable_x64(True):
        g = {
            "f64": rng.normal(size=40) * (1 + 1e-12),  # more digits than float32 holds
            "f32": rng.normal(size=30).astype(np.float32),
        }
        tx = sidco.compressor(name, 0.1, layout=layout)
        state = tx.init(g)
        assert state.residual is None or as_tree(state, g).residual["f64"].dtype == np.float64
        update = jax.jit(tx.update)
        for skipped in (False, True, False):
            grads = poke(g, "f64", 3, np.nan) if skipped else g
            sent, after = update(grads, state)
            before, now = as_tree(state, g), as_tree(after, g)
            assert sent["f64"].dtype == np.float64 and bool(after.last.nonfinite) == skipped
            for k in g:
                s = np.asarray(sent[k], np.float64)
                if skipped:
                    assert not np.any(s)
                elif state.residual is None:
                    np.testing.assert_array_equal(s, g[k])
                else:
                    owed = g[k] + np.asarray(before.residual[k])
                    np.testing.assert_array_equal(s + np.asarray(now.residual[k]), owed)
            state = after


@pytest.mark.parametrize("name", sidco.COMPRESSORS)
def test_float64_beyond_float32s_range_saturates_and_the_residual_keeps_the_rest(name, rng):
    # The message is float32: 1e300 is sent as float32's largest value, the rest stays.
    top = float(np.finfo(np.float32).max)
    big = np.resize([1e300, -1e300], 10)  # a whole stratum of random-k's, which draws one
    with jax.enable_x64(True):
        g = {"f64": rng.normal(size=40), "f32": rng.normal(size=30).astype(np.float32)}
        g["f64"][:10] = big
        tx = sidco.compressor(name, 0.1)
        state = tx.init(g)
        update = jax.jit(tx.update)
        for _ in range(3):
            sent, after = update(g, state)
            assert_finite_tree(sent, "update")
            assert_finite_tree(after, "state")
            assert not bool(after.last.nonfinite)
            s = np.asarray(sent["f64"])
            if state.residual is None:  # dense: no float32 message, the float64 mean
                np.testing.assert_array_equal(s, g["f64"])
            else:
                owed = g["f64"] + np.asarray(state.residual["f64"])
                np.testing.assert_array_equal(np.asarray(after.residual["f64"]), owed - s)
                saturated = s[:10] == np.sign(big) * top
                assert np.all(saturated | (s[:10] == 0)) and np.any(saturated), s[:10]
            state = after
