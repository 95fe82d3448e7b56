"""sidco.accumulate: MultiSteps' updates, with one selection and one collective per k steps."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import AXIS, gradient_stream, mesh_of, params_tree, quick_first, run_shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco


def _local(stream, device=0):
    return [jax.tree.map(lambda g: g[device], grads) for grads in stream]


def _compare_with_multisteps(chain, every_k, stream, compile=jax.jit):
    """``accumulate(chain, every_k)`` and ``optax.MultiSteps`` of it, side by side on ``stream``.

    Their states must agree bit for bit after every step, and their updates to the
    rounding of the optimizer's own multiply-add (below). Returns our last state.
    """
    ours, theirs = sidco.accumulate(chain, every_k), optax.MultiSteps(chain, every_k)
    params = params_tree()
    state, ref = ours.init(params), theirs.init(params)
    step, ref_step = compile(ours.update), compile(theirs.update)
    for grads in stream:
        trace = jax.tree.leaves(ref.inner_opt_state[1][0].trace)  # momentum before the step
        updates, state = step(grads, state, params)
        ref_updates, ref = ref_step(grads, ref, params)
        chex.assert_trees_all_equal(
            state.inner, ref.inner_opt_state
        )  # residuals, stage counts, momentum
        chex.assert_trees_all_equal(state.accumulator, ref.acc_grads)
        # The same state, bit for bit. The update -lr * (g + mu * trace) is recomputed in
        # each program, whose machine code may or may not fuse the multiply-add (XLA's
        # legacy CPU emitters, which conftest.py picks, do so per fusion): at most one
        # rounding of mu * trace apart, scaled by lr, and each result's own rounding.
        pairs = zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates), trace, strict=True)
        for ours_leaf, ref_leaf, t in pairs:
            ours_leaf, ref_leaf = np.asarray(ours_leaf), np.asarray(ref_leaf)
            eps = np.finfo(np.float32).eps
            bound = 0.1 * 0.9 * eps * np.abs(np.asarray(t)) + 2 * np.spacing(np.abs(ref_leaf))
            assert np.all(np.abs(ours_leaf - ref_leaf) <= bound)
        params = optax.apply_updates(params, updates)
    return state


@pytest.mark.parametrize("name", quick_first(["sidco-e", "topk", "dgc", "randomk"]))
@pytest.mark.parametrize("every_k", quick_first([3, 1]))
def test_equals_multisteps_of_the_same_chain(rng, name, every_k):
    chain = optax.chain(sidco.compressor(name, 0.05), optax.sgd(0.1, momentum=0.9))
    state = _compare_with_multisteps(chain, every_k, _local(gradient_stream(rng, 3 * every_k + 1)))
    assert int(sidco.metrics(state)["step"]) == (3 * every_k + 1) // every_k


def un_jitted_against_multisteps(seed: int = 1234):
    """``accumulate`` and ``optax.MultiSteps`` of top-k and momentum, un-jitted, side by side.

    The boundary divides by 3, which no float32 multiply-add rounds exactly.
    ``tests/test_default_codegen.py`` runs this under XLA's default code
    generation too: under the suite's flags XLA does not fuse that multiply-add.
    """
    chain = optax.chain(sidco.topk(0.05), optax.sgd(0.1, momentum=0.9))
    stream = _local(gradient_stream(np.random.default_rng(seed), 6))
    state = _compare_with_multisteps(chain, 3, stream, compile=lambda f: f)
    assert int(sidco.metrics(state)["step"]) == 2


def test_un_jitted_equals_multisteps_un_jitted():
    un_jitted_against_multisteps()


def test_under_shard_map_the_boundary_compresses_the_mean_of_each_devices_micro_steps(rng):
    # Multiples of 1/64 (harness): the running mean of two micro-steps is exact.
    stream = gradient_stream(rng, 6)
    inner = optax.chain(sidco.compress(0.05, axis_name=AXIS), optax.sgd(0.1, momentum=0.9))
    updates, states, _ = run_shard_map(sidco.accumulate(inner, 2), stream)
    means = [jax.tree.map(lambda a, b: (a + b) / 2, *stream[i : i + 2]) for i in (0, 2, 4)]
    ref_updates, ref_states, _ = run_shard_map(inner, means)
    for i in range(3):
        chex.assert_trees_all_equal(updates[2 * i], jax.tree.map(jnp.zeros_like, ref_updates[i]))
        chex.assert_trees_all_equal(updates[2 * i + 1], ref_updates[i])
        chex.assert_trees_all_equal(states[2 * i + 1].inner, ref_states[i])
    assert sidco.parallel.state_specs(states[0], AXIS).accumulator == {k: P(AXIS) for k in "bvw"}


NODE, LOCAL = "node", "local"


def _through_data_parallel_step(tx, stream, accumulator_axis=(NODE, LOCAL)):
    """``tx`` in ``sidco.parallel.data_parallel_step`` on a 2 x 4 mesh, the batch split over both.

    The loss is linear in the parameters, so each device's gradient is its row
    of the step's gradients. The residuals are split over ``NODE``. Returns the
    parameters after every step and the last state.
    """
    mesh = jax.make_mesh((2, 4), (NODE, LOCAL))
    params = sidco.parallel.place(params_tree(), mesh)
    state = sidco.parallel.shard_init(tx, params, mesh, NODE, accumulator_axis=accumulator_axis)

    def loss(params, rows):
        pairs = zip(jax.tree.leaves(params), jax.tree.leaves(rows), strict=True)
        return sum(jnp.sum(p * r[0]) for p, r in pairs)

    step = sidco.parallel.data_parallel_step(loss, tx, state, mesh, (NODE, LOCAL), state_axis=NODE)
    history = []
    for grads in stream:
        params, state, _ = step(params, state, sidco.parallel.place(grads, mesh, P((NODE, LOCAL))))
        history.append(params)
    return history, state


@pytest.mark.slow
def test_hierarchical_accumulation_runs_through_data_parallel_step(rng):
    # Defect: with an inner_axis, state_specs split the accumulator over "node" only, but
    # it is filled before the compressor's inner mean and differs across "local": the
    # step was refused (and with check_vma=False one device's accumulation would be kept).
    def chain():
        compressor = sidco.compress(0.05, axis_name=NODE, inner_axis=LOCAL)
        return optax.chain(compressor, optax.sgd(0.1, momentum=0.9))

    stream = gradient_stream(rng, 6)
    got, state = _through_data_parallel_step(sidco.accumulate(chain(), 2), stream)
    # The reference: the chain alone, given each device's mean of its two micro-steps
    # (exact: multiples of 1/64, halved).
    means = [jax.tree.map(lambda a, b: (a + b) / 2, *stream[i : i + 2]) for i in (0, 2, 4)]
    want, want_state = _through_data_parallel_step(chain(), means)
    before = params_tree()
    for i in range(3):
        chex.assert_trees_all_equal(got[2 * i], before)  # a micro-step changes nothing
        chex.assert_trees_all_equal(got[2 * i + 1], want[i])
        before = want[i]
    chex.assert_trees_all_equal(state.inner, want_state)
    assert state.accumulator["b"].sharding.spec == P((NODE, LOCAL))
    assert state.inner[0].residual["b"].sharding.spec == P(NODE)


@pytest.mark.slow
def test_hierarchical_accumulation_is_the_mean_over_devices_and_micro_steps(rng):
    tx = optax.chain(sidco.dense(axis_name=NODE, inner_axis=LOCAL), optax.sgd(1.0))
    stream = gradient_stream(rng, 4)
    got, _ = _through_data_parallel_step(sidco.accumulate(tx, 2), stream)
    # The dense mean over 8 devices and 2 micro-steps, in NumPy (exact: dyadic sums).
    want = {k: np.zeros(v.shape, np.float32) for k, v in params_tree().items()}
    for i in (0, 2):
        for k in want:
            want[k] -= (stream[i][k] + stream[i + 1][k]).mean(axis=0, dtype=np.float64) / 2
        chex.assert_trees_all_equal(got[i + 1], want)


def test_an_accumulator_split_otherwise_than_the_step_splits_it_is_refused(rng):
    # shard_init without accumulator_axis splits the accumulator over "node" only:
    # shard_map's in_specs message named neither the leaf nor the fix.
    tx = sidco.accumulate(sidco.compress(0.05, axis_name=NODE, inner_axis=LOCAL), 2)
    message = (
        "opt_state.accumulator['b'] must have shape (320,) (one accumulator per device, split "
        "over ('node', 'local'): 8 devices), got (80,): make the state with "
        "sidco.parallel.shard_init(tx, params, mesh, 'node', accumulator_axis=('node', 'local'))"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        _through_data_parallel_step(tx, gradient_stream(rng, 1), accumulator_axis=None)


def _computations(text: str) -> dict[str, str]:
    """The computations of an HLO module by name (ENTRY as "ENTRY"), with their bodies."""
    found, name, body = {}, None, []
    for line in text.splitlines():
        header = re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line)
        if header:
            name, body = ("ENTRY" if header.group(1) else header.group(2)), []
        elif line == "}" and name is not None:
            found[name] = "\n".join(body)
            name = None
        elif name is not None:
            body.append(line)
    return found


def _reachable(computations, start, skip=()):
    """The text of ``start`` and every computation it calls, transitively, less ``skip``."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name in skip:
            continue
        seen.add(name)
        todo += [c for c in re.findall(r"%([\w.\-]+)", computations[name]) if c in computations]
    return "\n".join(computations[n] for n in seen)


