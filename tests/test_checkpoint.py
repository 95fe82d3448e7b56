"""Checkpoints keep every device's residual and the controller, and training continues exactly."""

import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import threading
import warnings
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import (
    AXIS,
    gradient_stream,
    mesh_of,
    params_tree,
    run_shard_map,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco
from sidco_jax._src.loop import layout as layout_lib
from sidco_jax._src.loop import residuals


def optimizer():
    return optax.chain(sidco.compress(0.02, axis_name=AXIS), optax.sgd(0.1, momentum=0.9))


def targets(params, state, devices):
    """Abstract params and state with the shardings of a ``devices``-device mesh."""
    mesh = mesh_of(devices)
    abstract = jax.eval_shape(lambda: (params, state))
    saved = len(jax.tree.leaves(state[0].residual)[0].sharding.device_set)
    shardings = (
        jax.tree.map(lambda _: NamedSharding(mesh, P()), params),
        sidco.parallel.state_shardings(state, mesh, AXIS),
    )

    def resize(leaf, residual):
        # Residual leaves stack the devices along their first axis.
        shape = (devices * leaf.shape[0] // saved, *leaf.shape[1:]) if residual else leaf.shape
        return jax.ShapeDtypeStruct(shape, leaf.dtype)

    marks = (jax.tree.map(lambda _: False, params), sidco.parallel.is_per_device(state))
    shapes = jax.tree.map(resize, abstract, marks)
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        shapes,
        shardings,
    )


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 8])
def test_training_continues_bit_identically_after_a_restore(tmp_path, rng, devices):
    stream = gradient_stream(rng, 10)
    tx = optimizer()
    want_updates, want_states, want_params = run_shard_map(tx, stream, devices)

    _, states, params = run_shard_map(tx, stream[:5], devices)
    sidco.save(tmp_path / "ckpt", (params, states[-1]))
    restored = sidco.restore(tmp_path / "ckpt", targets(params, states[-1], devices))
    chex.assert_trees_all_equal(restored, (params, states[-1]))
    assert all(r.sharding.spec == P(AXIS) for r in jax.tree.leaves(restored[1][0].residual))
    updates, states, params = run_shard_map(tx, stream[5:], devices, start=restored)

    chex.assert_trees_all_equal(updates, want_updates[5:])
    chex.assert_trees_all_equal(states[-1], want_states[-1])
    chex.assert_trees_all_equal(params, want_params)
    assert int(states[-1][0].count) == 10


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 4])
def test_restoring_on_fewer_devices_keeps_the_owed_update(tmp_path, rng, devices):
    tx = optimizer()
    _, states, params = run_shard_map(tx, gradient_stream(rng, 4))
    sidco.save(tmp_path / "ckpt", (params, states[-1]))
    with pytest.warns(
        sidco.checkpoint.ResidualWarning, match=f"saved on 8 devices restored on {devices}"
    ):
        got_params, got_state = sidco.restore(
            tmp_path / "ckpt", targets(params, states[-1], devices)
        )
    for old, new in zip(
        jax.tree.leaves(states[-1][0].residual), jax.tree.leaves(got_state[0].residual), strict=True
    ):
        old = np.stack(np.split(np.asarray(old), 8))
        for row in np.split(np.asarray(new), devices):
            np.testing.assert_allclose(row, old.mean(axis=0), rtol=1e-6, atol=1e-7)
        assert len(new.sharding.device_set) == devices
    chex.assert_trees_all_equal(got_params, params)
    chex.assert_trees_all_equal(
        got_state[0]._replace(residual=0), states[-1][0]._replace(residual=0)
    )
    chex.assert_trees_all_equal(got_state[1], states[-1][1])  # momentum
    run_shard_map(tx, gradient_stream(rng, 2), devices, start=(got_params, got_state))


