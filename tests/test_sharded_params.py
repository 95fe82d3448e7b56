"""Sharded parameters: FSDP within a node, compressed across nodes (``inner_shards="params"``).

The parameters are sharded over the node's devices (``local``) and replicated
across nodes; the gradient reaches the compressor as this device's shard of
the node's mean (:func:`sidco_jax.parallel.gather`'s backward pass) and the
update leaves as that shard.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    SHAPES,
    gradient_stream,
    one_of_each_kind,
    params_tree,
    require_libtpu,
    run_on_mesh,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco

pytestmark = pytest.mark.slow  # 8 devices: -m 'not slow' leaves this file out

NODE, LOCAL = "node", "local"
NODES, SHARDS = 2, 4
BOTH = (NODE, LOCAL)
SPECS = P(LOCAL)  # every leaf split along its first axis (48, 40 and 300 rows)
N = sum(int(np.prod(s)) for s in SHAPES.values())


def _mesh():
    return jax.make_mesh((NODES, SHARDS), BOTH, devices=jax.devices()[: NODES * SHARDS])


def _owned(name="sidco-e", ratio=0.05, **options):
    options = {"axis_name": NODE, "inner_axis": LOCAL, "inner_shards": "params", **options}
    return sidco.compressor(name, ratio, **options)


def _shards_of_the_node_mean(params, grads):
    """This device's shard of its node's mean gradient, through gather's backward pass.

    ``grads`` are this device's whole gradients; the linear loss ``<gather(p), grads>``
    has them as its gradient at the whole parameters.
    """

    def linear(p):
        whole = sidco.parallel.gather(p, SPECS)
        pairs = zip(jax.tree.leaves(whole), jax.tree.leaves(grads), strict=True)
        return sum(jnp.vdot(w, g) for w, g in pairs)

    return jax.grad(linear)(jax.lax.pcast(params, NODE, to="varying"))


def run_owned(tx, stream):
    """``tx`` over the 2 x 4 mesh, parameters sharded over ``local``: each step's update (the
    shards as one global array per leaf) and the last state."""
    mesh = _mesh()
    params = sidco.parallel.place(params_tree(), mesh, SPECS)
    state = sidco.parallel.shard_init(tx, params, mesh, BOTH, SPECS)
    specs = sidco.parallel.state_specs(state, BOTH)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(SPECS, specs, P(BOTH)),
        out_specs=(SPECS, specs),  # the update: the same on every node, split over local
        check_vma=True,
    )
    def step(params, state, grads):
        grads = _shards_of_the_node_mean(params, jax.tree.map(lambda g: g[0], grads))
        return tx.update(grads, state, params)

    updates = []
    for grads in stream:
        update, state = step(params, state, jax.device_put(grads, NamedSharding(mesh, P(BOTH))))
        updates.append(update)
    return updates, state


@pytest.mark.parametrize(("name", "mode"), [("sidco-e", "sparse_allreduce"), ("topk", "sparse")])
def test_shards_of_the_parameters_are_the_sharded_hierarchys_slices(rng, name, mode):
    # Per leaf, with every leaf split along its rows over the node's devices, a device's
    # shard of a leaf is its slice of the node's mean: both forms select, send and keep
    # the same entries, bit for bit, at any ratio.
    stream = gradient_stream(rng, 4)
    options = {"granularity": "leaf", "communication": mode}
    got, owned = run_owned(_owned(name, **options), stream)
    hierarchy = sidco.compressor(
        name, 0.05, axis_name=NODE, inner_axis=LOCAL, inner_shards=SHARDS, **options
    )
    want, sliced = run_on_mesh(hierarchy, stream, _mesh(), BOTH)
    chex.assert_trees_all_equal(got, want)
    chex.assert_trees_all_equal(owned.residual.shards, sliced.residual.slices)
    chex.assert_trees_all_equal(owned.last, sliced.last)
    assert all(np.count_nonzero(np.asarray(x)) for x in jax.tree.leaves(got[-1]))


@pytest.mark.parametrize("name", [*one_of_each_kind(sidco.COMPRESSORS)])
def test_at_ratio_one_it_is_dense_hybrid_sharding(rng, name):
    # psum_scatter over the node, then the mean over nodes: exact sums of multiples of 1/64.
    stream = gradient_stream(rng, 3)
    got, _ = run_owned(_owned(name, 1.0), stream)
    for update, grads in zip(got, stream, strict=True):
        want = jax.tree.map(lambda g: g.reshape(NODES * SHARDS, -1).mean(0), grads)
        chex.assert_trees_all_equal(jax.tree.map(np.ravel, update), jax.tree.map(np.asarray, want))


@pytest.mark.parametrize(
    "options",
    [
        {"communication": "sparse_allreduce"},
        {"values": "int8", "indices": "chunked", "warmup_steps": 2},
        {"layout": "buckets", "bucket_bytes": 1024, "communication": "dense"},
    ],
)
def test_nothing_is_lost_and_every_node_holds_the_same_shards(rng, options):
    stream = gradient_stream(rng, 6)
    got, state = run_owned(_owned(ratio=0.02, **options), stream)
    # The update is one global array per leaf, split over local and the same on every
    # node (shard_map's out_specs checked that); the residuals, one per device, add up
    # with it to every gradient given: each node's gradients are its devices' mean.
    sent = sum(np.concatenate([np.ravel(x) for x in jax.tree.leaves(u)]) for u in got)
    kept = _residual_by_node(state.residual).sum(0)
    given = sum(_leaves_by_device(g).sum(0) for g in stream) / SHARDS
    np.testing.assert_allclose(NODES * sent + kept, given, rtol=0, atol=1e-5)
    assert 0 < np.count_nonzero(got[-1]["w"]) < got[-1]["w"].size


def _leaves_by_device(tree) -> np.ndarray:
    """Per-device trees (a leading device axis) as one row of entries per device."""
    leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]
    return np.concatenate([x.reshape(len(x), -1) for x in leaves], axis=1)


def _residual_by_node(residual) -> np.ndarray:
    """Each node's residual as the whole model's entries (nodes x entries).

    The shards' buckets hold each device's rows of every leaf in leaf order; a node's
    devices follow each other along the buckets' first axis.
    """
    per_device = np.concatenate(
        [np.asarray(x).reshape(NODES * SHARDS, -1) for x in residual.shards], axis=1
    )
    shapes = list(SHAPES[k] for k in sorted(SHAPES))  # jax.tree.leaves order
    rows, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape)) // SHARDS
        rows.append(per_device[:, start : start + size].reshape(NODES, -1))
        start += size
    return np.concatenate(rows, axis=1)


def test_the_state_per_device_is_a_node_share_of_the_replicated_one():
    params = sidco.parallel.place(params_tree(), _mesh(), SPECS)
    tx = optax.chain(_owned(), optax.adam(1e-3))
    state = sidco.parallel.shard_init(tx, params, _mesh(), BOTH, SPECS)
    hierarchical = sidco.compress(0.05, axis_name=NODE, inner_axis=LOCAL)
    replicated = optax.chain(hierarchical, optax.adam(1e-3))
    placed = sidco.parallel.place(params_tree(), _mesh())
    whole = sidco.parallel.shard_init(replicated, placed, _mesh(), NODE)

    def per_device(tree):
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))

    assert per_device(state[0].residual) * SHARDS == per_device(whole[0].residual) == 4 * N
    # Adam's moments follow the parameters' shards; its step count (4 bytes) is replicated.
    assert per_device(state[1]) - 4 == (per_device(whole[1]) - 4) / SHARDS == 2 * 4 * N / SHARDS
    assert per_device(params) * SHARDS == 4 * N


def test_data_parallel_step_trains_sharded_parameters_as_replicated_ones(rng):
    # At ratio 1 with SGD, the sharded step is dense data parallelism: the same parameters
    # as the replicated step of dense(), shard by shard.
    mesh = _mesh()
    x = rng.normal(size=(64, 48)).astype(np.float32)
    y = rng.normal(size=(64, 40)).astype(np.float32)
    batch = sidco.parallel.place((x, y), mesh, P(BOTH))

    def loss(params, batch):
        x, y = batch
        return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    def train(tx, specs, state_axis):
        params = sidco.parallel.place({"w": np.zeros((48, 40)), "b": np.zeros(40)}, mesh, specs)
        state = sidco.parallel.shard_init(tx, params, mesh, state_axis, specs)
        step = sidco.parallel.data_parallel_step(
            loss, tx, state, mesh, BOTH, state_axis=state_axis, param_specs=specs
        )
        for _ in range(3):
            params, state, value = step(params, state, batch)
        return params, float(value)

    sharded = train(optax.chain(_owned(ratio=1.0), optax.sgd(0.1)), SPECS, BOTH)
    dense = train(optax.chain(sidco.dense(axis_name=BOTH), optax.sgd(0.1)), None, BOTH)
    # The same means summed in another order (over the node, then across; or over all 8):
    # last bits (exact sums are compared bit for bit above).
    chex.assert_trees_all_close(sharded, dense, rtol=1e-5, atol=1e-9)
    assert sharded[0]["w"].sharding.spec == P(LOCAL, None)  # each device: its rows


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"inner_shards": "param"}, TypeError, "None, a positive int or 'params'"),
        ({"inner_shards": "params", "inner_axis": None}, ValueError, "inner_axis is None"),
        ({"inner_shards": "params", "layout": "tree"}, ValueError, "tree layout"),
    ],
)
def test_bad_options_fail_at_construction(options, error, message):
    options = {"axis_name": NODE, "inner_axis": LOCAL, **options}
    with pytest.raises(error, match=message):
        sidco.compress(0.01, **options)


def test_a_state_of_another_form_is_refused():
    params = {"w": jnp.zeros((8, 4))}
    sliced = sidco.compress(0.1, axis_name=NODE, inner_axis=LOCAL, inner_shards=SHARDS)
    one_node = jax.vmap(_owned().update, in_axes=(0, None), axis_name=LOCAL)
    update = jax.vmap(one_node, in_axes=(0, None), axis_name=NODE)
    refused = "'slices' layout, but this compressor keeps it as 'shards'"
    with pytest.raises(ValueError, match=refused):
        update({"w": jnp.zeros((NODES, SHARDS, 8, 4))}, sliced.init(params))


def test_checkpoints_round_trip_and_refuse_another_form_or_node_size(rng, tmp_path):
    _, state = run_owned(_owned(values="int8"), gradient_stream(rng, 2))
    sidco.save(tmp_path / "ckpt", state)
    placed = sidco.parallel.place(params_tree(), _mesh(), SPECS)
    target = sidco.parallel.shard_init(_owned(values="int8"), placed, _mesh(), BOTH, SPECS)
    restored = sidco.restore(tmp_path / "ckpt", target)
    chex.assert_trees_all_equal(restored, state)
    assert restored.residual.shards[0].sharding == target.residual.shards[0].sharding
    sliced = sidco.compress(0.05, axis_name=NODE, inner_axis=LOCAL, inner_shards=SHARDS)
    other = sidco.parallel.shard_init(sliced, params_tree(), _mesh(), BOTH)
    with pytest.raises(ValueError, match=r"'shards' layout and the target's is 'slices'"):
        sidco.restore(tmp_path / "ckpt", other)
    halves = jax.make_mesh((4, 2), BOTH, devices=jax.devices()[:8])
    placed = sidco.parallel.place(params_tree(), halves, SPECS)
    other = sidco.parallel.shard_init(_owned(values="int8"), placed, halves, BOTH, SPECS)
    with pytest.raises(ValueError, match=r"other shards.*leaf b is \(20,\) float32, not \(10,\)"):
        sidco.restore(tmp_path / "ckpt", other)


def test_accumulated_micro_steps_lose_nothing(rng):
    # Two micro-steps per step: each step compresses the mean of two node means.
    stream = gradient_stream(rng, 6)
    got, state = run_owned(sidco.accumulate(_owned(ratio=0.02), 2), stream)
    sent = sum(np.concatenate([np.ravel(x) for x in jax.tree.leaves(u)]) for u in got)
    kept = _residual_by_node(state.inner.residual).sum(0)
    given = sum(_leaves_by_device(g).sum(0) for g in stream) / SHARDS
    np.testing.assert_allclose(2 * (NODES * sent + kept), given, rtol=0, atol=1e-5)


def test_a_leaf_left_whole_among_sharded_parameters_is_refused():
    mesh, tx = _mesh(), _owned()
    specs = {"w": P(LOCAL), "b": P()}
    params = sidco.parallel.place({"w": np.zeros((48, 40)), "b": np.zeros(40)}, mesh)
    state = jax.eval_shape(tx.init, {"w": jnp.zeros((12, 40)), "b": jnp.zeros(40)})
    step = sidco.parallel.data_parallel_step(
        lambda p, x: jnp.sum(x @ p["w"] + p["b"]), tx, state, mesh, BOTH, param_specs=specs
    )
    with pytest.raises(ValueError, match=r"params\['b'\] is whole on every device"):
        step(params, state, np.zeros((8, 48), np.float32))


def _linear(params, grads):
    """A loss whose gradient at the whole parameters is this device's ``grads``."""
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True)
    return sum(jnp.vdot(p, g[0]) for p, g in pairs)


