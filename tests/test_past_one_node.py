"""Past one node: the sparse all-reduce, hierarchical meshes and the cost model behind "auto"."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    AXIS,
    DEVICES,
    SHAPES,
    WITH_INDICES,
    copies,
    device_residual,
    flat_residual,
    gradient_stream,
    mesh_of,
    run_on_mesh,
    run_shard_map,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco
from sidco_jax._src.analysis import costs

pytestmark = pytest.mark.slow  # multi-device or benchmark runs: -m 'not slow' leaves them out

# Every compressor whose payload carries indices (the all-reduce routes them), but SIDCo-P
# and SIDCo-GP, whose rules differ from SIDCo-E's only in the fit.
ROUTED = [n for n in WITH_INDICES if n not in ("sidco-p", "sidco-gp")]
NODE, LOCAL = "node", "local"


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def _lost(stream, updates, state, devices) -> np.ndarray:
    """The gradients' sum less devices x the updates and every residual: 0 if nothing is lost."""
    given = sum(_flat(jax.tree.map(lambda g: g[:devices].sum(0), grads)) for grads in stream)
    sent = devices * sum(_flat(u) for u in updates)
    kept = sum(
        flat_residual(state._replace(residual=device_residual(state.residual, d, devices)))
        for d in range(devices)
    )
    return given - (sent + kept)


@pytest.mark.parametrize(
    ("name", "devices"),
    [(name, DEVICES) for name in ROUTED] + [("sidco-e", 2), ("sidco-e", 4)],
)
def test_sparse_allreduce_loses_nothing_and_replicas_agree(rng, name, devices):
    # Dyadic gradients: every sum is exact, so the invariant holds bit for bit.
    stream = gradient_stream(rng, 5)
    tx = sidco.compressor(name, 0.02, axis_name=AXIS, communication="sparse_allreduce")
    updates, states, _ = run_shard_map(tx, stream, devices=devices)  # check_vma=True
    np.testing.assert_array_equal(_lost(stream, updates, states[-1], devices), 0.0)
    for update, state in zip(updates, states, strict=True):  # replicas bit-identical
        for leaf in jax.tree.leaves((update, state._replace(residual=None))):
            first, *rest = copies(leaf)
            for other in rest:
                np.testing.assert_array_equal(other, first)
    metrics = sidco.metrics(states[-1])
    window = 2 if name == "redsync" else 1  # RedSync's payload holds up to 2 k by design
    assert 0 < float(metrics["density"]) <= 0.02 * 1.05 * window
    # The update is the owners' reselection, not every device's payload side by side.
    n = sum(int(np.prod(s)) for s in SHAPES.values())
    nonzero = sum(int(np.count_nonzero(np.asarray(u))) for u in jax.tree.leaves(updates[-1]))
    assert 0 < nonzero < devices * sidco.capacity(n, 0.02)


def test_entries_beyond_an_owners_slots_stay_with_the_sender(rng):
    # Every device selects from the first region only: 2 x the even share fits, the rest waits.
    n, devices, ratio = 1024, 4, 0.125
    grads = np.zeros((devices, n), np.float32)
    grads[:, :128] = rng.integers(1, 9, size=(devices, 128))
    tx = sidco.topk(ratio, axis_name=AXIS, communication="sparse_allreduce")
    mesh = mesh_of(devices)
    state = sidco.parallel.shard_init(tx, jnp.zeros(n), mesh, AXIS)
    step = _step_1d(tx, mesh, state)
    update, state = step(state, _split(grads, mesh))
    k = int(n * ratio)
    slots = costs.plan(n, k, devices).route
    assert slots == 64
    metrics = sidco.metrics(state)
    assert round(float(metrics["density"]) * n * devices) == devices * slots
    assert int(metrics["overflow"]) == devices * (k - slots)
    residual = np.asarray(state.residual).reshape(devices, n)
    sent = devices * np.asarray(update) + residual.sum(0)
    np.testing.assert_array_equal(sent, grads.sum(0))
    assert np.count_nonzero(residual[:, :128]) >= devices * (k - slots)


def _split(x, mesh):
    return jax.device_put(x, NamedSharding(mesh, P(AXIS)))


def _step_1d(tx, mesh, state):
    specs = sidco.parallel.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=(P(), specs))
    def step(state, grads):
        return tx.update(grads[0], state)

    return step


def _mesh_2x4():
    return jax.make_mesh((2, 4), (NODE, LOCAL), devices=jax.devices()[:8])


@pytest.mark.parametrize("communication", ["sparse", "dense", "sparse_allreduce"])
def test_hierarchical_equals_compressing_the_node_means(rng, communication):
    stream = gradient_stream(rng, 6)
    tx = sidco.compress(0.02, axis_name=NODE, inner_axis=LOCAL, communication=communication)
    got, state = run_on_mesh(tx, stream, _mesh_2x4(), NODE)
    # The reference: two devices, each given its node's mean gradient (exact: dyadic / 4).
    node_means = [jax.tree.map(lambda g: g.reshape(2, 4, *g.shape[1:]).mean(1), s) for s in stream]
    flat = sidco.compress(0.02, axis_name=AXIS, communication=communication)
    want, want_states, _ = run_shard_map(flat, node_means, devices=2)
    for g, w in zip(got, want, strict=True):
        chex.assert_trees_all_equal(g, w)
    chex.assert_trees_all_equal(state.residual, want_states[-1].residual)
    for leaf in jax.tree.leaves(state.residual):  # per node: the local devices agree
        shards = {s.device.id: np.asarray(s.data) for s in leaf.addressable_shards}
        for node in range(2):
            first, *rest = (shards[d.id] for d in _mesh_2x4().devices[node])
            for other in rest:
                np.testing.assert_array_equal(other, first)