@pytest.mark.parametrize(
    ("host", "message"),
    [
        (False, r"\['b'\] is a per-device residual saved as \(320,\), \(40,\) per device"),
        # Host arrays say nothing of devices: only whole numbers of them are checked.
        (True, "320 entries is not a whole number of devices' residuals of 7 entries"),
    ],
)
def test_a_residual_of_another_model_is_refused(tmp_path, rng, host, message):
    tx = optimizer()
    _, states, params = run_shard_map(tx, gradient_stream(rng, 1))
    saved = (params, states[-1])
    sidco.save(tmp_path / "ckpt", jax.device_get(saved) if host else saved)
    target = targets(params, states[-1], 8)
    sharding = target[1][0].residual["b"].sharding
    b = jax.ShapeDtypeStruct((8 * 7,), np.float32, sharding=sharding)
    bad = target[1][0]._replace(residual=dict(target[1][0].residual, b=b))
    target = (target[0], (bad, *target[1][1:]))
    with pytest.raises(ValueError, match=message):
        sidco.restore(tmp_path / "ckpt", target)


def small_state(ratio=0.02, dtype=np.float32):
    """Unsharded params and their state under compress(ratio) and momentum: quick to save."""
    params = jax.tree.map(lambda p: p.astype(dtype), params_tree())
    tx = optax.chain(sidco.compress(ratio), optax.sgd(0.1, momentum=0.9))
    return params, tx.init(params)


def test_restoring_a_missing_directory_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/nowhere.*does not exist"):
        sidco.restore(tmp_path / "nowhere", small_state())


def test_restoring_an_unfinished_save_says_so(tmp_path):
    (tmp_path / "ckpt.orbax-checkpoint-tmp").mkdir()
    with pytest.raises(FileNotFoundError, match="a save to it started and did not finish"):
        sidco.restore(tmp_path / "ckpt", small_state())


def test_restoring_an_empty_directory_names_it(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path} is empty"):
        sidco.restore(tmp_path, small_state())


def test_restoring_a_file_names_it(tmp_path):
    (tmp_path / "ckpt").write_text("")
    with pytest.raises(NotADirectoryError, match=f"{tmp_path}/ckpt is a file"):
        sidco.restore(tmp_path / "ckpt", small_state())


@pytest.mark.parametrize("missing", ["_METADATA", "manifest.ocdbt", "d", "sidco_manifest"])
def test_restoring_an_incomplete_checkpoint_names_what_is_missing(tmp_path, missing):
    tree = small_state()
    sidco.save(tmp_path / "ckpt", tree)
    gone = tmp_path / "ckpt" / missing
    if gone.is_dir():
        shutil.rmtree(gone)
    else:
        gone.unlink()
    with pytest.raises(ValueError, match=f"{tmp_path}/ckpt is not a complete checkpoint") as error:
        sidco.restore(tmp_path / "ckpt", tree)
    assert str(error.value).endswith(f"it lacks {missing}")


def test_a_state_with_integer_parameters_round_trips(tmp_path):
    # The residual of an integer leaf is zero-size, which orbax refuses to write.
    params = {"w": jnp.arange(8, dtype=jnp.float32), "n": jnp.array(3, jnp.int32)}
    tx = optax.chain(sidco.compress(0.25), optax.sgd(0.1, momentum=0.9))
    tree = (params, tx.init(params))
    sidco.save(tmp_path / "ckpt", tree)
    for target in (tree, jax.eval_shape(lambda: tree)):
        restored = sidco.restore(tmp_path / "ckpt", target)
        chex.assert_trees_all_equal(restored, tree)
        assert restored[1][0].residual["n"].shape == (0,)
        assert jax.tree.structure(restored) == jax.tree.structure(tree)


def test_saving_onto_an_existing_path_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileExistsError, match=f"cannot save to {tmp_path}/ckpt: it already exists"):
        sidco.save(tmp_path / "ckpt", small_state())


def test_saving_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=f"{tmp_path}/file is a file, not a directory"):
        sidco.save(tmp_path / "file" / "sub" / "ckpt", small_state())
    assert not list(tmp_path.glob("**/*ckpt*"))


def test_saving_into_a_read_only_directory_is_refused(tmp_path, monkeypatch):
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() == 0:  # root may write anyway: answer as for any other user
        monkeypatch.setattr(os, "access", lambda path, mode: bool(os.stat(path).st_mode & 0o200))
    with pytest.raises(PermissionError, match=f"{tmp_path}/ro is not writable"):
        sidco.save(tmp_path / "ro" / "ckpt", small_state())