def _train(tx, stream, local: bool):
    """``tx`` through ``data_parallel_step`` with the parameters sharded over ``local``: one
    copy per node (``local``, as diloco trains them) or one for all; every step's parameters."""
    mesh = _mesh()
    placed = sidco.parallel.place(params_tree(), mesh, SPECS)
    state = sidco.parallel.shard_init(tx, placed, mesh, BOTH, SPECS)
    params = sidco.parallel.per_device(params_tree(), mesh, NODE, SPECS) if local else placed
    step = sidco.parallel.data_parallel_step(
        _linear, tx, state, mesh, BOTH, state_axis=BOTH, local_params=local, param_specs=SPECS
    )
    history = []
    for grads in stream:
        params, state, _ = step(params, state, grads)
        history.append(jax.tree.map(np.asarray, params))
    return history, state


def test_outer_steps_every_step_are_the_sharded_compressed_step(rng):
    # Dyadic gradients and learning rates: every difference is exact, so the anchor after
    # each synchronization is the compressed SGD step's parameters, bit for bit.
    stream = gradient_stream(rng, 4)
    tx = sidco.diloco(optax.sgd(0.5), optax.sgd(1.0), 1, _owned())
    got, state = _train(tx, stream, local=True)
    want, want_state = _train(optax.chain(_owned(), optax.sgd(0.5)), stream, local=False)
    for local, params in zip(got, want, strict=True):
        for node in range(NODES):
            chex.assert_trees_all_equal(jax.tree.map(lambda x, n=node: x[n], local), params)
    # The residual holds the learning rate's share of what the compressed step keeps.
    chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, state.exchange.residual),
        jax.tree.map(lambda r: 0.5 * np.asarray(r), want_state[0].residual),
    )
    assert 0 < np.count_nonzero(got[-1]["w"]) < got[-1]["w"].size