@pytest.mark.parametrize("name", ["sidco-e", "topk", "randomk"])
def test_the_compiled_micro_step_has_no_collective(name):
    tx = sidco.accumulate(
        optax.chain(sidco.compressor(name, 0.05, axis_name=AXIS), optax.sgd(0.1)), 4
    )
    mesh = mesh_of()
    state = sidco.parallel.shard_init(tx, params_tree(), mesh, AXIS)
    specs = sidco.parallel.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=(P(), specs))
    def step(state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    grads = {k: jnp.zeros((8, *v.shape)) for k, v in params_tree().items()}
    grads = jax.device_put(grads, NamedSharding(mesh, P(AXIS)))
    computations = _computations(step.lower(state, grads).compile().as_text())
    # The accumulation's cond is the one conditional of the entry computation;
    # with an integer index its branches are (false: micro-step, true: boundary).
    (line,) = [x for x in computations["ENTRY"].splitlines() if " conditional(" in x]
    micro, boundary = re.search(r"branch_computations=\{%([\w.\-]+), %([\w.\-]+)\}", line).groups()
    assert sidco.hlo.collectives(_reachable(computations, boundary))  # the message is there
    # Everything a micro-step runs: the entry computation and the micro branch.
    assert sidco.hlo.collectives(_reachable(computations, "ENTRY", skip={boundary})) == []
    assert sidco.hlo.collectives(_reachable(computations, micro)) == []


def test_nothing_is_lost_through_accumulation(rng):
    tx = sidco.accumulate(sidco.compress(0.05), 2)
    state = tx.init(params_tree())
    step = jax.jit(tx.update)
    stream = _local(gradient_stream(rng, 6))
    for i in range(0, 6, 2):
        old = state.inner.residual
        zero, state = step(stream[i], state)
        chex.assert_trees_all_equal(zero, jax.tree.map(jnp.zeros_like, zero))
        chex.assert_trees_all_equal(
            state.inner.residual, old
        )  # a micro-step leaves the residual alone
        sent, state = step(stream[i + 1], state)
        mean = jax.tree.map(lambda a, b: (a + b) / 2, stream[i], stream[i + 1])
        # sent + new residual == mean gradient + old residual, bit for bit.
        chex.assert_trees_all_equal(
            jax.tree.map(np.add, sent, state.inner.residual), jax.tree.map(np.add, mean, old)
        )


@pytest.mark.parametrize(
    ("every_k", "error", "message"),
    [
        (0, ValueError, "every_k must be an integer in [1, 2**31 - 1], got 0"),
        (-2, ValueError, "every_k must be an integer in [1, 2**31 - 1], got -2"),
        (2.0, TypeError, "every_k must be an integer in [1, 2**31 - 1], got 2.0"),
        (True, TypeError, "every_k must be an integer in [1, 2**31 - 1], got True"),
        (None, TypeError, "every_k must be an integer in [1, 2**31 - 1], got None"),
    ],
)
def test_a_bad_every_k_is_refused(every_k, error, message):
    with pytest.raises(error, match=re.escape(message)):
        sidco.accumulate(sidco.compress(0.1), every_k)


def test_a_traced_every_k_is_refused():
    with pytest.raises(ValueError, match=r"every_k must be a concrete integer >= 1, got a traced"):
        jax.jit(lambda k: sidco.accumulate(sidco.compress(0.1), k).init(jnp.zeros(3)))(2)
