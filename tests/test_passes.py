"""The streaming passes against NumPy: bitmask words and counts over awkward sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sidco_jax._src.ops import passes


def oracle_words(x, threshold, inclusive, multiple):
    above = np.abs(x) >= threshold if inclusive else np.abs(x) > threshold
    padded = np.zeros(-(-x.size // 32) * 32, bool)
    padded[: x.size] = above
    words = (padded.reshape(-1, 32) * (1 << np.arange(32, dtype=np.uint64))).sum(1)
    words = np.concatenate([words, np.zeros(-words.size % multiple)])
    return words.astype(np.uint32)


# Sizes around the aligned body of 64 words (2048 entries): below it, exactly
# on it, past it by whole words, by a partial word, and both.
@pytest.mark.parametrize("n", [1, 31, 2048, 2048 + 64, 2048 + 7, 3 * 2048 + 5 * 32 + 13])
@pytest.mark.parametrize("multiple", [1, 16])
@pytest.mark.parametrize("inclusive", [False, True])
def test_block_words_are_the_bits_of_each_32_entries(rng, n, multiple, inclusive):
    x = rng.standard_normal(n).astype(np.float32)
    x[::7] = 1.0  # ties at the threshold
    words = jax.jit(
        lambda v: passes.block_words(v, jnp.float32(1.0), inclusive=inclusive, multiple=multiple)
    )(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(words), oracle_words(x, 1.0, inclusive, multiple))


@pytest.mark.parametrize("sizes", [[0, 5], [2048 + 7, 64 * 32 * 3, 1]])
def test_count_above_counts_every_vector(rng, sizes):
    xs = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    count = jax.jit(lambda vs: passes.count_above(vs, jnp.float32(0.5)))(
        [jnp.asarray(x) for x in xs]
    )
    assert int(count) == sum(int(np.sum(np.abs(x) > 0.5)) for x in xs)


# Row widths are 128 for one sum and 16 for two: sizes below, on and past them.
@pytest.mark.parametrize("sizes", [[5], [128, 16 * 9 + 3], [128 * 40 + 77, 0, 1]])
@pytest.mark.parametrize("sums", [1, 2])
def test_count_and_sums_match_numpy_over_awkward_sizes(rng, sizes, sums):
    xs = [rng.standard_normal(s).astype(np.float32) for s in sizes]
    excess = lambda v, zero, t: jnp.maximum(jnp.abs(v) - t, zero)  # noqa: E731
    terms = [excess, lambda v, zero, t: excess(v, zero, t) ** 2][:sums]
    count, got = jax.jit(
        lambda vs: passes.count_and_sums(vs, jnp.float32(0.5), terms, [jnp.float32(0.5)])
    )([jnp.asarray(x) for x in xs])
    v = np.abs(np.concatenate(xs).astype(np.float64))
    assert int(count) == int(np.sum(v > 0.5))
    want = [np.sum(np.maximum(v - 0.5, 0)), np.sum(np.maximum(v - 0.5, 0) ** 2)][:sums]
    np.testing.assert_allclose(got, want, rtol=1e-5)
