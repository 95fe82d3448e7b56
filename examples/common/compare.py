"""Comparing compressors: one trainer's run per compressor, then a table, plots and JSON.

:func:`train_and_compare` calls a trainer's ``train_and_evaluate`` once per
compressor of the config, on the same task (data, batches and seed), and
writes ``results.json``, ``summary.md`` and the plots.
"""

import dataclasses
import json
import pathlib
import types

import jax
import numpy as np

from examples.common.training import History, Task

SMOOTHING = 10  # steps in the moving average of the loss and density plots
DIVERGED = 10.0  # a run past this many times the median run's largest value is off the chart

LEGEND = """\
- {held_out} {metric}: at the last step, on the held-out {held_out} data
- final loss: mean training loss over the last 10% of the steps
- sent/target (median): entries sent over the target ratio, median over the steps (1.00: on target)
- bytes/step/device: what one device sends per step, read from the compiled step's collectives
  (with --nodes, those that cross the nodes; with --outer-every N, an exchange's bytes over N)
- / dense: those bytes over dense's
- s/step: wall-clock seconds per step, evaluation and checkpoints included, compilation excluded"""


def train_and_compare(trainer: types.ModuleType, config, workdir) -> list[History]:
    """Trains every compressor of ``config`` with ``trainer``; writes and prints the comparison.

    Args:
      trainer: an example's ``train`` module (``create_task``, ``train_and_evaluate``).
      config: the options; ``config.compressors`` are trained in turn.
      workdir: where results, summary, plots and captured gradients go.

    Returns:
      The histories, one per compressor.
    """
    task = trainer.create_task(config)  # loaded once, trained on by every compressor
    histories = [
        trainer.train_and_evaluate(config, workdir, name, task=task) for name in config.compressors
    ]
    if jax.process_index() == 0:  # across processes, one writes what they all trained
        write(config, task, histories, workdir)
    return histories


def save(config, metric: str, histories: list[History], workdir: pathlib.Path) -> None:
    """Writes ``results.json``: the config, the metric's name and every history."""
    record = {"config": dataclasses.asdict(config), "metric": metric}
    record["runs"] = [dataclasses.asdict(h) for h in histories]
    (workdir / "results.json").write_text(json.dumps(record, indent=1))


