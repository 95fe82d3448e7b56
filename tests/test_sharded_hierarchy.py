"""The sharded hierarchy: a node's devices share its compression (``inner_shards``)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    AXIS,
    SELECTING,
    SHAPES,
    copies,
    gradient_stream,
    mesh_of,
    mesh_step,
    one_of_each_kind,
    params_tree,
    run_on_mesh,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco

NODE, LOCAL = "node", "local"
NODES, SHARDS = 2, 4
BOTH = (NODE, LOCAL)
N = sum(int(np.prod(s)) for s in SHAPES.values())
MODES = ["sparse", "dense", "sparse_allreduce"]


def _mesh(nodes=NODES, shards=SHARDS):
    return jax.make_mesh((nodes, shards), BOTH, devices=jax.devices()[: nodes * shards])


def _sharded(ratio=0.02, name="sidco-e", **options):
    options = {"axis_name": NODE, "inner_axis": LOCAL, "inner_shards": SHARDS, **options}
    return sidco.compressor(name, ratio, **options)


def _rows(stacked) -> np.ndarray:
    """Per-device trees (a leading device axis) as one row of their entries per device."""
    leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(stacked)]
    return np.concatenate([x.reshape(len(x), -1) for x in leaves], axis=1)


def _flat(tree) -> np.ndarray:
    """A tree's entries in ``jax.tree.leaves`` order."""
    return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])


def _node_residuals(residual, parts, nodes=NODES, shards=SHARDS) -> np.ndarray:
    """Each node's whole residual (nodes x entries): its devices' slices of every part, joined."""
    rows = []
    for size, x in zip(parts, residual.slices, strict=True):
        x = np.asarray(x).reshape(nodes, -1)[:, :size]  # a node's devices follow each other
        rows.append(x)
    return np.concatenate(rows, axis=1)


def _each_from_the_start(tx, streams, mesh, m):
    """For each stream, ``tx`` over ``mesh`` from a fresh state: every update and the last state.

    What :func:`harness.run_on_mesh` returns for each, through one jitted step.
    """
    step, params, fresh, put = mesh_step(tx, mesh, AXIS, {"slice": jnp.zeros(m)})
    for stream in streams:
        state, updates = fresh, []
        for grads in stream:
            update, state = step(params, state, put(grads))
            updates.append(update)
        yield updates, state


@pytest.mark.slow
@pytest.mark.parametrize("communication", MODES)
def test_sharded_equals_compressing_each_slice_of_the_node_means(rng, communication):
    stream = gradient_stream(rng, 5)
    got, state = run_on_mesh(_sharded(communication=communication), stream, _mesh(), BOTH)
    # The reference: each device's slice of its node's mean (exact: dyadic / 4), compressed
    # over the 2 nodes with the flat compressor, one slice position at a time.
    means = [_rows(g).reshape(NODES, SHARDS, N).mean(1) for g in stream]
    m = N // SHARDS
    tx = sidco.compress(0.02, axis_name=AXIS, communication=communication)
    cuts = [[{"slice": x[:, j * m : (j + 1) * m]} for x in means] for j in range(SHARDS)]
    # Each slice position from a fresh state, through one jitted step (one trace, not four).
    for j, (want, want_state) in enumerate(_each_from_the_start(tx, cuts, mesh_of(NODES), m)):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(_flat(g)[j * m : (j + 1) * m], w["slice"])
        mine = np.asarray(state.residual.slices[0]).reshape(NODES, SHARDS, m)[:, j]
        np.testing.assert_array_equal(mine, np.asarray(want_state.residual["slice"]).reshape(2, m))
    assert state.residual.slices[0].shape == (NODES * SHARDS * m,)  # 1/4 of the model each


# Each value codec in the gather and each mode with int8: how a codec and a mode meet is
# the flat compressor's (test_codecs.py: every codec in both sparse modes); sharding only
# cuts the slices each device compresses.
SHARDED_WIRES = [(v, "sparse") for v in ("float32", "int8", "sign")] + [
    ("int8", mode) for mode in MODES if mode != "sparse"
]