def test_saving_creates_missing_parents(tmp_path):
    tree = small_state()
    sidco.save(tmp_path / "runs" / "a" / "ckpt", tree)
    chex.assert_trees_all_equal(sidco.restore(tmp_path / "runs" / "a" / "ckpt", tree), tree)


FAILED_SAVES = """
import sys
import threading

import jax.numpy as jnp

import sidco_jax as sidco
from sidco_jax._src.checkpoint import saving as checkpoint

root = sys.argv[1]
open(root + "/file", "w").close()
before = set(threading.enumerate())


def attempt(path, tree):
    try:
        sidco.save(path, tree)
    except (OSError, ValueError) as error:
        print(type(error).__name__, flush=True)


attempt(root + "/file/ckpt", {"w": jnp.ones(3)})  # refused up front
attempt(root + "/ckpt", {"w": jnp.ones(3), "bad": object()})  # orbax fails writing
checkpoint._check_destination = lambda path: None
attempt(root + "/file/ckpt", {"w": jnp.ones(3)})  # orbax fails creating the directory
# asyncio_N are idle workers of asyncio's default executor, left by successful saves too:
# they end with the interpreter. Orbax's writers are the threads that kept it alive.
new = set(threading.enumerate()) - before
print("running:", *[t.name for t in new if not t.daemon and not t.name.startswith("asyncio_")])
"""


def test_a_failed_save_leaves_nothing_running(tmp_path):
    # Orbax's background writers used to wait 300 s for a directory that never came,
    # keeping the process alive: the interpreter must now exit at once.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    done = subprocess.run(
        [sys.executable, "-c", FAILED_SAVES, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=pathlib.Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == [
        "NotADirectoryError",
        "ValueError",
        "NotADirectoryError",
        "running:",
        "",
    ], done.stdout + done.stderr


def test_a_dtype_mismatch_is_refused(tmp_path):
    sidco.save(tmp_path / "ckpt", small_state())
    target = small_state(dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\[0\]\['b'\] was saved as float32.*bfloat16"):
        sidco.restore(tmp_path / "ckpt", target)
    with pytest.raises(ValueError, match=r"\[0\]\['b'\] was saved as float32.*bfloat16"):
        sidco.restore(tmp_path / "ckpt", jax.eval_shape(lambda: target))


def test_another_ratio_warns_when_the_target_holds_values(tmp_path):
    saved = small_state(0.02)
    sidco.save(tmp_path / "ckpt", saved)
    with pytest.warns(sidco.checkpoint.RatioWarning, match=r"\[1\]\[0\].*ratio 0\.02.*ratio 0\.05"):
        _, state = sidco.restore(tmp_path / "ckpt", small_state(0.05))
    assert float(state[0].last.target_density) == np.float32(0.02)  # as saved
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chex.assert_trees_all_equal(sidco.restore(tmp_path / "ckpt", small_state(0.02)), saved)
        # An abstract target holds no ratio to compare with: documented, no warning.
        sidco.restore(tmp_path / "ckpt", jax.eval_shape(lambda: small_state(0.05)))


def test_a_residual_with_nonfinite_entries_warns_at_restore(tmp_path):
    # The update drops such entries silently (it only counts them, on the
    # device), so the host says it where a bad residual comes in.
    params = {"w": jnp.arange(8.0), "b": jnp.ones(3)}
    tx = optax.chain(sidco.compress(0.25), optax.sgd(0.1))
    state = tx.init(params)
    bad = state[0].residual["w"].at[2].set(jnp.nan).at[5].set(jnp.inf)
    residual = dict(state[0].residual, w=bad)
    sidco.save(tmp_path / "bad", (params, (state[0]._replace(residual=residual), state[1])))
    with pytest.warns(sidco.checkpoint.ResidualWarning, match="hold 2 non-finite entries"):
        _, restored = sidco.restore(tmp_path / "bad", (params, state))
    _, after = tx.update(params, restored, params)
    assert int(sidco.metrics(after)["dropped"]) == 2
    sidco.save(tmp_path / "good", (params, state))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sidco.restore(tmp_path / "good", (params, state))


def test_concurrent_saves_to_one_path_leave_the_winner_s_checkpoint(tmp_path):
    # Threads shared orbax's temporary directory: one save returned normally and the
    # checkpoint restored to the data of another, whose save had raised.
    path, ready = tmp_path / "ckpt", threading.Barrier(4)
    (tmp_path / "ckpt.sidco-saving").touch()  # left by a save that was killed: no obstacle
    outcomes = {}

    def save(i):
        ready.wait()
        try:
            sidco.save(path, {"w": jnp.full(1000, float(i))})
            outcomes[i] = "saved"
        except FileExistsError as error:
            outcomes[i] = str(error)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (winner,) = [i for i, outcome in outcomes.items() if outcome == "saved"]
    assert all("cannot save to" in o for i, o in outcomes.items() if i != winner), outcomes
    restored = sidco.restore(path, {"w": jnp.zeros(1000)})
    np.testing.assert_array_equal(restored["w"], np.full(1000, float(winner)))
    assert not list(tmp_path.glob("*.sidco-saving"))


def test_without_orbax_save_names_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'sidco_jax\[checkpoint\]'"):
        sidco.save(tmp_path / "ckpt", {"w": jnp.zeros(3)})


def layout_optimizer(layout):
    compressor = sidco.compress(0.02, axis_name=AXIS, layout=layout, bucket_bytes=4 * 1000)
    return optax.chain(compressor, optax.sgd(0.1, momentum=0.9))


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "restored"), [("tree", "buckets"), ("buckets", "tree")])
def test_a_checkpoint_moves_between_layouts_and_training_goes_on(tmp_path, rng, saved, restored):
    # Debug on a laptop (the tree), train on a cluster (buckets), and back.
    stream = gradient_stream(rng, 8)
    want_updates, _, want_params = run_shard_map(layout_optimizer(restored), stream)

    _, states, params = run_shard_map(layout_optimizer(saved), stream[:4])
    sidco.save(tmp_path / "ckpt", (params, states[-1]))
    mesh = mesh_of()
    target = (params, sidco.parallel.shard_init(layout_optimizer(restored), params, mesh, AXIS))
    back = sidco.restore(tmp_path / "ckpt", target)
    assert jax.tree.structure(back) == jax.tree.structure(target)
    for got, want in zip(*(jax.tree.leaves(t[1][0].residual) for t in (back, target)), strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
    updates, _, params = run_shard_map(layout_optimizer(restored), stream[4:], start=back)

    for got, want in zip(updates, want_updates[4:], strict=True):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), got, want)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), params, want_params)


