"""Trains the example character-level LSTM once per compressor and compares them (see train.py).

examples:
  python -m examples.lm.main                          # bundled English text, SIDCo-E vs dense
  python -m examples.lm.main --text my_corpus.txt --compressors dense sidco-p topk
"""

from examples.common import cli, compare


def main(argv: list[str] | None = None):
    """Parses ``argv`` and trains; returns the histories (one per compressor)."""
    config, workdir = cli.parse("examples.lm.configs", argv, description=__doc__)
    from examples.lm import train  # after cli.parse: it sets the forced CPU device count

    return compare.train_and_compare(train, config, workdir)


if __name__ == "__main__":
    main()
