"""Outer steps (DiLoCo): local steps between synchronizations, pseudo-gradients compressed."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import AXIS, DEVICES, gradient_stream, mesh_of, params_tree, run_shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco

COLLECTIVES = {"psum", "psum_invariant", "all_gather", "all_gather_invariant", "all_to_all"}
COLLECTIVES |= {"ppermute", "reduce_scatter", "psum_scatter", "pmax", "pmin"}


def _step(tx, mesh, state):
    """The jitted step under ``shard_map(check_vma=True)``: per-device parameters in and out."""
    specs = sidco.parallel.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(AXIS), specs, P(AXIS)),
        out_specs=(P(AXIS), specs),
        check_vma=True,
    )
    def step(local, state, grads):
        own = jax.tree.map(lambda p: p[0], local)
        updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, own)
        return jax.tree.map(lambda p: p[None], optax.apply_updates(own, updates)), state

    return step


def _run(tx, stream, start=None):
    """Every step's per-device parameters (NumPy, a leading device axis) and the last state."""
    mesh = mesh_of()
    if start is None:
        state = sidco.parallel.shard_init(tx, params_tree(), mesh, AXIS)
        local = sidco.parallel.per_device(params_tree(), mesh, AXIS)
    else:
        local, state = start
    step = _step(tx, mesh, state)
    history = []
    for grads in stream:
        local, state = step(local, state, jax.device_put(grads, NamedSharding(mesh, P(AXIS))))
        history.append(jax.tree.map(np.asarray, local))
    return history, state, local


def _reference(inner, outer, every, stream):
    """DiLoCo written plainly, device by device, with a dense mean of the pseudo-gradients."""
    anchor = params_tree()
    params = [anchor] * DEVICES
    inner_states = [inner.init(anchor)] * DEVICES
    outer_state = outer.init(anchor)
    history = []
    for t, grads in enumerate(stream, 1):
        for d in range(DEVICES):
            g = jax.tree.map(lambda x, d=d: x[d], grads)
            updates, inner_states[d] = inner.update(g, inner_states[d], params[d])
            params[d] = optax.apply_updates(params[d], updates)
        if t % every == 0:
            moved = [jax.tree.map(jnp.subtract, anchor, p) for p in params]
            mean = jax.tree.map(lambda *m: sum(m) / DEVICES, *moved)
            step, outer_state = outer.update(mean, outer_state, anchor)
            anchor = optax.apply_updates(anchor, step)
            params = [anchor] * DEVICES
        history.append(jax.tree.map(lambda *p: np.stack(p), *params))
    return history


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 3])
def test_with_a_dense_exchange_it_is_diloco(rng, every):
    inner, outer = optax.adam(1e-2), optax.sgd(0.7, momentum=0.9, nesterov=True)
    stream = gradient_stream(rng, 7)
    tx = sidco.diloco(inner, outer, every, sidco.dense(axis_name=AXIS))
    got, _, _ = _run(tx, stream)
    # The mean's summation order, and params + (anchor - params) at each synchronization.
    for g, w in zip(got, _reference(inner, outer, every, stream), strict=True):
        chex.assert_trees_all_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_one_step_rounds_with_sgd_are_compressed_data_parallel_sgd(rng):
    stream = gradient_stream(rng, 6)  # dyadic: every difference below is exact
    compressor = sidco.compress(0.05, axis_name=AXIS)
    tx = sidco.diloco(optax.sgd(0.5), optax.sgd(1.0), 1, compressor)
    got, state, _ = _run(tx, stream)
    _, want_states, want = run_shard_map(optax.chain(compressor, optax.sgd(0.5)), stream)
    for d in range(DEVICES):
        chex.assert_trees_all_equal(_row(got[-1], d), jax.tree.map(np.asarray, want))
    # The residual holds the learning rate's share of what the flat compressor keeps.
    chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, state.exchange.residual),
        jax.tree.map(lambda r: 0.5 * np.asarray(r), want_states[-1][0].residual),
    )


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def _row(tree, d):
    return jax.tree.map(lambda x: x[d], tree)


