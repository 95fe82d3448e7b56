"""Default LM configuration: the bundled English text, 8 CPU devices, SIDCo-E and dense."""

import dataclasses

from examples.common.config import Config, option


@dataclasses.dataclass
class LMConfig(Config):
    text: str = option("bundled", "the bundled English text, or the path of a UTF-8 text file")
    text_limit: int | None = option(None, "use only the first this many characters", min=1000)
    sequence: int = option(64, "characters per training window", min=1)
    model: str = option(
        "lstm", "the model: an LSTM, or a GPT-style transformer", choices=("lstm", "transformer")
    )
    embed: int = option(64, "character embedding size (the transformer's width)", min=1)
    hidden: int = option(256, "LSTM hidden size", min=1)
    layers: int = option(1, "LSTM layers, or transformer blocks", min=1)
    heads: int = option(4, "the transformer's attention heads (they divide --embed)", min=1)
    shard_params: bool = option(
        False,
        "with --nodes: shard the parameters and the optimizer state over a node's devices "
        "(FSDP within a node); each device compresses its shard across the nodes",
    )
    eval_windows: int = option(
        256, "validation windows (evenly spaced over the held-out text)", min=1
    )


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
