"""Wire formats: each codec against a NumPy oracle, nothing lost, and the bytes it claims.

The multi-device properties (nothing lost and identical replicas in every
communication mode, the HLO's bytes) are in the slow tier below.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import (
    AXIS,
    DEVICES,
    SHAPES,
    WITH_INDICES,
    assert_mapped_agrees,
    copies,
    device_residual,
    flat_residual,
    full_size_lines,
    gradient_stream,
    one_of_each_kind,
    params_tree,
    quick_first,
    run_shard_map,
)

import sidco_jax as sidco
from sidco_jax._src.ops import codecs

PAIRS = [(v, i) for v in sidco.VALUE_CODECS for i in ("int32", "chunked")]
# Every compressor that sends its own indices.


def _rows(rng, rows, slots, space, filled):
    """``rows`` payload rows: ``filled[r]`` ascending indices below ``space``, then padding."""
    values = np.zeros((rows, slots), np.float32)
    indices = np.full((rows, slots), space, np.int32)
    for r, count in enumerate(filled):
        indices[r, :count] = np.sort(rng.choice(space, count, replace=False))
        values[r, :count] = rng.standard_t(3, count) * 10.0 ** rng.integers(-3, 3)
    return values, indices


def _oracle(name, values, valid):
    """What a receiver decodes, computed in NumPy, block by block."""
    if name == "float32":
        return values
    if name == "bfloat16":
        return values.astype(ml_dtypes.bfloat16).astype(np.float32)
    out = np.empty_like(values)
    for start in range(0, values.shape[1], codecs.BLOCK):
        v = values[:, start : start + codecs.BLOCK]
        ok = valid[:, start : start + codecs.BLOCK]
        mag = np.where(ok, np.abs(v), np.float32(0))
        if name == "int8":
            scale = (mag.max(1, keepdims=True) / np.float32(127)).astype(np.float32)
            q = np.round(np.divide(v, scale, out=np.zeros_like(v), where=scale > 0))
            out[:, start : start + codecs.BLOCK] = np.clip(q, -127, 127) * scale
        else:
            mean = mag.sum(1, keepdims=True) / np.maximum(ok.sum(1, keepdims=True), 1)
            out[:, start : start + codecs.BLOCK] = np.where(v < 0, -mean, mean)
    return out


@pytest.mark.parametrize(("values", "indices"), PAIRS)
def test_each_codec_decodes_what_the_numpy_oracle_does(rng, values, indices):
    space, slots = 3 * codecs.CHUNK + 17, 700  # 4 chunks, 3 blocks (the last partial)
    v, i = _rows(rng, 3, slots, space, filled=[700, 300, 0])
    codec = codecs.Codec(values, indices)
    message = jax.jit(codec.encode, static_argnums=2)(v, i, space)
    got_v, got_i = jax.jit(codec.decode, static_argnums=(1, 2))(message, slots, space)
    np.testing.assert_array_equal(got_i, i)  # indices are lossless
    np.testing.assert_allclose(got_v, _oracle(values, v, i < space), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(codec.decode_values(message, slots), got_v)  # the sender's view
    assert codec.bytes(slots, space, rows=3) == sum(x.nbytes for x in jax.tree.leaves(message))


def test_a_wholly_selected_chunk_keeps_its_count():
    space = 2 * codecs.CHUNK + 5  # ratio 1: every chunk full, 2**16 in the first two
    i = np.arange(space, dtype=np.int32)[None]
    codec = codecs.Codec("float32", "chunked")
    message = codec.encode(jnp.ones((1, space)), i, space)
    np.testing.assert_array_equal(message.counts, [[codecs.CHUNK, codecs.CHUNK, 5]])
    np.testing.assert_array_equal(codec.decode(message, space, space)[1], i)


def test_auto_indices_take_the_smaller_message():
    sparse, dense_ish = (100, 2**24), (100, 2**12)
    assert codecs.Codec("int8", "auto").at(*sparse).indices == "int32"  # 256 counts > 100 slots
    assert codecs.Codec("int8", "auto").at(*dense_ish).indices == "chunked"
    for slots, space in (sparse, dense_ish):
        best = codecs.Codec("int8", "auto").at(slots, space)
        assert best.bytes(slots, space) == min(
            codecs.Codec("int8", i).bytes(slots, space) for i in ("int32", "chunked")
        )


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def _lost(given, updates, state, devices):
    """``given`` less devices x the updates and every residual (0: nothing lost).

    ``given`` holds each step's gradients summed over the devices that hold a residual.
    """
    given = sum(_flat(g) for g in given)
    sent = devices * sum(_flat(u) for u in updates)
    residuals = [device_residual(state.residual, d, devices) for d in range(devices)]
    kept = sum(flat_residual(state._replace(residual=r)) for r in residuals)
    return given - (sent + kept)


@pytest.mark.parametrize("pair", quick_first(PAIRS[::-1]), ids=str)
def test_one_device_loses_nothing_the_rounding_stays_in_the_residual(rng, pair):
    values, indices = pair
    stream = gradient_stream(rng, 6)
    tx = sidco.compress(0.05, values=values, indices=indices)
    state, update = tx.init(params_tree()), jax.jit(tx.update)
    total = jax.tree.map(jnp.zeros_like, params_tree())
    for grads in stream:
        u, state = update(jax.tree.map(lambda g: g[0], grads), state)
        total = jax.tree.map(jnp.add, total, u)
    given = jax.tree.map(lambda *g: sum(x[0] for x in g), *stream)
    for name in SHAPES:
        np.testing.assert_allclose(total[name] + state.residual[name], given[name], atol=2e-5)
    if values != "float32":  # the rounding is kept, not thrown away
        assert float(jnp.max(jnp.abs(total["w"]))) > 0


@pytest.mark.parametrize("pair", quick_first(PAIRS[::-1]), ids=str)
def test_a_non_finite_gradient_never_reaches_the_encoder(pair):
    values, indices = pair
    tx = sidco.compress(0.1, values=values, indices=indices)
    g = jnp.linspace(-1.0, 1.0, 1000)
    state = tx.init(g)
    _, state = tx.update(g, state)
    sent, after = tx.update(g.at[7].set(jnp.nan), state)
    np.testing.assert_array_equal(sent, 0.0)
    np.testing.assert_array_equal(after.residual, state.residual)
    assert bool(sidco.metrics(after)["nonfinite"])


@pytest.mark.parametrize(("values", "indices"), [("int8", "chunked"), ("sign", "int32")])
def test_bytes_in_the_metrics_are_the_messages(values, indices):
    n, ratio = 5000, 0.02
    tx = sidco.compress(ratio, values=values, indices=indices)
    _, state = tx.update(jnp.linspace(-1.0, 1.0, n), tx.init(jnp.zeros(n)))
    k = sidco.capacity(n, ratio)
    assert int(sidco.metrics(state)["bytes"]) == codecs.Codec(values, indices).bytes(k, n)


@pytest.mark.slow
@pytest.mark.parametrize(("values", "indices"), [("int8", "chunked"), ("sign", "chunked")])
def test_decoding_adds_no_pass_over_the_gradient(values, indices):
    # Coding works on the k slots: the compiled update names a gradient-sized array
    # exactly as often as the default's (decoding feeds the scatter that forms the update).
    grads = jnp.zeros((64, 512))

    def passes(**wire):
        tx = sidco.compress(0.01, **wire)
        return len(full_size_lines(jax.jit(tx.update), grads, tx.init(grads), shape=(64, 512)))

    assert passes(values=values, indices=indices) == passes()


@pytest.mark.parametrize("build", [sidco.randomk, lambda ratio, **kw: sidco.dense(**kw)])
def test_compressors_without_indices_of_their_own_refuse_a_codec(build):
    with pytest.raises(ValueError, match=r"values='int8' and indices='int32' do not apply"):
        build(0.1, values="int8")
    build(0.1, values="float32", indices="int32")  # the defaults, spelled out


# ---------------------------------------------------------------- several devices

slow = pytest.mark.slow


def _replicas_agree(updates, states):
    for update, state in zip(updates, states, strict=True):
        for leaf in jax.tree.leaves((update, state._replace(residual=None))):
            first, *rest = copies(leaf)
            for other in rest:
                np.testing.assert_array_equal(other, first)


# Every value x index format once, each value and each index format in both modes.
EIGHT = [
    (v, i, ("sparse", "sparse_allreduce")[(a + b) % 2])
    for a, v in enumerate(sidco.VALUE_CODECS)
    for b, i in enumerate(("int32", "chunked"))
]


@slow
@pytest.mark.parametrize(("values", "indices", "mode"), EIGHT)
def test_eight_devices_lose_nothing_and_replicas_agree(rng, mode, values, indices):
    stream = gradient_stream(rng, 5)
    tx = sidco.compress(0.05, axis_name=AXIS, communication=mode, values=values, indices=indices)
    updates, states, _ = run_shard_map(tx, stream)  # check_vma=True
    given = [jax.tree.map(lambda g: g.sum(0), grads) for grads in stream]
    np.testing.assert_allclose(_lost(given, updates, states[-1], DEVICES), 0.0, atol=1e-4)
    _replicas_agree(updates, states)


WIDE = {"w": (600, 500), "b": (40,), "v": (3001,)}  # 303,041 entries: 5 chunks, 2 per region


def _step(tx, mesh, specs, data):
    """A jitted ``shard_map`` update over ``data``: the update replicated, the state ``specs``."""

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(specs, jax.P(data)), out_specs=(jax.P(), specs)
    )
    def step(state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    return step


def _run_wide(tx, rng, steps=3, devices=2):
    """``tx`` on 2 devices over a gradient wider than two chunks, dyadic values (many ties)."""
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices])
    params = sidco.parallel.place({k: jnp.zeros(s) for k, s in WIDE.items()}, mesh)
    state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
    step = _step(tx, mesh, sidco.parallel.state_specs(state, AXIS), AXIS)
    out = []
    for _ in range(steps):
        grads = {
            k: np.round(rng.standard_t(3, (devices, *s)) * 8).clip(-32, 32).astype(np.float32) / 64
            for k, s in WIDE.items()
        }
        out.append(step(state, sidco.parallel.place(grads, mesh, jax.P(AXIS))))
        state = out[-1][1]
    return out


# A payload over the whole model under the sparse all-reduce (its own and its owners'
# reselection), and per-leaf payloads under the gather: each kind of rule, SIDCo's and
# top-k's both ways (sparsify with the fill's strongest; top_k), the others one way each.
PATHS = (("sparse_allreduce", "model"), ("sparse", "leaf"))
CHUNKED = [
    (name, *path)
    for i, name in enumerate(one_of_each_kind(WITH_INDICES))
    for path in (PATHS if sidco.traits(name).kind in ("fit", "top-k") else [PATHS[i % 2]])
]


@slow
@pytest.mark.parametrize(("name", "mode", "granularity"), CHUNKED)
def test_chunked_indices_change_nothing_but_the_bytes(name, mode, granularity):
    # Lossless only if every payload keeps its filled slots first, in index order, across
    # chunks: SIDCo's path (sparsify, the fill's strongest), top-k's (top_k) and the ties.
    def run(indices):
        tx = sidco.compressor(
            name, 0.01, axis_name=AXIS, communication=mode, granularity=granularity,
            indices=indices,
        )  # fmt: skip
        return _run_wide(tx, np.random.default_rng(7))

    def but_bytes(state):
        return state._replace(last=state.last._replace(bytes=0))

    want, got = run("int32"), run("chunked")
    chex.assert_trees_all_equal([u for u, _ in got], [u for u, _ in want])
    chex.assert_trees_all_equal([but_bytes(s) for _, s in got], [but_bytes(s) for _, s in want])
    assert int(got[-1][1].last.bytes) < int(want[-1][1].last.bytes)


@slow
def test_hierarchical_warm_up_and_accumulation_lose_nothing(rng):
    # Two micro-steps per step, two of them warm-up, the node's mean compressed over "node".
    mesh = jax.make_mesh((2, 4), ("node", "local"), devices=jax.devices()[:8])
    every = ("node", "local")
    compressor = sidco.compress(
        0.05, axis_name="node", inner_axis="local", warmup_steps=2,
        values="int8", indices="chunked",
    )  # fmt: skip
    tx = sidco.accumulate(compressor, 2)
    stream = gradient_stream(rng, 8)
    state = sidco.parallel.shard_init(
        tx, sidco.parallel.place(params_tree(), mesh), mesh, "node", accumulator_axis=every
    )
    specs = sidco.parallel.state_specs(state, "node", accumulator_axis=every)
    step = _step(tx, mesh, specs, every)
    updates = []
    for grads in stream:
        update, state = step(state, sidco.parallel.place(grads, mesh, jax.P(every)))
        updates.append(update)
    # 2 nodes x the updates and both nodes' residuals: the sum of every gradient over 8.
    given = [jax.tree.map(lambda g: g.sum(0) / 8, grads) for grads in stream]
    lost = _lost(given, updates, state.inner, 2)
    np.testing.assert_allclose(lost, 0.0, atol=1e-4)


@slow
@pytest.mark.parametrize("mode", ["sparse", "sparse_allreduce"])
def test_pmap_and_shard_map_agree_bit_for_bit(rng, mode):
    tx = sidco.compress(0.05, axis_name=AXIS, communication=mode, values="sign", indices="chunked")
    assert_mapped_agrees(jax.pmap, tx, gradient_stream(rng, 4))