@pytest.mark.slow
def test_pseudo_gradients_lose_nothing(rng):
    # sgd(1.0) outside: the anchor moves by minus the mean, so P x (anchor_0 - anchor) plus
    # the residuals is every device's pseudo-gradients, lr x its gradients (dyadic: exact).
    stream = gradient_stream(rng, 9)
    compressor = sidco.compress(0.02, axis_name=AXIS, values="int8", indices="chunked")
    tx = sidco.diloco(optax.sgd(0.5), optax.sgd(1.0), 3, compressor)
    _, state, _ = _run(tx, stream)
    sent = DEVICES * (_flat(params_tree()) - _flat(state.anchor))
    residuals = jax.tree.leaves(state.exchange.residual)
    kept = np.concatenate([np.asarray(r).reshape(DEVICES, -1).sum(0) for r in residuals])
    owed = 0.5 * sum(_flat(jax.tree.map(lambda g: g.sum(0), grads)) for grads in stream)
    np.testing.assert_allclose(sent + kept, owed, rtol=0, atol=1e-5)
    assert 0 < float(sidco.metrics(state.exchange)["density"]) <= 0.03


@pytest.mark.slow
def test_a_non_finite_gradient_skips_that_devices_inner_step(rng):
    stream = gradient_stream(rng, 3)
    stream[1]["w"][2, 0, 0] = np.nan  # device 2, step 2
    stream[1]["b"][5, 3] = np.inf  # device 5, step 2
    tx = sidco.diloco(
        optax.sgd(0.5, momentum=0.9), optax.sgd(1.0), 3, sidco.compress(0.05, axis_name=AXIS)
    )
    got, state, _ = _run(tx, stream)
    for d in (2, 5):  # its parameters stayed where step 1 left them
        chex.assert_trees_all_equal(_row(got[1], d), _row(got[0], d))
    assert not np.array_equal(_row(got[1], 0)["w"], _row(got[0], 0)["w"])
    for tree in (got, state):
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))
    assert not bool(sidco.metrics(state.exchange)["nonfinite"])  # the exchange went ahead
    for d in range(1, DEVICES):  # every device at the anchor after it
        chex.assert_trees_all_close(_row(got[2], d), _row(got[2], 0), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_resumed_run_is_bit_identical(rng, tmp_path):
    stream = gradient_stream(rng, 8)
    tx = sidco.diloco(
        optax.adam(1e-2),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
        3,
        sidco.compress(0.05, axis_name=AXIS),
    )
    want, want_state, _ = _run(tx, stream)
    _, state, local = _run(tx, stream[:4])  # mid-round: local steps since the last exchange
    sidco.save(tmp_path / "ckpt", {"params": local, "opt_state": state})
    mesh = mesh_of()
    target = {
        "params": sidco.parallel.per_device(params_tree(), mesh, AXIS),
        "opt_state": sidco.parallel.shard_init(tx, params_tree(), mesh, AXIS),
    }
    restored = sidco.restore(tmp_path / "ckpt", target)
    got, got_state, _ = _run(tx, stream[4:], (restored["params"], restored["opt_state"]))
    chex.assert_trees_all_equal(got[-1], want[-1])
    chex.assert_trees_all_equal(got_state, want_state)


def _primitives(eqns) -> set[str]:
    """Every primitive of ``eqns`` and of the jaxprs inside them."""
    found = set()
    for eqn in eqns:
        found.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found |= _primitives(inner.eqns)
    return found


@pytest.mark.slow
def test_an_inner_step_runs_no_collective():
    tx = sidco.diloco(optax.sgd(0.1), optax.sgd(1.0), 4, sidco.compress(0.05, axis_name=AXIS))
    mesh = mesh_of()
    state = sidco.parallel.shard_init(tx, params_tree(), mesh, AXIS)
    local = sidco.parallel.per_device(params_tree(), mesh, AXIS)
    split = NamedSharding(mesh, P(AXIS))
    grads = jax.tree.map(lambda p: jnp.zeros((DEVICES, *p.shape), device=split), params_tree())
    jaxpr = jax.make_jaxpr(_step(tx, mesh, state))(local, state, grads).jaxpr
    (mapped,) = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
    (body,) = [e for e in mapped.params["jaxpr"].eqns if e.primitive.name == "shard_map"]
    body = body.params["jaxpr"]
    (cond,) = [e for e in body.eqns if e.primitive.name == "cond"]
    inner, synchronize = cond.params["branches"]  # branch 0: the count is not a multiple
    outside = _primitives([e for e in body.eqns if e is not cond])
    assert not (_primitives(inner.jaxpr.eqns) | outside) & COLLECTIVES
    assert _primitives(synchronize.jaxpr.eqns) & COLLECTIVES  # the exchange, and only there


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every": 0}, ValueError, "every must be"),
        ({"every": 2.5}, TypeError, "every must be"),
        ({"inner": lambda g: g}, TypeError, "inner must be an optax.GradientTransformation"),
        ({"outer": "sgd"}, TypeError, "outer must be an optax.GradientTransformation"),
        ({"compressor": None}, TypeError, "compressor must be an optax.GradientTransformation"),
    ],
)
def test_bad_options_fail_at_construction(kwargs, error, message):
    options = {
        "inner": optax.sgd(0.1),
        "outer": optax.sgd(1.0),
        "every": 4,
        "compressor": sidco.dense(),
        **kwargs,
    }
    with pytest.raises(error, match=message):
        sidco.diloco(**options)