def test_outer_steps_lose_nothing_and_hold_a_node_share_of_the_state(rng):
    stream = gradient_stream(rng, 9)
    compressor = _owned(ratio=0.02, values="int8", indices="chunked")
    inner, outer = optax.sgd(0.5, momentum=0.9), optax.sgd(1.0, momentum=0.5)
    _, state = _train(sidco.diloco(inner, outer, 3, compressor), stream[:1], local=True)

    def per_device(tree):
        return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree))

    # The anchor, both momenta and the residual: each a node's share of the model.
    for part in (state.anchor, state.inner, state.outer, state.exchange.residual):
        assert per_device(part) * SHARDS == 4 * N, part
    assert state.anchor["w"].sharding.spec == P(LOCAL, None)
    # Without momentum outside, the anchor moves by minus each mean: NODES x its moves plus
    # the residuals are every node's pseudo-gradients, 0.5 x its mean gradients.
    tx = sidco.diloco(optax.sgd(0.5), optax.sgd(1.0), 3, compressor)
    _, state = _train(tx, stream, local=True)
    start = params_tree()
    moved = [np.ravel(start[k] - np.asarray(state.anchor[k])) for k in sorted(start)]
    moved = np.concatenate(moved)  # in jax.tree.leaves' order, as the rows below
    kept = _residual_by_node(state.exchange.residual).sum(0)
    owed = 0.5 * sum(_leaves_by_device(g).sum(0) for g in stream) / SHARDS
    np.testing.assert_allclose(NODES * moved + kept, owed, rtol=0, atol=1e-5)
    assert 0 < float(sidco.metrics(state.exchange)["density"]) <= 0.03