@pytest.mark.slow
@pytest.mark.parametrize(("values", "communication"), SHARDED_WIRES)
def test_sharded_loses_nothing_and_replicas_agree(rng, communication, values):
    # Small buckets: several slices per device, and a leaf split between devices.
    stream = gradient_stream(rng, 4)
    tx = _sharded(communication=communication, values=values, indices="chunked", bucket_bytes=4000)
    updates, state = run_on_mesh(tx, stream, _mesh(), BOTH)
    parts = [340, 1920]  # b and v packed, w alone
    assert [x.shape[0] for x in state.residual.slices] == [8 * 85, 8 * 480]
    given = sum(_rows(g).sum(0) for g in stream)
    # Every device's gradient is 1/8 of the mean; a node's residual is owed by its 4 devices.
    kept = SHARDS * _node_residuals(state.residual, parts).sum(0)
    sent = NODES * SHARDS * sum(_flat(u) for u in updates)
    np.testing.assert_allclose(sent + kept, given, rtol=0, atol=1e-5)
    for update in updates:  # every device holds the same update
        for leaf in jax.tree.leaves(update):
            first, *rest = copies(leaf)
            for other in rest:
                np.testing.assert_array_equal(other, first)
    slots = sidco.capacity(85 + 480, 0.02)  # one selection over a device's slices
    assert 0 < float(sidco.metrics(state)["density"]) <= slots / (85 + 480)


# Sharding is the loop's: one compressor of each kind of rule (test_conformance.py runs
# every compressor).
@pytest.mark.slow
@pytest.mark.parametrize("name", one_of_each_kind(SELECTING))
def test_each_kind_of_rule_shards_and_loses_nothing(rng, name):
    stream = gradient_stream(rng, 3)
    updates, state = run_on_mesh(_sharded(0.05, name, bucket_bytes=4000), stream, _mesh(), BOTH)
    given = sum(_rows(g).sum(0) for g in stream)
    kept = SHARDS * _node_residuals(state.residual, [340, 1920]).sum(0)
    sent = NODES * SHARDS * sum(_flat(u) for u in updates)
    np.testing.assert_allclose(sent + kept, given, rtol=0, atol=1e-5)
    assert float(sidco.metrics(state)["density"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("communication", MODES)
def test_sharded_at_ratio_one_is_the_dense_mean_over_the_mesh(rng, communication):
    stream = gradient_stream(rng, 2)
    params = {**params_tree(), "half": jnp.zeros(7, jnp.bfloat16)}
    for grads in stream:
        grads["half"] = np.asarray(grads["v"][:, :7], jnp.bfloat16)
    for name in ("topk", "sidco-e", "dense"):
        tx = _sharded(1.0, name, communication=communication, bucket_bytes=4000)
        updates, _ = run_on_mesh(tx, stream, _mesh(), BOTH, params)
        for update, grads in zip(updates, stream, strict=True):
            for key in (*SHAPES, "half"):
                want = np.asarray(grads[key], np.float32).mean(0).astype(update[key].dtype)
                np.testing.assert_array_equal(update[key], want, err_msg=f"{name} {key}")


@pytest.mark.slow
def test_sharded_under_pmap_equals_shard_map(rng):
    stream = gradient_stream(rng, 3)
    tx = _sharded(values="int8", indices="chunked")
    want, want_state = run_on_mesh(tx, stream, _mesh(), BOTH)

    def nested(f):  # pmap's device axis is the node's: the new collectives run over it
        return jax.vmap(jax.pmap(f, axis_name=LOCAL), axis_name=NODE)

    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (NODES, SHARDS, *x.shape)), params_tree())
    state = nested(tx.init)(stacked)
    update = jax.jit(nested(tx.update))
    for grads, w in zip(stream, want, strict=True):
        grads = jax.tree.map(lambda g: g.reshape(NODES, SHARDS, *g.shape[1:]), grads)
        got, state = update(grads, state)
        for i in range(NODES):
            for j in range(SHARDS):
                chex.assert_trees_all_equal(jax.tree.map(lambda x, i=i, j=j: x[i, j], got), w)
    np.testing.assert_array_equal(
        np.asarray(state.residual.slices[0]).reshape(-1), want_state.residual.slices[0]
    )


