"""Default CNN configuration: digits on 8 CPU devices, SIDCo-E and dense (the README's main job)."""

import dataclasses

from examples.common.config import Config


@dataclasses.dataclass
class CNNConfig(Config):
    dataset: str = "digits"
    data_dir: str | None = None
    widths: tuple[int, ...] = (32, 64)


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