def test_outer_state_of_sharded_parameters_round_trips_a_checkpoint(rng, tmp_path):
    tx = sidco.diloco(optax.sgd(0.5, momentum=0.9), optax.sgd(1.0), 2, _owned())
    _, state = _train(tx, gradient_stream(rng, 3), local=True)
    sidco.save(tmp_path / "ckpt", state)
    placed = sidco.parallel.place(params_tree(), _mesh(), SPECS)
    target = sidco.parallel.shard_init(tx, placed, _mesh(), BOTH, SPECS)
    restored = sidco.restore(tmp_path / "ckpt", target)
    chex.assert_trees_all_equal(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.sharding == want.sharding


def _two_slices_step(tx, mesh, specs, n: int):
    """The hybrid step compiled for two TPU slices: FSDP's backward pass over a slice's chips,
    ``tx`` and the update applied; parameters ``(n // 256, 256)`` placed with ``specs``."""
    both = ("slice", "chip")
    shape = (n // 256, 256)
    params = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, specs))
    init = functools.partial(sidco.parallel.shard_init, tx, mesh=mesh, axis_name=both)
    state = jax.eval_shape(functools.partial(init, param_specs=specs), params)
    state_specs = sidco.parallel.state_specs(state, both)
    grads = jax.ShapeDtypeStruct((8, *shape), jnp.float32, sharding=NamedSharding(mesh, P(both)))

    def step(params, state, grads):
        # Varying over the batch's axes, those the parameters are not already split over.
        at = jax.lax.pcast(params, "slice" if specs != P() else both, to="varying")
        gather = jax.vjp(lambda p: sidco.parallel.gather(p, specs), at)[1]
        update, state = tx.update(gather(grads[0])[0], state, params)
        return optax.apply_updates(params, update), state

    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(specs, state_specs, P(both)), out_specs=(specs, state_specs)
    )
    return jax.jit(sharded).trace(params, state, grads).lower().compile()