class Layers(NamedTuple):  # fields out of alphabetical order, as orbax's dicts sort them
    zeta: jax.Array
    alpha: jax.Array


CONVERTED = {
    "namedtuple": Layers(jnp.zeros(3), jnp.zeros((2, 2))),
    "int keys": {i: jnp.zeros(i % 3 + 1) for i in range(12)},  # Flax NNX's layer indices
    "9, 2, 6": {"a": jnp.zeros(9), "b": jnp.zeros(2), "c": jnp.zeros(6)},
}
# A layout, and bucket_bytes where buckets: 8 bytes puts nearly every leaf alone.
LAYOUTS = {"tree": ("tree", None), "buckets": ("buckets", None), "8 bytes": ("buckets", 8)}
LAYOUTS |= {"36 bytes": ("buckets", 36), "44 bytes": ("buckets", 44)}  # 9 | 2 + 6, 9 + 2 | 6


def numbered_state(params, layout):
    """A compressor state whose residual holds 1, 2, 3, ... in leaf order, and that tree."""
    layout, bucket_bytes = LAYOUTS[layout]
    state = sidco.compress(0.1, layout=layout, bucket_bytes=bucket_bytes).init(params)
    leaves, treedef = jax.tree.flatten(params)
    numbers = np.arange(1, 1 + sum(x.size for x in leaves), dtype=np.float32)
    cut = np.split(numbers, np.cumsum([x.size for x in leaves])[:-1])
    tree = treedef.unflatten([jnp.reshape(n, x.shape) for n, x in zip(cut, leaves, strict=True)])
    residual = residuals.convert(tree, params, layout, bucket_bytes or layout_lib.BUCKET_BYTES)
    return state._replace(residual=residual), tree


