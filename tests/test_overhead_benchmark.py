"""benchmarks/overhead.py runs every mode on small inputs and reports what it claims."""

import json
import pathlib

import pytest
from harness import full_size_copies

pytestmark = pytest.mark.slow  # -m 'not slow' leaves this file out of a quick run

ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="module")
def overhead():
    from benchmarks import overhead

    return overhead


def check(rows, path):
    saved = json.loads(path.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    assert saved["meta"]["cpu"] and saved["meta"]["cores"] >= 1  # ratios move with the CPU
    for row in rows:
        for name, t in row["ms"].items():
            # A phase may take no time on some call (a branch not taken, a tiny input).
            least = 0 if row["mode"] == "phases" and ": " in name else 1e-9
            assert least <= t["p25"] <= t["median"] <= t["p75"]


def test_updates_on_a_tree_and_its_flat_copy(overhead, tmp_path):
    path = tmp_path / "u.json"
    # Three of --compressors (every one by default) and top-k, the ratios' base.
    argv = ["updates", "--source", "lm:tiny", "--compressors", "sidco-e", "dense", "sidco-e paper"]
    rows = overhead.main([*argv, "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert [r["source"] for r in rows] == ["lm:tiny (tree)", "lm:tiny (one flat leaf)"]
    for row in rows:
        names = set(row["ms"])
        chosen = {"topk", "sidco-e", "dense", "sidco-e paper"}
        more = {"sidco-e, 10 stages fixed"}  # 10 at 0.001
        more |= {"sidco-e, 10 stages fixed, every stage whole"}
        first = {"sidco-e, update returned first", "topk, update returned first"}
        first |= {f"{c}, gradient donated" for c in ("dense", "sidco-e", "sidco-p", "topk", "dgc")}
        assert {"one pass", "sidco-e threshold+payload"} | chosen | more | first == names
        assert row["ms"]["topk"]["/ base"] == 1.0 and row["ms"]["one pass"]["/ one pass"] == 1.0
        # The temporary bytes of an update are measured, and finite, for every compressor.
        assert set(row["temp"]) == chosen | more | first
        assert all(0 <= v < 10 for v in row["temp"].values())


def test_phases_kernels_step_and_axis(overhead, tmp_path):
    path = tmp_path / "p.json"
    argv = ["phases", "--source", "flat:14", "--compressors", "sidco-e", "topk", "dense"]
    rows = overhead.main([*argv, "--repeats", "3", "--json", str(path)])
    check(rows, path)
    ms = rows[0]["ms"]
    # Each compressor's phases come from its own traced calls; dense selects nothing.
    for name in ("sidco-e", "topk", "dense"):
        assert {f"{name}: whole update", f"{name}: traced call", f"{name}: error_feedback"} <= set(
            ms
        )
    assert {"sidco-e: threshold", "sidco-e: payload", "topk: payload"} <= set(ms)
    assert "dense: payload" not in ms and "dense: threshold" not in ms
    # A traced call's phases share out its wall time: no more than it, and not far less.
    # Summed call by call: a phase that runs in some calls only (SIDCo's refit) makes a
    # sum of the phases' medians swing by its whole time.
    for name in ("sidco-e", "topk"):
        parts = ms[f"{name}: phases summed"]["median"]
        assert parts == pytest.approx(ms[f"{name}: traced call"]["median"], rel=0.5)
    rows = overhead.main(["kernels", "--sizes", "12", "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert {"one pass", "top_k", "sidco-e M=3", "sidco-gp M=1"} <= set(rows[0]["ms"])
    argv = ["step", "--source", "cnn:tiny", "--compressors", "dense", "sidco-e"]
    rows = overhead.main([*argv, "--repeats", "2", "--settle", "0", "--json", str(path)])
    check(rows, path)
    assert set(rows[0]["ms"]) == {"gradient alone", "dense", "sidco-e"}
    assert rows[0]["stages"] == {"dense": None, "sidco-e": 3}  # the default's first count
    argv = ["axis", "--source", "flat:12", "--compressors", "sidco-e", "topk"]
    rows = overhead.main([*argv, "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert set(rows[0]["ms"]) == {
        f"{c} {how}{carried}"
        for c in ("sidco-e", "topk", "dense")
        for how in ("shard_map", "pmap")
        for carried in ("", ", state donated")
    }


def test_carried_keeps_the_residual_in_its_donated_buffers(overhead):
    # Returned first, the update (shaped like the residual) would take the
    # donated buffers: JAX pairs them with the first outputs of their shape.
    import chex
    import jax.numpy as jnp

    grads = {"w": jnp.linspace(-1.0, 1.0, 64 * 512).reshape(64, 512), "b": jnp.ones(512)}
    tx = overhead.sidco.compress(0.01)
    call, jitted = overhead.carried(tx.update, tx.init(grads))
    assert full_size_copies(jitted, grads, tx.init(grads), shape=(64, 512)) == []
    # The state is carried from call to call: the same updates as a plain loop.
    state = tx.init(grads)
    for _ in range(3):
        want, state = tx.update(grads, state)
        chex.assert_trees_all_equal(call(grads), want)


def test_carried_with_the_gradient_donated_writes_the_update_in_its_buffers(overhead):
    import chex
    import jax
    import jax.numpy as jnp

    grads = {"w": jnp.linspace(-1.0, 1.0, 64 * 512).reshape(64, 512), "b": jnp.ones(512)}
    tx = overhead.sidco.compress(0.01)
    call, jitted = overhead.carried(tx.update, tx.init(grads), donate_gradient=True)
    assert call.donates
    assert full_size_copies(jitted, grads, tx.init(grads), shape=(64, 512)) == []
    state = tx.init(grads)
    for _ in range(3):
        want, state = tx.update(grads, state)
        given = overhead.own_arguments(call, (grads,))[0]
        chex.assert_trees_all_equal(call(given), want)
        assert given["w"].is_deleted()  # donated: measure() must pass a fresh copy
    assert not grads["w"].is_deleted()
    assert overhead.own_arguments(jax.jit(lambda g: g), (grads,))[0] is grads


def test_the_second_device_sends_the_same_magnitudes_from_other_places(overhead):
    import jax.numpy as jnp
    import numpy as np

    # A model's gradient is tiny: the other device must keep its scale, not be shifted.
    g = 1e-5 * jnp.asarray(np.random.default_rng(0).standard_t(3, (96, 64)), jnp.float32)
    other = overhead.second_device(g)
    assert other.shape == g.shape and other.dtype == g.dtype
    np.testing.assert_array_equal(np.sort(np.abs(other), None), np.sort(np.abs(g), None))
    k = 60
    top = lambda x: set(np.argsort(-np.abs(np.ravel(x)), kind="stable")[:k].tolist())  # noqa: E731
    assert len(top(g) & top(other)) < k // 4  # the payloads differ


def test_axis_rows_with_the_state_donated_carry_it_from_call_to_call(overhead):
    import chex
    import jax
    import jax.numpy as jnp

    grads = {"w": jnp.linspace(-1.0, 1.0, 4096), "b": jnp.cos(jnp.arange(512.0))}
    calls, (sharded,) = overhead.over_axis(grads, 0.01, ["sidco-e"])
    # The same steps written out plainly: shard_map, the state carried, nothing donated.
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = overhead.sidco.compressor("sidco-e", 0.01, axis_name="data")
    state = overhead.sidco.parallel.shard_init(tx, grads, mesh, "data")
    specs = overhead.sidco.parallel.state_specs(state, "data")
    step = jax.jit(
        jax.shard_map(
            lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
            mesh=mesh,
            in_specs=(jax.P("data"), specs),
            out_specs=(jax.P(), specs),
        )
    )
    wants = []
    for _ in range(3):
        want, state = step(sharded, state)
        wants.append(want)
    assert not jnp.array_equal(wants[0]["w"], wants[2]["w"])  # the residual moves the update
    for how, replica in (("shard_map", lambda x: x), ("pmap", lambda x: x[0])):
        carried, fresh = calls[f"sidco-e {how}, state donated"], calls[f"sidco-e {how}"]
        for want in wants:
            chex.assert_trees_all_equal(jax.tree.map(replica, carried(sharded)), want)
            # Without donation every call starts again from the initial state.
            chex.assert_trees_all_equal(jax.tree.map(replica, fresh(sharded)), wants[0])


def test_step_times_each_compressor_after_training_it_on_fresh_batches(overhead):
    import jax
    import numpy as np
    import optax

    settle = 30
    argv = ["step", "--source", "cnn:tiny", "--compressors", "sidco-e", "dgc", "--repeats", "1"]
    (row,) = overhead.main([*argv, "--settle", str(settle), "--ratios", "0.001", "--whole"])
    # The same training written out: the timed batch is drawn first, then one per step.
    task, config = overhead.example("cnn:tiny")
    rng = np.random.default_rng(0)
    task.sample(rng, config.batch_per_device)
    tx = optax.chain(overhead.sidco.compressor("sidco-e", 0.001), optax.sgd(config.learning_rate))
    params = task.init(config.seed)
    state = tx.init(params)

    @jax.jit  # eager, these 30 steps took 74 s
    def train_step(params, state, batch):
        updates, state = tx.update(jax.grad(task.loss)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(settle):
        params, state = train_step(params, state, task.sample(rng, config.batch_per_device))
    reached = overhead.stage_count(state)
    assert reached != 3  # the controller moved: a fresh state would be timed otherwise
    # The all-whole row trains the same way (the CNN's leaves are too short to sample).
    want = {"sidco-e": reached, "sidco-e, every stage whole": reached, "dgc": None}
    assert row["settle"] == settle and row["stages"] == want
    assert set(row["ms"]) == {"gradient alone", *want}


def event(name, tid, ts, dur):
    return {"name": name, "tid": tid, "ts": ts, "dur": dur}


def test_own_stretches_cut_nested_events_out(overhead):
    # A cond (0-10) runs two fusions inside it (2-4, 6-9); another thread runs one at 1-5.
    cond, a, b = event("cond", 1, 0, 10), event("a", 1, 2, 2), event("b", 1, 6, 3)
    other = event("c", 2, 1, 4)
    got = sorted(
        (start, stop, e["name"]) for start, stop, e in overhead.own_stretches([b, other, a, cond])
    )
    assert got == [
        (0, 2, "cond"),
        (1, 5, "c"),
        (2, 4, "a"),
        (4, 6, "cond"),
        (6, 9, "b"),
        (9, 10, "cond"),
    ]


def test_wall_shares_split_concurrent_time_and_keep_the_gaps(overhead):
    stretches = [(0, 4, "x"), (2, 6, "y"), (8, 9, "x")]  # x alone, x and y, y alone, gap
    shares = overhead.wall_shares(stretches, lambda e: e, 0, 10)
    assert shares == {"x": 2 + 1 + 1, "y": 1 + 2, "between thunks": 2 + 1}
    assert sum(shares.values()) == 10
    # Only the part inside the window counts.
    assert overhead.wall_shares(stretches, lambda e: e, 3, 5) == {"x": 0.5, "y": 1.5}


def test_instruction_phases_read_the_scopes_of_op_names(overhead):
    text = """
  %fusion.1 = f32[] fusion(%p), metadata={op_name="jit(f)/error_feedback/reduce_sum"}
  ROOT %cond.2.clone = (f32[]) conditional(%q), metadata={op_name="jit(f)/select/cond"}
  %w = f32[8] fusion(%r), metadata={op_name="jit(f)/select/payload/while/body/add"}
  %copy.3 = f32[8] copy(%w)
"""
    assert overhead.instruction_phases(text) == {
        "fusion.1": "error_feedback",
        "cond.2.clone": "threshold",
        "w": "payload",
        "copy.3": "other",
    }


def test_partition_tails_run_to_the_end_marker_or_the_next_thunk(overhead):
    # A's event covers its own partition (0-5); another thread finishes the
    # rest, then runs B (from 7), and only then records "end: A" (at 8).
    a, b = event("A", 1, 0, 5), event("B", 2, 7, 1)
    c = event("C", 1, 10, 2)  # C's marker comes before C's event ends: no tail
    markers = [event("end: A", 2, 8, 0), event("end: B", 2, 8, 0), event("end: C", 1, 11, 0)]
    d = event("D", 3, 20, 2)  # D's marker, on a thread with nothing after it
    markers.append(event("end: D", 3, 25, 0))
    tails = overhead.partition_tails([a, b, c, d], [a, b, c, d, *markers])
    assert sorted((start, stop, e["name"]) for start, stop, e in tails) == [
        (5, 7, "A"),
        (22, 25, "D"),
    ]