def table(histories: list[History], metric: str, ratio: float, held_out: str = "test") -> str:
    """A Markdown table: final metric, loss, density, bytes and time per step of every run."""
    dense = next((h for h in histories if h.compressor == "dense"), None)
    lines = [
        f"| compressor | {held_out} {metric} | final loss | sent/target (median) "
        "| bytes/step/device | / dense | s/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for h in histories:
        tail = h.loss[-max(len(h.loss) // 10, 1) :]
        versus = f"{h.bytes_per_step / dense.bytes_per_step:.4f}" if dense else "-"
        achieved = "-" if h.compressor == "dense" else f"{np.median(h.achieved):.2f}"
        lines.append(
            f"| {h.compressor} | {h.evals[-1]:.4f} | {np.mean(tail):.4f} | {achieved} "
            f"| {h.bytes_per_step:,} | {versus} | {h.seconds_per_step:.3f} |"
        )
    state = ", ".join(f"{h.compressor} {h.state_bytes / 2**20:.2f} MiB" for h in histories)
    lines.append(
        f"\nratio {ratio}; {histories[0].parameters:,} parameters; held per device (parameters "
        f"and optimizer state, residual included): {state}\n"
    )
    lines.append(LEGEND.format(held_out=held_out, metric=metric))
    return "\n".join(lines)


def plots(
    histories: list[History], metric: str, workdir: str | pathlib.Path, held_out: str = "test"
) -> list[pathlib.Path]:
    """Writes ``loss.png``, ``<metric>.png`` and ``density.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = pathlib.Path(workdir)
    average = f"{SMOOTHING}-step moving average"
    panels = {
        "loss": (
            "training loss",
            f"Training loss ({average})",
            lambda h: (h.steps, smooth(h.loss)),
        ),
        metric: (
            f"{held_out} {metric}",
            f"{held_out.capitalize()} {metric}",
            lambda h: (h.eval_steps, h.evals),
        ),
        "density": (
            "sent / target density",
            f"Sent over target density ({average})",
            lambda h: (h.steps, smooth(h.achieved)),
        ),
    }
    paths = []
    for name, (label, title, series) in panels.items():
        fig, ax = plt.subplots(figsize=(6.4, 4))
        shown = {h.compressor: series(h) for h in histories}
        if name == "density":
            shown.pop("dense", None)
        off = diverged({run: y for run, (_, y) in shown.items()})
        for run, (x, y) in shown.items():
            line(ax, x, y, label=f"{run} (diverged, off the chart)" if run in off else run)
        kept = [np.asarray(y, float) for run, (_, y) in shown.items() if run not in off]
        values = np.concatenate(kept) if kept else np.ones(1)
        low, high = np.nanmin(values), np.nanmax(values)
        if off:
            margin = 0.05 * (high - low) or 0.05 * abs(high) or 1.0
            ax.set_ylim(low - margin, high + margin)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if name == "density":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            if low > 0 and high / low > 10:
                ax.set_yscale("log")  # only where the runs span more than a decade
            else:  # on target, within a few percent: show the target's neighbourhood
                ax.set_ylim(min(low, 0.9) - 0.02, max(high, 1.1) + 0.02)
                ax.ticklabel_format(axis="y", useOffset=False)
        ax.legend()
        fig.tight_layout()
        path = workdir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def diverged(series: dict, factor: float = DIVERGED) -> set:
    """The runs whose largest value is not finite or passes ``factor`` x the median run's.

    Such a run (random-k's perplexity reaching 5e31) would flatten every other
    curve: it is drawn, labelled, and left off the chart's range.

    Examples:
      >>> sorted(diverged({"a": [3.0, 2.0], "b": [3.1, 2.5], "c": [3.0, 5e31]}))
      ['c']
    """
    peaks = {run: np.max(np.asarray(y, float)) for run, y in series.items() if len(y)}
    finite = [p for p in peaks.values() if np.isfinite(p)]
    if not finite or np.median(finite) <= 0:
        return {run for run, p in peaks.items() if not np.isfinite(p)}
    limit = factor * np.median(finite)
    return {run for run, p in peaks.items() if not np.isfinite(p) or p > limit}


def line(ax, x, y, label: str):
    """Plots one series on ``ax``; one point gets a marker (a line through it is invisible)."""
    return ax.plot(x, y, label=label, marker="o" if len(x) == 1 else None)[0]


def smooth(values, window: int = SMOOTHING) -> np.ndarray:
    """Centred moving average whose window shrinks at the ends (no padding, no invented values).

    Examples:
      >>> smooth([2.0, 2.0, 2.0, 2.0], window=3)
      array([2., 2., 2., 2.])
      >>> smooth([0.0, 3.0, 6.0, 9.0], window=3)
      array([1.5, 3. , 6. , 7.5])
    """
    values = np.asarray(values, float)
    first = np.arange(len(values)) - window // 2  # window i covers [first, first + window)
    return np.array([values[max(f, 0) : f + window].mean() for f in first]).reshape(-1)


def write(config, task: Task, histories: list[History], workdir) -> None:
    """Writes ``results.json``, ``summary.md`` and the plots to ``workdir``; prints the summary.

    The last line printed says where the files are.
    """
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    save(config, task.metric, histories, workdir)
    summary = table(histories, task.metric, config.ratio, task.held_out)
    (workdir / "summary.md").write_text(summary + "\n")
    images = plots(histories, task.metric, workdir, task.held_out)
    print(summary)
    names = ", ".join(["results.json", "summary.md", *(p.name for p in images)])
    print(f"\nwrote {names} to {workdir.resolve()}")
