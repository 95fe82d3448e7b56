"""Options both trainers share; imports nothing heavy, so the CLI can read it before JAX starts."""

import dataclasses


@dataclasses.dataclass
class Config:
    """Options both trainers share (each trainer's ``configs/`` adds its own)."""

    compressors: tuple[str, ...] = ("sidco-e", "dense")
    ratio: float = 0.01
    devices: int = 8
    steps: int = 300
    batch_per_device: int = 16
    learning_rate: float = 0.05
    momentum: float = 0.9
    eval_every: int = 50
    seed: int = 0
    capture_steps: tuple[int, ...] = ()
    progress: bool = True
