"""Trains the example character-level LSTM with every compressor of the config (see ``train.py``).

python -m examples.lm.main                             # bundled corpus, SIDCo-E vs dense
python -m examples.lm.main --text my_corpus.txt --compressors dense sidco-p topk
"""

from examples.common import cli


def main(argv=None):
    config, workdir = cli.parse("examples.lm.configs", argv, description=__doc__)
    from examples.lm import train  # after cli.parse: it sets the forced CPU device count

    return train.train_and_evaluate(config, workdir)


if __name__ == "__main__":
    main()
