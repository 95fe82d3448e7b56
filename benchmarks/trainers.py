"""The example trainers run once per label and seed: what the final-quality benchmarks share.

A label is a registry name with options after a colon (``sidco-e:values=int8``);
every run of a seed draws the same batches, whatever its label.
"""

import argparse
import dataclasses
import importlib
import pathlib
import tempfile

from benchmarks import harness


def parser(doc: str, *, ratio: float, steps: int | None) -> argparse.ArgumentParser:
    """The flags they share: labels, ``--trainer``, ``--ratio``, ``--steps``, ``--seeds``,
    ``--json``; ``steps=None`` takes the trainer's."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("labels", nargs="+")
    parser.add_argument("--trainer", choices=("cnn", "lm"), default="lm")
    parser.add_argument("--ratio", type=float, default=ratio)
    more = " (default: the trainer's)" if steps is None else ""
    parser.add_argument("--steps", type=int, default=steps, help=f"steps per run{more}")
    parser.add_argument("--seeds", type=int, default=1, help="runs per label, seeds 0, 1, ...")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    return parser


def prepare(args: argparse.Namespace, **changes):
    """``(task, config, trainer module)``: the trainer's default config on 8 forced CPU devices.

    The config takes ``args``' ratio and steps, evaluates once at the end, and
    takes ``changes``; its line (trainer, ratio, steps, seeds) is printed.
    """
    from examples.common import cli, training

    cli.force_cpu_devices(8)  # before JAX starts its backends
    task, config = training.example(f"{args.trainer}:default")
    steps = args.steps or config.steps
    config = dataclasses.replace(
        config, ratio=args.ratio, steps=steps, progress=False, eval_every=steps, **changes
    )
    print(f"\n{args.trainer}, ratio {args.ratio}, {steps} steps, {args.seeds} seed(s)\n")
    return task, config, importlib.import_module(f"examples.{args.trainer}.train")


def train(label: str, config, trainer, task):
    """The history of one run of ``trainer`` with the compressor of ``label``."""
    from benchmarks.harness import parse_label

    name, options = parse_label(label)
    with tempfile.TemporaryDirectory() as workdir:
        return trainer.train_and_evaluate(config, workdir, name, task=task, options=options)


def write(rows: list[dict], path: pathlib.Path | None) -> None:
    """Writes ``rows`` as JSON to ``path``, if given."""
    if path is not None:
        harness.write(path, rows)
