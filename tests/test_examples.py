"""The example trainers' steps, optimizer, CLI, comparison and loaders (train_test.py trains)."""

import gzip
import importlib
import os
import pathlib
import pickle
import subprocess
import sys

import chex
import jax
import numpy as np
import optax
import pytest
from harness import quick_first

import sidco_jax as sidco
from examples.cnn import input_pipeline
from examples.cnn import main as cnn_main
from examples.common import compare, parallel, training
from examples.lm import input_pipeline as text_pipeline
from examples.lm import main as lm_main


def test_optimizer_chains_the_compressor_before_sgd():
    _, config = training.example("cnn:tiny")
    tx = training.create_optimizer(config, "sidco-e", axis_name=None)
    params = {"w": np.zeros(1000, np.float32)}
    grads = {"w": np.linspace(-1, 1, 1000, dtype=np.float32)}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    sent = np.count_nonzero(updates["w"])  # no axis: the local sparsified step
    assert 0 < sent <= sidco.capacity(1000, config.ratio)
    want = -config.learning_rate * np.where(np.asarray(updates["w"]) != 0, grads["w"], 0)
    np.testing.assert_allclose(updates["w"], want, rtol=1e-6)
    assert isinstance(state[1][0], optax.TraceState)  # momentum after the compressor


@pytest.mark.slow
def test_outer_steps_every_step_with_plain_sgd_train_as_the_compressed_step(tmp_path):
    # DiLoCo with H = 1, SGD inside and SGD(1.0) outside is compressed data-parallel SGD.
    flags = ["--config", "tiny", "--capture-steps", "--momentum", "0", "--steps", "6"]
    (plain,) = cnn_main.main([*flags, "--compressors", "sidco-e", "--workdir", str(tmp_path)])
    outer = ["--outer-every", "1", "--outer-learning-rate", "1", "--outer-momentum", "0"]
    (diloco,) = cnn_main.main(
        [*flags, *outer, "--compressors", "sidco-e", "--workdir", str(tmp_path)]
    )
    np.testing.assert_allclose(diloco.loss, plain.loss, rtol=1e-5)
    assert diloco.bytes_per_step == plain.bytes_per_step
    (rare,) = cnn_main.main(
        [*flags, "--outer-every", "3", "--compressors", "sidco-e", "--workdir", str(tmp_path)]
    )
    assert rare.bytes_per_step == plain.bytes_per_step // 3  # an exchange every 3 steps
    assert diloco.parameters == plain.parameters  # one copy counted, not one per device


@pytest.mark.slow
def test_with_nodes_the_bytes_reported_are_those_that_cross_the_nodes(tmp_path):
    # They counted each node's dense traffic over its fast links too: "/ dense 0.8367".
    flags = ["--config", "tiny", "--capture-steps", "--steps", "2", "--nodes", "2"]
    compressed, dense = cnn_main.main([*flags, "--compressors", "sidco-e", "dense"])
    slice_bytes = 4 * -(-compressed.parameters // 4)  # each device's share of the node's mean
    assert slice_bytes <= dense.bytes_per_step < slice_bytes + 64  # and the agreed figures
    assert compressed.bytes_per_step < 0.25 * dense.bytes_per_step


@pytest.mark.slow
def test_the_step_the_cnn_trainer_writes_out_is_the_library_step_bit_for_bit():
    # The LM trainer runs the library's step itself.
    train = importlib.import_module("examples.cnn.train")
    task, config = training.example("cnn:tiny")
    mesh = parallel.mesh(config.devices)
    tx = training.create_optimizer(config, "sidco-e")
    data = np.random.default_rng(config.seed)
    size = config.batch_per_device * config.devices
    batches = [
        sidco.parallel.place(task.sample(data, size), mesh, jax.P(parallel.AXIS)) for _ in range(3)
    ]

    def three_steps(create_step):
        params = sidco.parallel.place(task.init(config.seed), mesh)
        opt_state = sidco.parallel.shard_init(tx, params, mesh, parallel.AXIS)
        step, losses = create_step(opt_state), []
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(loss)
        return params, opt_state, losses

    written_out = three_steps(lambda state: train.create_train_step(task.loss, tx, state, mesh))
    library = three_steps(
        lambda state: sidco.parallel.data_parallel_step(task.loss, tx, state, mesh, parallel.AXIS)
    )
    chex.assert_trees_all_equal(written_out, library)  # residuals and momentum included


def _write_idx(path, array, compress=False):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


def test_mnist_files_are_read_from_the_given_directory(tmp_path, rng):
    images = rng.integers(0, 256, (20, 28, 28))
    labels = rng.integers(0, 10, 20)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", images, compress=True)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", labels)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", images[:5])
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:5])
    data = input_pipeline.load("mnist", tmp_path)
    assert data.train_x.shape == (20, 28, 28, 1) and data.test_x.shape == (5, 28, 28, 1)
    np.testing.assert_array_equal(data.train_y, labels)
    assert abs(float(data.train_x.mean())) < 1e-5


