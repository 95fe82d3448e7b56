"""Default CNN configuration: digits on 8 CPU devices, SIDCo-E and dense (the README's main job)."""

import dataclasses

from examples.cnn.input_pipeline import DATASETS
from examples.common.config import Config, option


@dataclasses.dataclass
class CNNConfig(Config):
    dataset: str = option("digits", "images to classify", choices=DATASETS)
    data_dir: str | None = option(
        None,
        "directory of the mnist or cifar10 files (cifar10's are Python pickles, loaded with "
        "pickle as torchvision does: a pickle can run any code, so give a directory you trust)",
    )
    widths: tuple[int, ...] = option((32, 64), "channels of each stage of residual blocks", min=1)


def get_config() -> CNNConfig:
    return CNNConfig(
        compressors=("sidco-e", "dense"),
        ratio=0.01,
        devices=8,
        steps=400,
        batch_per_device=16,
        learning_rate=0.02,
        eval_every=50,
    )
