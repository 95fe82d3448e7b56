"""A small GPT-style transformer, its parameters sharded over each node's devices (FSDP)."""

from examples.lm.configs.default import LMConfig


def get_config() -> LMConfig:
    return LMConfig(
        compressors=("sidco-e", "dense"),
        ratio=0.01,
        devices=8,
        nodes=2,
        shard_params=True,
        model="transformer",
        embed=128,
        heads=4,
        layers=2,
        steps=400,
        batch_per_device=8,
        learning_rate=0.05,
        momentum=0.9,
        eval_every=100,
    )