def test_cifar10_batches_are_read_from_the_given_directory(tmp_path, rng):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in input_pipeline.CIFAR_FILES:
        batch = {b"data": rng.integers(0, 256, (4, 3072)), b"labels": list(range(4))}
        (folder / name).write_bytes(pickle.dumps(batch))
    data = input_pipeline.load("cifar10", tmp_path)
    assert data.train_x.shape == (20, 32, 32, 3) and data.test_y.tolist() == [0, 1, 2, 3]


def test_digits_are_scikit_learns_read_without_importing_it():
    from sklearn.datasets import load_digits

    digits = load_digits()  # the table the trainer reads from scikit-learn's wheel, in its order
    want = input_pipeline._split(digits.images[..., None].astype(np.float32), digits.target)
    got = input_pipeline.load("digits")
    assert got.train_x.shape == (1437, 8, 8, 1) and got.test_x.shape == (360, 8, 8, 1)
    jax.tree.map(np.testing.assert_array_equal, tuple(got), tuple(want))


def test_mnist_sample_ships_inside_a_wheel():
    data = input_pipeline.load("mnist5k")
    assert data.train_x.shape == (4000, 28, 28, 1) and data.test_x.shape == (1000, 28, 28, 1)
    counts = np.bincount(np.concatenate([data.train_y, data.test_y]))
    np.testing.assert_array_equal(counts, np.full(10, 500))  # 500 a class, none lost in the split
    assert set(np.unique(data.test_y)) == set(range(10))
    assert abs(float(data.train_x.mean())) < 1e-5 and data.train_x.std() == pytest.approx(1, 1e-4)


@pytest.mark.parametrize(
    ("dataset", "setup", "error", "message"),
    [
        ("mnist", None, FileNotFoundError, "pass data_dir"),
        ("mnist", "missing", FileNotFoundError, "is not a directory"),
        ("mnist", "empty", FileNotFoundError, "train-images-idx3-ubyte"),
        ("mnist", "garbage", ValueError, "is not an IDX file"),
        ("mnist", "short", ValueError, "its header says"),
        ("cifar10", "empty", FileNotFoundError, "data_batch_1 not found"),
        ("cifar10", "garbage", ValueError, "is not a CIFAR-10 python batch"),
        ("imagenet", None, ValueError, "dataset must be one of"),
    ],
)
def test_loaders_reject_missing_or_malformed_data(tmp_path, dataset, setup, error, message):
    path = None if setup is None else tmp_path / "data"
    if setup not in (None, "missing"):
        path.mkdir()
    if setup == "garbage":
        for name in [*input_pipeline.MNIST_FILES.values(), *input_pipeline.CIFAR_FILES]:
            (path / name).write_bytes(b"not a dataset at all")
    if setup == "short":
        for name in input_pipeline.MNIST_FILES.values():
            _write_idx(path / name, np.zeros((3, 4), np.uint8))
            raw = (path / name).read_bytes()
            (path / name).write_bytes(raw[:-2])
    with pytest.raises(error, match=message):
        input_pipeline.load(dataset, path)


