"""A few steps of a tiny LSTM, for the test suite."""

from examples.lm.configs.default import LMConfig


def get_config() -> LMConfig:
    return LMConfig(
        compressors=("sidco-e", "dense"),
        ratio=0.05,
        devices=8,
        steps=3,
        batch_per_device=2,
        eval_every=3,
        sequence=16,
        embed=8,
        hidden=16,
        eval_windows=8,
        text_limit=20_000,
        capture_steps=(2,),
        progress=False,
    )
