"""Trains the example character-level model once per compressor and compares them (see train.py).

examples:
  python -m examples.lm.main                          # bundled English text, SIDCo-E vs dense
  python -m examples.lm.main --text my_corpus.txt --compressors dense sidco-p topk
  python -m examples.lm.main --config transformer      # GPT-style, FSDP in 2 nodes of 4
"""

import os

from examples.common import cli, compare


def check(config) -> str | None:
    """The error for flags that do not go together, or None."""
    if config.text != "bundled" and not os.path.isfile(config.text):
        return f"--text {config.text}: no such file (or 'bundled', the English text shipped here)"
    if config.shard_params and config.nodes < 2:
        return "--shard-params shards over a node's devices: give --nodes 2 or more"
    if config.model == "transformer" and config.embed % config.heads:
        return f"--embed {config.embed} must be a multiple of --heads {config.heads}"
    return None


def main(argv: list[str] | None = None):
    """Parses ``argv`` and trains; returns the histories (one per compressor)."""
    config, workdir = cli.parse("examples.lm.configs", argv, description=__doc__, check=check)
    from examples.lm import train  # after cli.parse: it sets the forced CPU device count

    return compare.train_and_compare(train, config, workdir)


if __name__ == "__main__":
    main()