@pytest.mark.slow
def test_sharded_with_warm_up_and_accumulation_loses_nothing(rng):
    stream = gradient_stream(rng, 6)
    tx = sidco.accumulate(_sharded(warmup_steps=1, values="int8", indices="chunked"), 2)
    params = jax.device_put(params_tree(), NamedSharding(_mesh(), P()))
    state = sidco.parallel.shard_init(tx, params, _mesh(), BOTH)
    step = sidco.parallel.data_parallel_step(
        lambda w, batch: sum(jnp.vdot(w[k], batch[k][0]) for k in SHAPES), tx, state, _mesh(), BOTH
    )
    total = np.zeros(N)
    for grads in stream:
        before = params
        params, state, _ = step(params, state, grads)
        total += _flat(jax.tree.map(lambda a, b: a - b, params, before))  # the update
    # After an even number of micro-steps the accumulator is empty; each optimizer step
    # compressed the mean of 2 micro-steps.
    kept = SHARDS * _node_residuals(state.inner.residual, [N]).sum(0)
    given = sum(_rows(g).sum(0) for g in stream)
    np.testing.assert_allclose(2 * (NODES * SHARDS * total + kept), given, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"inner_shards": 4}, ValueError, "inner_axis is None"),
        ({"inner_axis": LOCAL, "inner_shards": 0}, ValueError, "inner_shards must be"),
        ({"inner_axis": LOCAL, "inner_shards": "4"}, TypeError, "inner_shards must be"),
        ({"inner_axis": LOCAL, "inner_shards": 4, "layout": "tree"}, ValueError, "tree layout"),
        ({"inner_axis": NODE, "inner_shards": 4}, ValueError, "must differ from axis_name"),
    ],
)
def test_bad_sharding_options_fail_at_construction(options, error, message):
    for name in ("sidco-e", "topk", "randomk", "dense"):
        with pytest.raises(error, match=message):
            sidco.compressor(name, 0.01, **{"axis_name": NODE, **options})


def test_a_model_smaller_than_the_node_is_refused_at_init():
    with pytest.raises(ValueError, match="3 floating-point entries, fewer than the inner_shards=4"):
        _sharded().init({"w": jnp.zeros(3)})


@pytest.mark.slow
def test_an_inner_axis_of_another_size_is_named_with_both_sizes(rng):
    with pytest.raises(ValueError, match=r"inner_shards=2, but inner_axis 'local' has 4 devices"):
        run_on_mesh(_sharded(inner_shards=2), gradient_stream(rng, 1), _mesh(), BOTH)


@pytest.mark.slow
def test_a_replicated_state_is_refused_by_a_sharded_compressor(rng):
    replicated = sidco.compress(0.02, axis_name=NODE, inner_axis=LOCAL)
    params = jax.device_put(params_tree(), NamedSharding(_mesh(), P()))
    state = sidco.parallel.shard_init(replicated, params, _mesh(), NODE)
    step = sidco.parallel.data_parallel_step(
        lambda w, b: jnp.vdot(w["b"], b), _sharded(), state, _mesh(), BOTH, state_axis=NODE
    )
    with pytest.raises(ValueError, match=r"this compressor keeps it as 'slices' \(inner_shards\)"):
        step(params, state, np.ones((8, 40), np.float32))


def test_a_sharded_state_split_over_the_slow_axis_alone_is_refused():
    # It passed the check and failed in JAX with a hint (check_vma=False) that drops slices.
    params = jax.device_put(params_tree(), NamedSharding(_mesh(), P()))
    state = sidco.parallel.shard_init(_sharded(), params, _mesh(), NODE)
    step = sidco.parallel.data_parallel_step(
        lambda w, b: jnp.vdot(w["b"], b), _sharded(), state, _mesh(), BOTH, state_axis=NODE
    )
    with pytest.raises(ValueError, match=r"inner_shards=4.*state_axis=\('node', 'local'\)"):
        step(params, state, np.ones((8, 40), np.float32))


