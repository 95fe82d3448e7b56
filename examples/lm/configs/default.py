"""Default LM configuration: the bundled English text, 8 CPU devices, SIDCo-E and dense."""

import dataclasses

from examples.common.config import Config


@dataclasses.dataclass
class LMConfig(Config):
    text: str = "bundled"  # or the path of a UTF-8 text file
    text_limit: int | None = None
    sequence: int = 64
    embed: int = 64
    hidden: int = 256
    layers: int = 1
    eval_windows: int = 256


def get_config() -> LMConfig:
    return LMConfig(
        compressors=("sidco-e", "dense"),
        ratio=0.01,
        devices=8,
        steps=600,
        batch_per_device=8,
        learning_rate=0.5,
        momentum=0.9,
        eval_every=100,
    )
