"""How full the payload is along the example trainers' runs, per compressor option.

Runs the CNN or LM trainer of ``examples/`` (8 forced CPU devices, the
trainer's default config, the same batches and seed for every run) once per
label and reports, after the first ``--skip`` steps, the median of sent/target
density, the fraction of steps sending at least half the target, the mean
sent/target of the first steps after any warm-up, and the final accuracy or
perplexity. A label is a registry name with options after a colon::

    python -m benchmarks.fill --trainer lm --ratio 0.001 --steps 300 \\
        sidco-e:adaptation=paper sidco-e:adaptation=fill sidco-e:warmup_steps=50 topk dense
"""

import dataclasses

from benchmarks import trainers


def main(argv=None) -> list[dict]:
    parser = trainers.parser(__doc__, ratio=0.001, steps=300)
    parser.add_argument("--skip", type=int, default=20, help="first steps left out")
    args = parser.parse_args(argv)
    import numpy as np

    task, config, trainer = trainers.prepare(args)
    print(
        "| run | final (min-max) | sent/target (median) | steps >= 0.5 | first 20 (mean) | s/step |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for label in args.labels:
        runs = [
            run(label, dataclasses.replace(config, seed=seed), trainer, task, args.skip)
            for seed in range(args.seeds)
        ]
        rows.extend(runs)
        mid = {key: float(np.median([r[key] for r in runs])) for key in runs[0] if key != "run"}
        finals = [r["final"] for r in runs]
        print(
            f"| {label} | {mid['final']:.4f} ({min(finals):.4f}-{max(finals):.4f}) "
            f"| {mid['median']:.2f} | {mid['at_least_half']:.2f} | {mid['first']:.2f} "
            f"| {mid['seconds_per_step']:.3f} |",
            flush=True,
        )
    trainers.write(rows, args.json)
    return rows


def run(label: str, config, trainer, task, skip: int) -> dict:
    """One run of ``trainer`` with the compressor of ``label``: its figures after ``skip`` steps."""
    import numpy as np

    from benchmarks.harness import parse_label

    history = trainers.train(label, config, trainer, task)
    achieved = np.asarray(history.achieved)
    tail = achieved[skip:]
    start = parse_label(label)[1].get("warmup_steps", 0)
    return {
        "run": label,
        "seed": config.seed,
        "final": history.evals[-1],
        "median": float(np.median(tail)),
        "at_least_half": float(np.mean(tail >= 0.5)),
        "first": float(np.mean(achieved[start : start + 20])),
        "seconds_per_step": history.seconds_per_step,
    }


if __name__ == "__main__":
    main()