def test_parameters_unlike_inits_are_named():
    tx = sidco.diloco(optax.sgd(0.1), optax.sgd(1.0), 2, sidco.compress(0.5))
    state = tx.init({"w": jnp.zeros(4)})
    with pytest.raises(ValueError, match=r"parameter \['w'\] has shape \(5,\).*init saw \(4,\)"):
        tx.update({"w": jnp.ones(5)}, state, {"w": jnp.zeros(5)})
    with pytest.raises(ValueError, match="tree structure"):
        tx.update({"v": jnp.ones(4)}, state, {"v": jnp.zeros(4)})
    with pytest.raises(ValueError, match=r"needs the parameters: call update\(grads, state"):
        tx.update({"w": jnp.ones(4)}, state)


@pytest.mark.slow
def test_a_compressor_that_does_not_average_is_refused(rng):
    tx = sidco.diloco(optax.sgd(0.1), optax.sgd(1.0), 1, sidco.compress(0.05))  # no axis_name
    with pytest.raises(ValueError, match=r"still varies over the mesh axes \['data'\].*axis_name"):
        _run(tx, gradient_stream(rng, 1))


@pytest.mark.slow
def test_the_inner_state_is_split_and_the_step_writes_it_for_you(rng):
    tx = sidco.diloco(optax.adam(1e-2), optax.sgd(1.0), 2, sidco.compress(0.05, axis_name=AXIS))
    specs = sidco.parallel.state_specs(jax.eval_shape(tx.init, params_tree()), AXIS)
    adam = specs.inner[0]
    assert (adam.count, adam.mu["w"], specs.anchor["w"]) == (P(), P(AXIS), P())
    assert specs.exchange.residual["w"] == P(AXIS)
    stream = gradient_stream(rng, 4)
    want, _, _ = _run(tx, stream)
    mesh = mesh_of()
    state = sidco.parallel.shard_init(tx, params_tree(), mesh, AXIS)
    local = sidco.parallel.per_device(params_tree(), mesh, AXIS)

    def loss(params, batch):  # its gradient is the batch
        return sum(jnp.vdot(params[k], batch[k][0]) for k in params)

    step = sidco.parallel.data_parallel_step(loss, tx, state, mesh, AXIS, local_params=True)
    for grads in stream:
        local, state, _ = step(local, state, grads)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, local), want[-1])


def test_the_outer_benchmark_reads_its_labels():
    from benchmarks import outer

    assert outer.parse("sidco-e:values=int8,indices=chunked@32") == (
        "sidco-e:values=int8,indices=chunked",
        32,
    )
    assert outer.parse("dense") == ("dense", 0)


@pytest.mark.slow
def test_the_outer_benchmark_trains_each_label_on_the_same_samples(capsys):
    from benchmarks import outer

    rows = outer.main(["--trainer", "cnn", "--steps", "4", "sidco-e", "sidco-e@2"])
    every, outer_steps = rows
    assert every["bytes_per_step"] == 2 * outer_steps["bytes_per_step"]  # an exchange in 2 steps
    assert "| sidco-e@2 |" in capsys.readouterr().out
