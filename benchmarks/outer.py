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

import argparse
import dataclasses
import importlib
import json
import pathlib
import tempfile


def parse(label: str) -> tuple[str, int]:
    """``("sidco-e:values=int8", 32)`` from ``"sidco-e:values=int8@32"``; H is 0 without ``@``."""
    name, _, every = label.partition("@")
    return name, int(every or 0)


def run(label: str, config, trainer, task) -> dict:
    from benchmarks.overhead import parse_label

    compressor, every = parse(label)
    name, options = parse_label(compressor)
    config = dataclasses.replace(config, outer_every=every)
    with tempfile.TemporaryDirectory() as workdir:
        history = trainer.train_and_evaluate(config, workdir, name, task=task, options=options)
    return {
        "run": label,
        "seed": config.seed,
        "final": history.evals[-1],
        "bytes_per_step": history.bytes_per_step,
        "seconds_per_step": history.seconds_per_step,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labels", nargs="+")
    parser.add_argument("--trainer", choices=("cnn", "lm"), default="lm")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--steps", type=int, help="default: the trainer's")
    parser.add_argument("--seeds", type=int, default=1, help="runs per label, seeds 0, 1, ...")
    parser.add_argument("--outer-learning-rate", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    import numpy as np

    from examples.common import cli, training

    cli.force_cpu_devices(8)  # before JAX starts its backends

    task, config = training.example(f"{args.trainer}:default")
    steps = args.steps or config.steps
    config = dataclasses.replace(
        config,
        ratio=args.ratio,
        steps=steps,
        progress=False,
        eval_every=steps,
        outer_learning_rate=args.outer_learning_rate,
        outer_momentum=args.outer_momentum,
    )
    trainer = importlib.import_module(f"examples.{args.trainer}.train")
    print(f"\n{args.trainer}, ratio {args.ratio}, {steps} steps, {args.seeds} seed(s)\n")
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
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
