"""The example trainers run end to end on tiny configurations; their loaders reject bad data."""

import gzip
import json
import pathlib
import pickle

import numpy as np
import pytest

from examples.cnn import input_pipeline
from examples.cnn import main as cnn_main
from examples.common import parallel
from examples.lm import input_pipeline as text_pipeline
from examples.lm import main as lm_main


def test_cnn_trains_with_sidco_and_dense_and_writes_its_report(tmp_path):
    histories = cnn_main.main(["--config", "tiny", "--workdir", str(tmp_path)])
    assert [h.compressor for h in histories] == ["sidco-e", "dense"]
    sidco_run, dense_run = histories
    for h in histories:
        assert h.steps == [1, 2, 3, 4] and np.all(np.isfinite(h.loss))
        assert h.eval_steps == [2, 4] and all(0.0 <= a <= 1.0 for a in h.evals)
    assert 0 < sidco_run.bytes_per_step < dense_run.bytes_per_step / 5
    assert dense_run.bytes_per_step >= 4 * dense_run.parameters  # a dense all-reduce
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["metric"] == "accuracy" and len(record["runs"]) == 2
    assert "| sidco-e |" in (tmp_path / "summary.md").read_text()
    for name in ("loss", "accuracy", "density"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    captured = np.load(tmp_path / "gradients_sidco-e.npz")
    assert sorted(captured) == ["grad_step1", "grad_step4", "u_step1", "u_step4"]
    assert captured["grad_step4"].shape == (sidco_run.parameters,)
    np.testing.assert_array_equal(captured["u_step1"], captured["grad_step1"])  # no residual yet
    assert not np.array_equal(captured["u_step4"], captured["grad_step4"])


def test_unknown_compressor_is_refused():
    with pytest.raises(ValueError, match="compressor must be one of"):
        parallel.compressor("sidco-x", 0.01)


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


def test_lm_trains_on_a_text_file_and_reports_perplexity(tmp_path):
    histories = lm_main.main(
        ["--config", "tiny", "--workdir", str(tmp_path), "--text", str(ENGLISH)]
    )
    vocab = len(set(ENGLISH.read_text(encoding="utf-8")[:20_000]))
    for h in histories:
        assert h.eval_steps == [3]
        assert 1.0 < h.evals[0] < 2 * vocab  # near-uniform at the start: about the vocabulary size
    assert histories[0].bytes_per_step < histories[1].bytes_per_step / 5
    assert json.loads((tmp_path / "results.json").read_text())["metric"] == "perplexity"
    assert (tmp_path / "perplexity.png").is_file()
    assert np.load(tmp_path / "gradients_sidco-e.npz")["grad_step2"].size == histories[0].parameters


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
