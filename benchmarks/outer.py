"""Outer steps against per-step compression: the example trainers' final quality, same samples.

Runs the CNN or LM trainer of ``examples/`` (8 forced CPU devices, its default
config, the same batches per seed) once per label and seed, and reports the
final test accuracy or validation perplexity (median over seeds, with the
range) and the bytes a device sends per step (an exchange's over ``H``). A
label is a registry name with options after a colon, and ``@H`` for outer
steps every ``H`` steps (``sidco.diloco``)::

    python -m benchmarks.outer --trainer lm --seeds 2 \\
        dense sidco-e dense@8 dense@32 dense@128 sidco-e@8 sidco-e@32 sidco-e@128
"""

import dataclasses

from benchmarks import trainers


def parse(label: str) -> tuple[str, int]:
    """``("sidco-e:values=int8", 32)`` from ``"sidco-e:values=int8@32"``; H is 0 without ``@``."""
    name, _, every = label.partition("@")
    return name, int(every or 0)


def run(label: str, config, trainer, task) -> dict:
    compressor, every = parse(label)
    config = dataclasses.replace(config, outer_every=every)
    history = trainers.train(compressor, config, trainer, task)
    return {
        "run": label,
        "seed": config.seed,
        "final": history.evals[-1],
        "bytes_per_step": history.bytes_per_step,
        "seconds_per_step": history.seconds_per_step,
    }


def main(argv=None) -> list[dict]:
    parser = trainers.parser(__doc__, ratio=0.01, steps=None)
    parser.add_argument("--outer-learning-rate", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    args = parser.parse_args(argv)
    import numpy as np

    task, config, trainer = trainers.prepare(
        args, outer_learning_rate=args.outer_learning_rate, outer_momentum=args.outer_momentum
    )
    print("| run | final (min-max) | bytes/step/device | s/step |")
    print("|---|---:|---:|---:|")
    rows = []
    for label in args.labels:
        runs = [
            run(label, dataclasses.replace(config, seed=seed), trainer, task)
            for seed in range(args.seeds)
        ]
        rows.extend(runs)
        finals = [r["final"] for r in runs]
        print(
            f"| {label} | {np.median(finals):.4f} ({min(finals):.4f}-{max(finals):.4f}) "
            f"| {runs[0]['bytes_per_step']:,} "
            f"| {np.median([r['seconds_per_step'] for r in runs]):.3f} |",
            flush=True,
        )
    trainers.write(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
