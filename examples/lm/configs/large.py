"""An LSTM of 11M parameters, for the network benchmark (communication must matter)."""

from examples.lm.configs.default import LMConfig


def get_config() -> LMConfig:
    return LMConfig(
        compressors=("sidco-e", "dense"),
        ratio=0.001,
        devices=2,
        steps=200,
        batch_per_device=8,
        learning_rate=0.5,
        momentum=0.9,
        eval_every=50,
        sequence=16,
        embed=256,
        hidden=1536,
    )