def test_only_the_compressed_message_crosses_tpu_slices_and_the_state_is_a_quarter():
    # Two v5e:2x2 slices, the parameters split over a slice's chips: what crosses the
    # data-center network is each chip's compressed shard, as with inner_shards=4, and the
    # compiled program holds a quarter of the parameters per chip.
    require_libtpu()
    from benchmarks import accelerator

    mesh, n = accelerator.two_slices_mesh(), 2**16
    options = {"axis_name": "slice", "inner_axis": "chip", "indices": "chunked"}
    owned = _two_slices_step(
        sidco.compress(0.01, inner_shards="params", **options), mesh, P("chip"), n
    )
    sliced = _two_slices_step(sidco.compress(0.01, inner_shards=4, **options), mesh, P(), n)
    across = [c for c in sidco.hlo.collectives(owned) if c.between_slices]
    capacity = sidco.capacity(n // 4, 0.01)
    assert [c.operand_bytes for c in across if c.kind == "all-gather"] == [2 * capacity]
    assert all(c.operand_bytes <= 4096 for c in across), [tuple(c) for c in across]
    wire = sidco.costs.Codec("float32", "chunked")
    assert sum(c.operand_bytes for c in across) >= sidco.costs.message_bytes(
        "sparse", n // 4, capacity, 2, wire
    )
    replicated = sliced.memory_analysis().argument_size_in_bytes
    assert replicated - owned.memory_analysis().argument_size_in_bytes == 4 * (n - n // 4)