@pytest.mark.parametrize("params", list(CONVERTED))
@pytest.mark.parametrize(
    ("saved", "restored"),
    [("tree", "buckets"), ("buckets", "tree"), ("buckets", "8 bytes"), ("36 bytes", "44 bytes")],
)
def test_a_residual_converts_onto_its_own_leaves(tmp_path, params, saved, restored):
    params = CONVERTED[params]
    state, tree = numbered_state(params, saved)
    sidco.save(tmp_path / "ckpt", state)
    target, _ = numbered_state(params, restored)
    zeros = jax.tree.map(jnp.zeros_like, target.residual)
    back = sidco.restore(tmp_path / "ckpt", target._replace(residual=zeros))
    assert jax.tree.structure(back) == jax.tree.structure(target)
    chex.assert_trees_all_equal(residuals.convert(back.residual, params, "tree"), tree)


@pytest.mark.parametrize(("saved", "restored"), [("tree", "buckets"), ("buckets", "tree")])
def test_a_residual_of_other_leaves_is_refused_in_another_layout(tmp_path, saved, restored):
    sidco.save(tmp_path / "ckpt", numbered_state({"a": jnp.zeros(3), "b": jnp.zeros(2)}, saved)[0])
    target = numbered_state({"a": jnp.zeros(2), "b": jnp.zeros(3)}, restored)[0]  # same entries
    with pytest.raises(ValueError, match=r"another model.*leaf a is \(2,\) float32, not \(3,\)"):
        sidco.restore(tmp_path / "ckpt", target)


def random_tree(rng, devices=1):
    """Random float32 values (zstd keeps them as they are: a flipped byte stays a wrong value)."""
    mesh = mesh_of(devices)
    w = rng.normal(size=(8 * 1000,)).astype(np.float32)  # past OCDBT's 1 KiB inline values
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P(AXIS))),
        "b": jax.device_put(np.ones((3, 4), np.float32), NamedSharding(mesh, P())),
    }


def data_files(checkpoint):
    """The data files of the checkpoint's OCDBT databases, largest (the arrays') first."""
    return sorted(checkpoint.glob("**/d/*"), key=lambda f: f.stat().st_size, reverse=True)


@pytest.mark.parametrize(("devices", "where"), [(1, ""), (8, r"\[\d+:\d+\]")])
def test_a_flipped_byte_in_the_data_is_refused_naming_the_array(tmp_path, rng, devices, where):
    tree = random_tree(rng, devices)
    sidco.save(tmp_path / "ckpt", tree)
    largest = data_files(tmp_path / "ckpt")[0]
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    largest.write_bytes(data)
    with pytest.raises(ValueError, match=rf"ckpt is damaged: \['w'\]{where} does not hold what"):
        sidco.restore(tmp_path / "ckpt", tree)


@pytest.mark.parametrize("size", [0, 100])
def test_a_truncated_data_file_is_an_incomplete_checkpoint(tmp_path, rng, size):
    tree = random_tree(rng)
    sidco.save(tmp_path / "ckpt", tree)
    with data_files(tmp_path / "ckpt")[0].open("r+b") as data:
        data.truncate(size)
    with pytest.raises(
        ValueError,
        match=rf"{tmp_path}/ckpt is not a complete checkpoint .*: reading \['w'\] failed",
    ):
        sidco.restore(tmp_path / "ckpt", tree)


def test_metadata_without_the_tree_is_an_incomplete_checkpoint(tmp_path):
    tree = small_state()
    sidco.save(tmp_path / "ckpt", tree)
    (tmp_path / "ckpt" / "_METADATA").write_text("{}")
    with pytest.raises(
        ValueError, match=r"ckpt is not a complete .*_METADATA holds no tree_metadata"
    ):
        sidco.restore(tmp_path / "ckpt", tree)


