import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import quick_first

import sidco_jax as sidco


def oracle(x, eta, capacity):
    selected = np.flatnonzero(np.abs(x) > eta)
    return selected[:capacity], selected.size


# 2**18 + 5 entries are 513 groups of 16 words: the prefix's matmul path.
@pytest.mark.parametrize("n", [1, 7, 1000, 4099, 2**16 + 3, 2**18 + 5])
@pytest.mark.parametrize("leaves", [1, 3])
@pytest.mark.parametrize("density", quick_first([0.05, 0.6, 0.002]))
def test_payload_is_the_first_selected_entries(rng, n, leaves, density):
    x = rng.standard_t(3, size=n).astype(np.float32)
    eta = np.float32(np.quantile(np.abs(x), 1 - density)) if n > 1 else np.float32(0.5)
    cap = sidco.capacity(n, density * 0.8)  # some overflow
    # As a tree: cut into uneven leaves (one may be empty), one 2-D.
    cuts = np.sort(rng.integers(0, n + 1, size=leaves - 1))
    parts = np.split(x, cuts)
    tree = {f"{i}": p.reshape(-1, 1) if i == 0 else p for i, p in enumerate(parts)}
    p = jax.jit(lambda t: sidco.sparsify(t, eta, cap))(tree)
    want, total = oracle(x, eta, cap)
    count = int(p.count)
    assert count == want.size and int(p.selected) == total
    assert int(p.overflow) == total - want.size
    np.testing.assert_array_equal(np.asarray(p.indices)[:count], want)
    np.testing.assert_array_equal(np.asarray(p.values)[:count], x[want])
    assert np.all(np.asarray(p.indices)[count:] == n) and np.all(np.asarray(p.values)[count:] == 0)


def test_round_trip_without_overflow(rng):
    x = rng.laplace(size=(64, 513)).astype(np.float32)
    eta = sidco.threshold(x, 0.01, stages=2)
    p = sidco.sparsify(x, eta, sidco.capacity(x.size, 0.01, capacity_factor=2.0))
    assert int(p.overflow) == 0
    dense = sidco.densify(p, x.size).reshape(x.shape)
    np.testing.assert_array_equal(dense, np.where(np.abs(x) > float(eta), x, 0))


def test_overflow_is_counted_exactly(rng):
    x = rng.normal(size=10_000).astype(np.float32)
    p = sidco.sparsify(x, 0.0, capacity=100)  # everything nonzero is selected
    assert int(p.selected) == np.count_nonzero(x) and int(p.overflow) == int(p.selected) - 100
    sent = np.asarray(sidco.densify(p, x.size))
    np.testing.assert_array_equal(sent[:100], x[:100])
    assert np.all(sent[100:] == 0)


def test_densify_accumulates_duplicates_and_drops_padding():
    a = sidco.sparsify(jnp.array([1.0, 0.0, 3.0, 0.0]), 0.5, capacity=3)
    b = sidco.sparsify(jnp.array([2.0, 5.0, 0.0, 0.0]), 0.5, capacity=3)
    stacked = jax.tree.map(lambda *t: jnp.stack(t), a, b)
    np.testing.assert_array_equal(sidco.densify(stacked, 4), [3.0, 5.0, 3.0, 0.0])


def test_densify_refuses_a_size_that_would_drop_sent_entries():
    x = jnp.arange(10.0)
    p = sidco.sparsify(x, 4.5, capacity=6)  # entries 5 to 9, then one padding slot
    stacked = jax.tree.map(lambda *t: jnp.stack(t), sidco.sparsify(x[:8], 6.5, 6), p)
    for payload in (p, stacked):
        with pytest.raises(ValueError, match=r"size 6 .*entry 9 .*at least 10"):
            sidco.densify(payload, 6)
    np.testing.assert_array_equal(sidco.densify(p, 10), np.where(x > 4.5, x, 0))
    # The padding index (the size sparsify saw) is no entry: a larger size is fine.
    np.testing.assert_array_equal(sidco.densify(p, 12)[:10], np.where(x > 4.5, x, 0))
    # Under jit the indices are not known: densify cannot check them there.
    np.testing.assert_array_equal(
        jax.jit(sidco.densify, static_argnums=1)(p, 10), sidco.densify(p, 10)
    )
    with pytest.raises(ValueError, match=r"size must be an integer in \[0, 2\*\*31 - 1\], got -1"):
        sidco.densify(p, -1)


def test_nan_entries_are_never_selected_and_negative_threshold_selects_all():
    x = jnp.array([jnp.nan, 2.0, 0.0, -1.0, 0.0])
    p = sidco.sparsify(x, 1.0, capacity=4)
    np.testing.assert_array_equal(p.indices, [1, 5, 5, 5])
    q = sidco.sparsify(x[1:], -1.0, capacity=4)
    np.testing.assert_array_equal(sidco.densify(q, 4), x[1:])


def test_half_precision_values_keep_their_dtype(rng):
    x = jnp.asarray(rng.normal(size=1000), jnp.bfloat16)
    p = sidco.sparsify(x, 1.5, capacity=300)
    assert p.values.dtype == jnp.bfloat16 and p.indices.dtype == jnp.int32
    np.testing.assert_array_equal(sidco.densify(p, 1000), jnp.where(jnp.abs(x) > 1.5, x, 0))