ENGLISH = pathlib.Path(__file__).parent.parent / "docs" / "algorithm.md"  # real English prose


@pytest.mark.parametrize(
    ("content", "error", "message"),
    [
        (None, FileNotFoundError, "does not exist"),
        (b"\xff\xfe not utf-8 \xff", ValueError, "is not UTF-8 text"),
        (b"too short", ValueError, "at least 1000 are needed"),
    ],
)
def test_text_loader_rejects_missing_or_malformed_files(tmp_path, content, error, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error, match=message):
        text_pipeline.load(str(path))


def test_text_is_split_into_train_and_validation_tokens():
    text = text_pipeline.load(str(ENGLISH))
    raw = ENGLISH.read_text(encoding="utf-8")
    assert len(text.train) + len(text.valid) == len(raw)
    assert "".join(text.vocab[i] for i in text.train[:50]) == raw[:50]


def test_the_bundled_text_is_english_prose_shipped_offline():
    text = text_pipeline.load()
    assert len(text.train) > 400_000 and text.source.startswith("CPython")
    words = "".join(text.vocab[i] for i in text.train[:20_000]).lower().split()
    assert sum(w in {"the", "of", "and", "is", "a", "to"} for w in words) > 0.05 * len(words)


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (cnn_main, ["--config", "tinyy"], "--config: invalid choice: 'tinyy' (choose from"),
        (cnn_main, ["--dataset", "mnst"], "--dataset: invalid choice: 'mnst' (choose from"),
        (
            cnn_main,
            ["--dataset", "mnist"],
            "--dataset mnist reads its files from a directory: pass",
        ),
        (cnn_main, ["--devices", "0"], "--devices: 0 is below 1, the least allowed"),
        (cnn_main, ["--devices", "9"], "--devices 9: only 8 devices are here"),
        (cnn_main, ["--steps", "ten"], "--steps: invalid int value: 'ten'"),
        (cnn_main, ["--compressors", "sidco-x"], "--compressors: invalid choice: 'sidco-x'"),
        (
            cnn_main,
            ["--checkpoint-dir", "ckpt", "--capture-steps", "1"],
            "--capture-steps does not go with --checkpoint-dir: a resumed run would miss",
        ),
        (cnn_main, ["--checkpoint-every", "0"], "--checkpoint-every: 0 is below 1, the least"),
        (cnn_main, ["--nodes", "3"], "--nodes 3 must divide --devices 8"),
        (cnn_main, ["--nodes", "2", "--capture-steps", "1"], "--capture-steps needs --nodes 1"),
        (cnn_main, ["--outer-every", "2", "--capture-steps", "1"], "and no --outer-every"),
        (cnn_main, ["--outer-every", "-1"], "--outer-every: -1 is below 0, the least allowed"),
        (
            cnn_main,
            ["--nodes", "2", "--coordinator", "127.0.0.1:1", "--process-id", "2"],
            "--process-id 2 must be below --nodes 2",
        ),
        (lm_main, ["--config", "tinyy"], "--config: invalid choice: 'tinyy' (choose from"),
        (lm_main, ["--text-limit", "10"], "--text-limit: 10 is below 1000, the least allowed"),
        # These ended in a 40-line traceback.
        (cnn_main, ["--ratio", "0"], "--ratio: 0 must be above 0.0"),
        (cnn_main, ["--ratio", "1.5"], "--ratio: 1.5 is above 1.0, the most allowed"),
        (cnn_main, ["--ratio", "-0.1"], "--ratio: -0.1 must be above 0.0"),
        (cnn_main, ["--ratio", "nan"], "--ratio: nan is not a finite number"),
        (cnn_main, ["--learning-rate", "inf"], "--learning-rate: inf is not a finite number"),
        (cnn_main, ["--dataset", "mnist", "--data-dir", "/nowhere"], "/nowhere: no such dir"),
        (lm_main, ["--text", "/nowhere.txt"], "--text /nowhere.txt: no such file"),
        (lm_main, ["--values", "int4"], "--values: invalid choice: 'int4' (choose from"),
        (lm_main, ["--shard-params"], "--shard-params shards over a node's devices: give --nodes"),
        (lm_main, ["--model", "transformer", "--heads", "3"], "--embed 64 must be a multiple"),
    ],
)
def test_command_line_mistakes_end_in_usage_errors(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m examples.") and message in err


@pytest.mark.parametrize("main", [cnn_main, lm_main])
def test_help_explains_every_flag_and_keeps_the_examples_as_written(main, capsys):
    with pytest.raises(SystemExit) as exit_:
        main.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for line in main.__doc__.splitlines()[2:]:
        assert line in out  # not re-wrapped
    assert "``" not in out
    flags = [w.rstrip(",") for w in out.split() if w.startswith("--") and w != "--help"]
    assert len(set(flags)) > 12
    options = out.split("options:")[1]
    for block in options.split("\n  --")[1:]:
        assert "(default: " in " ".join(block.split()), block


@pytest.mark.parametrize("example", quick_first(["cnn", "lm"]))
def test_running_the_trainer_s_library_points_to_its_command_line(example):
    # `python -m examples.cnn.train --help` printed nothing and exited 0.
    done = subprocess.run(
        [sys.executable, "-m", f"examples.{example}.train", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 1 and f"run python -m examples.{example}.main" in done.stderr


def test_smoothing_invents_no_values_at_the_ends():
    constant = compare.smooth(np.full(25, 0.79))  # the raw density at step 1 in the issue
    np.testing.assert_allclose(constant, 0.79, rtol=1e-15)
    assert compare.smooth([1.0, 2.0, 3.0]).tolist() == [2.0, 2.0, 2.0]  # shorter than a window
    ramp = np.arange(30.0)
    got = compare.smooth(ramp, window=10)
    np.testing.assert_allclose(got[10:20], ramp[10:20] - 0.5)  # the full window, centred
    assert got[0] == np.mean(ramp[:5]) and got[-1] == np.mean(ramp[24:])  # shrunk, not padded
    assert compare.smooth([3.0]).tolist() == [3.0]


def test_a_diverged_run_is_left_off_the_chart_and_a_flat_density_is_readable(tmp_path):
    # Random-k's perplexity reached 5e31 and flattened every other curve; a density of
    # 1.00000-1.00018 was drawn on a log axis.
    import matplotlib.image

    steps = list(range(1, 41))

    def history(name, evals):
        achieved = [1.0 + 1e-5 * (t % 3) for t in steps]
        return training.History(name, steps, [2.0] * 40, achieved, [20, 40], evals, 0.1, 8, 10)

    runs = [history("sidco-e", [6.0, 5.0]), history("dense", [5.0, 4.0])]
    runs.append(history("randomk", [1e20, 5e31]))
    import matplotlib.pyplot as plt

    limits, close = {}, plt.close

    def record(fig):  # each figure's y range, by its title, as it is closed
        limits[fig.axes[0].get_title()] = (fig.axes[0].get_ylim(), fig.axes[0].get_yscale())
        close(fig)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plt, "close", record)
        paths = compare.plots(runs, "perplexity", tmp_path, "validation")
    (low, high), _ = limits["Validation perplexity"]
    assert 3.5 < low < 4.0 and 6.0 < high < 6.5
    (low, high), scale = next(v for k, v in limits.items() if k.startswith("Sent over target"))
    assert low < 0.9 and high > 1.1 and scale == "linear"  # the target's neighbourhood
    assert all(matplotlib.image.imread(p).shape[1] == 640 for p in paths)


def test_a_series_of_one_point_gets_a_marker():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert compare.line(ax, [3], [1.5], "x").get_marker() == "o"
    assert compare.line(ax, [1, 2], [1.5, 2.0], "y").get_marker() in (None, "None", "")
    plt.close(fig)