def test_python_scalars_and_none_round_trip(tmp_path):
    tree = {"step": 7, "lr": 0.25, "done": True, "nothing": None, "w": jnp.arange(3.0)}
    sidco.save(tmp_path / "ckpt", tree)
    target = {"step": 0, "lr": 0.0, "done": False, "nothing": None, "w": jnp.zeros(3)}
    restored = sidco.restore(tmp_path / "ckpt", target)
    assert restored == {**tree, "w": restored["w"]}
    assert [type(restored[k]) for k in ("step", "lr", "done")] == [int, float, bool]
    np.testing.assert_array_equal(restored["w"], tree["w"])
    with pytest.raises(ValueError, match=r"\['step'\] was saved as int64 and the target asks for"):
        sidco.restore(tmp_path / "ckpt", {**target, "step": 0.0})


def test_a_scalar_is_checked_too(tmp_path):
    sidco.save(tmp_path / "ckpt", {"step": 7, "w": jnp.zeros(3)})
    path = tmp_path / "ckpt" / "sidco_manifest" / "process_0.json"
    record = json.loads(path.read_text())
    (step,) = (leaf for leaf in record["leaves"] if leaf["name"] == "['step']")
    step["shards"][0]["crc32"] ^= 1  # as if the stored 7 had changed
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"ckpt is damaged: \['step'\] does not hold what was"):
        sidco.restore(tmp_path / "ckpt", {"step": 0, "w": jnp.zeros(3)})


def test_a_changed_model_leaf_is_refused_naming_it_and_both_shapes(tmp_path):
    sidco.save(tmp_path / "ckpt", {"w": jnp.zeros((40, 5))})
    with pytest.raises(
        ValueError, match=r"\['w'\] was saved with shape \(40, 5\) and the target's is \(40, 3\)"
    ):
        sidco.restore(tmp_path / "ckpt", {"w": jnp.zeros((40, 3))})


def compressor_state(shape, devices):
    """The state of compress(0.1) for one ``shape`` leaf, on the first ``devices`` devices."""
    mesh = mesh_of(devices)
    params = jax.device_put({"w": jnp.ones(shape)}, NamedSharding(mesh, P()))
    return sidco.parallel.shard_init(sidco.compress(0.1, axis_name=AXIS), params, mesh, AXIS)


@pytest.mark.parametrize(
    ("saved", "restored", "message"),
    [
        # 80 rows are 4 devices' worth of the new model's 20: it restored with a device warning
        (
            ((40, 5), 2),
            ((20, 5), 1),
            r"\(80, 5\), \(40, 5\) per device .* \(20, 5\), \(20, 5\) per",
        ),
        # The same 40 rows in all: it restored without a word
        (
            ((20, 5), 2),
            ((40, 5), 1),
            r"\(40, 5\), \(20, 5\) per device .* \(40, 5\), \(40, 5\) per",
        ),
        (
            ((20, 5), 2),
            ((20, 3), 2),
            r"\(40, 5\), \(20, 5\) per device .* \(40, 3\), \(20, 3\) per",
        ),
    ],
)
def test_a_residual_of_a_changed_model_leaf_is_refused(tmp_path, saved, restored, message):
    sidco.save(tmp_path / "ckpt", compressor_state(*saved))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any redistribution
        with pytest.raises(
            ValueError, match=rf"\.residual\['w'\] is a per-device residual saved as {message}"
        ):
            sidco.restore(tmp_path / "ckpt", compressor_state(*restored))


def test_a_save_that_stops_before_its_manifest_leaves_no_checkpoint(tmp_path, monkeypatch):
    from sidco_jax._src.checkpoint import manifest

    def crash(directory, tree):
        raise OSError("killed")

    monkeypatch.setattr(manifest, "write", crash)
    with pytest.raises(OSError, match="killed"):
        sidco.save(tmp_path / "ckpt", small_state())
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(FileNotFoundError, match="a save to it started and did not finish"):
        sidco.restore(tmp_path / "ckpt", small_state())