def test_no_retrace_when_the_threshold_changes(rng):
    x = jnp.asarray(rng.normal(size=5000).astype(np.float32))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(x, eta):
        return sidco.sparsify(x, eta, 100)

    counts = [int(f(x, jnp.float32(t)).selected) for t in (0.5, 1.0, 2.0)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[2]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"2\*\*31 - 1"):
        jax.eval_shape(
            lambda x: sidco.sparsify(x, 1.0, 10),
            jax.ShapeDtypeStruct((2**31,), jnp.float32),
        )
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        sidco.sparsify(jnp.ones(4), 1.0, 0)
    with pytest.raises(TypeError, match="floating-point"):
        sidco.sparsify(jnp.ones(4, jnp.int32), 1.0, 2)
    with pytest.raises(ValueError, match=r"capacity_factor must be >= 1, got 0\.5"):
        sidco.capacity(100, 0.1, capacity_factor=0.5)
    with pytest.raises(ValueError, match="ratio must be in"):
        sidco.capacity(100, 0.0)
    assert sidco.capacity(100, 1.0, capacity_factor=3.0) == 100 and sidco.capacity(10, 1e-6) == 1


@pytest.mark.parametrize("kind", ["student_t", "ties_and_zeros", "mostly_zero"])
def test_top_by_count_is_lax_top_k_without_a_sort(rng, kind):
    # The starved-payload fill: the same entries as lax.top_k over the
    # concatenation (ties to the lower index), in index order, and the same k-th magnitude.
    from jax import lax

    from sidco_jax._src.ops.payload import top_by_count

    make = {
        "student_t": lambda s: rng.standard_t(3, s),
        "ties_and_zeros": lambda s: rng.integers(-3, 4, s).astype(float),
        "mostly_zero": lambda s: np.where(rng.random(s) < 0.05, rng.normal(size=s), 0.0),
    }[kind]
    vectors = [jnp.asarray(make(s), jnp.float32) for s in (700, 0, 1300)]
    flat = jnp.concatenate(vectors)
    for k in (1, 91, 2000):
        payload, kth = jax.jit(top_by_count, static_argnums=1)(vectors, k)
        mags, want = lax.top_k(jnp.abs(flat), k)
        np.testing.assert_array_equal(payload.indices, np.sort(want))
        np.testing.assert_array_equal(payload.values, flat[payload.indices])
        assert float(kth) == float(mags[-1]) and int(payload.count) == k
    assert "top_k" not in str(jax.make_jaxpr(top_by_count, static_argnums=1)(vectors, 91))


def test_payload_search_is_a_loop_on_cpu_and_unrolled_elsewhere():
    # On a GPU each step of a while loop costs a launch and a host round trip;
    # on XLA's CPU backend the unrolled search is 2.3x slower.
    payload = jax.jit(lambda x: sidco.sparsify(x, 0.5, 64))
    x = jnp.linspace(-1.0, 1.0, 4096)
    assert "stablehlo.while" in payload.trace(x).lower(lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.while" not in payload.trace(x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind", quick_first(["ties_and_zeros", "student_t"]))
def test_strongest_keeps_the_largest_of_a_wide_payload(rng, kind):
    # adaptation="fill" gathers up to 4x the capacity, then keeps the largest, in index
    # order: counted on CPU, sorted elsewhere; both the same entries as a NumPy sort.
    from sidco_jax._src.ops import passes
    from sidco_jax._src.ops.payload import strongest

    n, cap = 5000, 50
    width = 4 * cap
    make = {
        "student_t": lambda: rng.standard_t(3, n),
        "ties_and_zeros": lambda: rng.integers(-3, 4, n).astype(float),
    }[kind]
    x = np.asarray(make(), np.float32)
    ranked = np.sort(np.abs(x))[::-1]
    for formulation, sorts in (("words", False), ("blocks", True)):  # XLA:CPU's, GPU/TPU's
        for passing in (10 * cap, 2 * cap, cap // 2):  # over 4x the capacity, 1-4x, under 1x
            eta = np.nextafter(ranked[passing], np.float32(0))  # ties all pass
            wide = sidco.sparsify(x, eta, width)
            with passes.formulation(formulation):  # a fresh function: traced anew
                picked = jax.jit(lambda wide: strongest(wide, cap))
                got, text = picked(wide), picked.lower(wide).as_text()
            first = np.flatnonzero(np.abs(x) > eta)[:width]  # what the wide payload holds
            order = np.argsort(-np.abs(x[first]), kind="stable")  # ties: lower index first
            want = np.full(cap, n)
            want[: min(cap, first.size)] = first[order][:cap]
            np.testing.assert_array_equal(got.indices, np.sort(want))
            values = np.where(got.indices < n, x[got.indices % n], 0)
            np.testing.assert_array_equal(got.values, values)
            assert int(got.selected) == int(wide.selected)
            assert int(got.count) == min(int(wide.selected), cap)
            assert ("stablehlo.sort" in text) == sorts