@pytest.mark.parametrize("communication", ["sparse", "dense", "sparse_allreduce"])
def test_every_mode_at_ratio_one_is_the_dense_mean(rng, communication):
    stream = gradient_stream(rng, 2)
    for tx, mesh_kind in (
        (sidco.topk(1.0, axis_name=AXIS, communication=communication), "flat"),
        (
            sidco.topk(1.0, axis_name=NODE, inner_axis=LOCAL, communication=communication),
            "hierarchical",
        ),
    ):
        if mesh_kind == "flat":
            updates, _, _ = run_shard_map(tx, stream)
        else:
            updates, _ = run_on_mesh(tx, stream, _mesh_2x4(), NODE)
        for update, grads in zip(updates, stream, strict=True):
            for key in SHAPES:
                np.testing.assert_array_equal(update[key], grads[key].mean(0), err_msg=mesh_kind)


def test_hierarchical_dense_is_the_mean_over_both_axes(rng):
    stream = gradient_stream(rng, 2)
    updates, _ = run_on_mesh(
        sidco.dense(axis_name=NODE, inner_axis=LOCAL), stream, _mesh_2x4(), NODE
    )
    for update, grads in zip(updates, stream, strict=True):
        for key in SHAPES:
            np.testing.assert_array_equal(update[key], grads[key].mean(0))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"axis_name": "node", "inner_axis": "node"}, ValueError, "must differ from axis_name"),
        (
            {"axis_name": ("node", "x"), "inner_axis": "x"},
            ValueError,
            "must differ from axis_name",
        ),
        ({"inner_axis": "local"}, ValueError, "needs an axis_name"),
        ({"axis_name": "node", "inner_axis": 3}, ValueError, "inner_axis must be None"),
        ({"link": (1e-6, 1e9)}, TypeError, "link must be None or a sidco_jax.costs.Link"),
        ({"link": sidco.costs.Link(latency=-1.0)}, ValueError, "link.latency must be"),
        ({"link": sidco.costs.Link(bandwidth=0.0)}, ValueError, "link.bandwidth must be"),
        ({"communication": "allreduce"}, ValueError, "communication must be one of"),
    ],
)
def test_bad_hierarchy_options_fail_at_construction(kwargs, error, message):
    for factory in (sidco.compress, sidco.topk, sidco.dgc):
        with pytest.raises(error, match=message):
            factory(0.01, **kwargs)


def test_an_unbound_inner_axis_names_itself():
    mesh = mesh_of(2)
    tx = sidco.compress(0.1, axis_name=AXIS, inner_axis="local")
    state = sidco.parallel.shard_init(tx, jnp.zeros(64), mesh, AXIS)
    with pytest.raises(NameError, match="inner_axis 'local' is not bound"):
        _step_1d(tx, mesh, state)(state, _split(jnp.ones((2, 64)), mesh))


def test_a_sparse_allreduce_over_more_devices_than_entries_is_refused():
    mesh = mesh_of(8)
    tx = sidco.topk(1.0, axis_name=AXIS, communication="sparse_allreduce")
    state = sidco.parallel.shard_init(tx, jnp.zeros(4), mesh, AXIS)
    with pytest.raises(ValueError, match="cannot fit them on 8 devices"):
        _step_1d(tx, mesh, state)(state, _split(jnp.ones((8, 4)), mesh))


def test_auto_takes_the_cheapest_mode_of_the_model():
    slow, fast = sidco.costs.Link(5e-6, 1.25e8), sidco.costs.Link(5e-6, 50e9)
    from sidco_jax._src.loop import aggregate

    # Few devices: gathering k slots from one other device beats routing 1.5 k.
    assert aggregate.resolve("auto", 2**20, 1049, 2, slow) == "sparse"
    # More devices: the sparse all-reduce's traffic stops growing with P.
    assert aggregate.resolve("auto", 2**20, 1049, 8, slow) == "sparse_allreduce"
    # A payload of half the model: the dense ring all-reduce moves fewer bytes.
    assert costs.choose(2**20, 2**19, 8, fast) == "dense"
    # A tiny model on many devices: latency decides, and gathering takes one round.
    assert costs.choose(64, 64, 64, fast) == "sparse"
    # An explicit mode is kept.
    assert aggregate.resolve("sparse", 2**20, 2**20, 8) == "sparse"
    # Shared indices are summed as values; the all-reduce is never chosen for them.
    assert costs.choose(2**20, 1049, 8, slow, shared=True) == "sparse"


@pytest.mark.parametrize(("devices", "ratio"), [(2, 0.01), (8, 0.001)])
def test_the_model_counts_the_bytes_xla_moves(devices, ratio):
    n = 2**15
    mesh = mesh_of(devices)
    k = sidco.capacity(n, ratio)
    for mode in ("sparse", "dense", "sparse_allreduce"):
        tx = sidco.compress(ratio, axis_name=AXIS, communication=mode)
        state = sidco.parallel.shard_init(tx, jnp.zeros(n), mesh, AXIS)
        grads = _split(jnp.ones((devices, n)), mesh)
        found = sidco.hlo.collectives(_step_1d(tx, mesh, state).lower(state, grads).compile())
        # Results include this device's own share; the figures' psum is 24 bytes or so.
        payload = [c for c in found if c.result_bytes > 64]
        received = sum(c.result_bytes * (devices - 1) / devices for c in payload)
        if mode == "dense":
            received = sum(2 * c.result_bytes * (devices - 1) / devices for c in payload)
        assert received == pytest.approx(costs.received_bytes(mode, n, k, devices), rel=0.02)
        if mode == "sparse_allreduce":
            assert received <= 3 * k * 8
            assert {c.kind for c in payload} == {"all-to-all", "all-gather"}