class Payload:
    """Unpickled, it creates the directory ``marker``: what a malicious checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize(
    "name",
    [
        "_METADATA",
        "sidco_manifest/process_0.json",
        "_CHECKPOINT_METADATA",
        "_sharding",
        "array_metadatas/process_0",
    ],
)
def test_a_pickle_in_a_checkpoint_runs_nothing(tmp_path, name):
    armed = tmp_path / "armed"
    pickle.loads(pickle.dumps(Payload(armed)))
    assert armed.exists()  # the payload works when unpickled
    tree = small_state()
    sidco.save(tmp_path / "ckpt", tree)
    (tmp_path / "ckpt" / name).write_bytes(pickle.dumps(Payload(tmp_path / "ran")))
    with pytest.raises(ValueError, match=rf"ckpt is not a complete .*: its {name} is not JSON"):
        sidco.restore(tmp_path / "ckpt", tree)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize(
    ("old", "new", "error"),
    [(b"sharding_type", b"sharding_tyxe", "KeyError"), (b"SingleDevice", b"SinxleDevice", "Not")],
)
def test_a_flipped_letter_in_orbax_s_json_is_a_damaged_checkpoint(tmp_path, old, new, error):
    # The JSON stays valid: orbax raised a bare KeyError or NotImplementedError.
    tree = small_state()
    sidco.save(tmp_path / "ckpt", tree)
    sharding = tmp_path / "ckpt" / "_sharding"
    sharding.write_bytes(sharding.read_bytes().replace(old, new, 1))
    with pytest.raises(ValueError, match=rf"ckpt is not a complete .*orbax met {error}"):
        sidco.restore(tmp_path / "ckpt", tree)


def edit_manifest(record, change):
    """``record`` (a process's manifest) with ``change`` applied to its first leaf."""
    leaf = record["leaves"][0]
    if change == "crc as text":
        leaf["shards"][0]["crc32"] = str(leaf["shards"][0]["crc32"])
    elif change == "negative shape":
        leaf["shape"] = [-1]
    elif change == "object in path":
        leaf["path"] = [{"py/reduce": [{"py/function": "os.system"}, ["touch ran"]]}]
    elif change == "region outside":
        leaf["shards"][0]["region"] = [[0, 10**6]] * len(leaf["shape"])
    elif change == "a shard missing":
        leaf["shards"] = []
    elif change == "leaves not a list":
        record["leaves"] = {"a": 1}
    return record


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("crc as text", r"leaf \[0\]\['b'\] has no int 'crc32'"),
        ("negative shape", r"leaf \[0\]\['b'\]: its shape is not a list of non-negative integers"),
        ("object in path", r"its path holds something other than names"),
        ("region outside", r"region \[\[0, 1000000\]\] is not inside its shape \[40\]"),
        ("a shard missing", r"its manifest covers 0 of the 40 entries of \[0\]\['b'\]"),
        ("leaves not a list", r"process_0.json has no list 'leaves'"),
        ("deep", r"process_0.json is not JSON \(RecursionError\)"),
    ],
)
def test_a_manifest_of_other_types_is_refused(tmp_path, change, message):
    tree = small_state()
    sidco.save(tmp_path / "ckpt", tree)
    path = tmp_path / "ckpt" / "sidco_manifest" / "process_0.json"
    if change == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text(json.dumps(edit_manifest(json.loads(path.read_text()), change)))
    with pytest.raises(ValueError, match=f"ckpt is not a complete checkpoint .*{message}"):
        sidco.restore(tmp_path / "ckpt", tree)
    assert not (tmp_path / "ran").exists()


def test_a_state_with_integer_keys_round_trips(tmp_path):
    # Flax NNX states key their lists of layers by int, orbax's metadata by str:
    # '10' sorts before '2', so matching by order would swap residuals.
    params = {i: jnp.zeros(3) for i in range(12)}
    tx = optax.chain(sidco.compress(0.25), optax.sgd(0.1))
    grads = {i: jnp.arange(3.0) + 3 * i for i in range(12)}
    _, state = tx.update(grads, tx.init(params), params)
    sidco.save(tmp_path / "ckpt", (params, state))
    restored = sidco.restore(tmp_path / "ckpt", (params, tx.init(params)))
    chex.assert_trees_all_equal(restored, (params, state))
    with pytest.raises(ValueError, match=r"\[0\]\[2\] was saved with shape \(3,\) and the target"):
        sidco.restore(tmp_path / "ckpt", ({**params, 2: jnp.zeros(4)}, state))
