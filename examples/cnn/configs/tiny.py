"""A few steps of a tiny CNN, for the test suite."""

from examples.cnn.configs.default import CNNConfig


def get_config() -> CNNConfig:
    return CNNConfig(
        compressors=("sidco-e", "dense"),
        ratio=0.05,
        devices=8,
        steps=4,
        batch_per_device=2,
        eval_every=2,
        widths=(8,),
        capture_steps=(1, 4),
        progress=False,
    )
