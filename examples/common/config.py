"""Options both trainers share; starts no JAX backend, so the CLI can read it first.

Every field carries its ``--help`` text in its metadata (``help``), and
optionally ``choices`` or ``min`` (the least value an integer flag accepts);
:mod:`examples.common.cli` turns each field into one flag.
"""

import dataclasses

import sidco_jax as sidco


def option(default, help: str, **checks):
    """A config field with its ``--help`` text and checks (``choices=``, ``min=``, ``above=``,
    ``max=``)."""
    return dataclasses.field(default=default, metadata={"help": help, **checks})


@dataclasses.dataclass
class Config:
    """Options both trainers share (each trainer's ``configs/`` adds its own)."""

    compressors: tuple[str, ...] = option(
        ("sidco-e", "dense"), "compressors to train with, one run each (same batches and seed)"
    )
    ratio: float = option(
        0.01, "target density: the fraction of gradient entries sent", above=0.0, max=1.0
    )
    values: str = option(
        "float32", "how a sparse message's values travel (1 byte: int8)", choices=sidco.VALUE_CODECS
    )
    indices: str = option(
        "int32",
        "how a sparse message's indices travel (chunked: 2 bytes)",
        choices=sidco.INDEX_CODECS,
    )
    devices: int = option(8, "data-parallel devices (forces that many CPU devices)", min=1)
    nodes: int = option(
        1,
        "split the devices into this many nodes: each node averages over its own devices and "
        "they share its compression (inner_shards); only compressed messages cross the nodes",
        min=1,
    )
    coordinator: str | None = option(
        None,
        "HOST:PORT of process 0: run one process per node (--nodes of them, each with its "
        "--process-id), joined by jax.distributed, CPU collectives over gloo",
    )
    process_id: int = option(0, "with --coordinator: this process's node, from 0", min=0)
    steps: int = option(300, "training steps per compressor", min=1)
    batch_per_device: int = option(16, "examples per device per step", min=1)
    learning_rate: float = option(0.05, "SGD learning rate", above=0.0)
    momentum: float = option(0.9, "SGD momentum")
    outer_every: int = option(
        0,
        "outer steps every N steps (DiLoCo): each device trains its own parameters and the "
        "compressor averages their pseudo-gradients every N steps; 0 averages the gradient "
        "every step",
        min=0,
    )
    outer_learning_rate: float = option(
        0.7, "with --outer-every: the outer SGD learning rate", above=0.0
    )
    outer_momentum: float = option(
        0.9, "with --outer-every: the outer SGD's Nesterov momentum (0: none)"
    )
    eval_every: int = option(50, "evaluate every this many steps (and at the last)", min=1)
    seed: int = option(0, "seed of the parameters and of the batches")
    capture_steps: tuple[int, ...] = option(
        (), "save device 0's whole-model gradient at these steps (gradients_<compressor>.npz)"
    )
    progress: bool = option(True, "show a progress bar")
    checkpoint_dir: str | None = option(
        None,
        "save each compressor's run to DIR/<compressor>/step_<t>, and first resume it from the "
        "newest complete checkpoint there (rerun with the same flags)",
    )
    checkpoint_every: int = option(
        50, "with --checkpoint-dir: save every this many steps, and at the last", min=1
    )