@pytest.mark.slow
def test_sharded_checkpoints_round_trip_and_refuse_another_node_size(rng, tmp_path):
    tx = _sharded(values="int8", indices="chunked")
    _, state = run_on_mesh(tx, gradient_stream(rng, 2), _mesh(), BOTH)
    sidco.save(tmp_path / "ckpt", state)
    target = sidco.parallel.shard_init(tx, params_tree(), _mesh(), BOTH)
    restored = sidco.restore(tmp_path / "ckpt", target)
    chex.assert_trees_all_equal(restored.residual, state.residual)
    assert restored.residual.slices[0].sharding == target.residual.slices[0].sharding
    halves = _sharded(values="int8", indices="chunked", inner_shards=2)
    other = sidco.parallel.shard_init(halves, params_tree(), _mesh(4, 2), BOTH)
    with pytest.raises(ValueError, match=r"other buckets.*shared by 2 devices, not 4"):
        sidco.restore(tmp_path / "ckpt", other)
    tree = sidco.parallel.shard_init(
        sidco.compress(0.02, axis_name=BOTH), params_tree(), _mesh(), BOTH
    )
    with pytest.raises(ValueError, match=r"'slices' layout.*converts to no"):
        sidco.restore(tmp_path / "ckpt", tree)


def test_slices_of_other_buckets_are_refused_though_their_shapes_coincide(tmp_path):
    params = {"a": jnp.zeros(9), "b": jnp.zeros(2), "c": jnp.zeros(6)}

    def state(bucket_bytes):  # buckets of 9 and 2 + 6 entries, or of 9 + 2 and 6
        return sidco.parallel.shard_init(_sharded(bucket_bytes=bucket_bytes), params, _mesh(), BOTH)

    saved, target = state(36), state(44)
    assert [x.shape for x in saved.residual.slices] == [x.shape for x in target.residual.slices]
    sidco.save(tmp_path / "ckpt", saved)
    with pytest.raises(ValueError, match=r"other buckets.*another bucket_bytes"):
        sidco.restore(tmp_path / "ckpt", target)


@pytest.mark.slow
def test_the_slow_axis_carries_a_slice_of_the_message():
    # From the compiled HLO: a reduce-scatter and an all-gather per bucket inside the node,
    # and across the nodes one device's message for its slice of 2^16 entries, 1/4 of it.
    n, nodes, shards = 2**16, NODES, SHARDS
    tx = _sharded(0.01, values="int8", indices="chunked")
    mesh = _mesh()
    params = jax.ShapeDtypeStruct((n,), jnp.float32)
    init = functools.partial(sidco.parallel.shard_init, tx, mesh=mesh, axis_name=BOTH)
    state = jax.eval_shape(init, params)
    specs = sidco.parallel.state_specs(state, BOTH)
    step = jax.jit(
        jax.shard_map(
            lambda s, g: tx.update(g[0], s),
            mesh=mesh,
            in_specs=(specs, P(BOTH)),
            out_specs=(P(), specs),
        )
    )
    grads = jax.ShapeDtypeStruct((8, n), jnp.float32, sharding=NamedSharding(mesh, P(BOTH)))
    found = sidco.hlo.collectives(step.lower(state, grads).compile())
    inside = sorted((c.kind, c.operand_bytes) for c in found if c.group_size == shards)
    assert inside == [("all-gather", 4 * n // shards), ("reduce-scatter", 4 * n)]
    across = [c for c in found if c.group_size == nodes]
    k = sidco.capacity(n // shards, 0.01)
    wire = sidco.costs.Codec("int8", "chunked")
    message = sidco.costs.message_bytes("sparse", n // shards, k, nodes, wire)
    assert sum(c.operand_bytes for c in across) == message
    assert all(c.result_bytes <= 64 for c in found if c.group_size == nodes * shards)  # figures
