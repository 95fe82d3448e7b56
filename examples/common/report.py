"""Summary table and PNG plots of the runs of :func:`examples.common.loop.train`."""

import pathlib

import numpy as np

from examples.common.loop import History


def table(histories: list[History], metric: str, ratio: float) -> str:
    """A Markdown table: final metric, loss, density, bytes and time per step of every run."""
    dense = next((h for h in histories if h.compressor == "dense"), None)
    lines = [
        f"| compressor | test {metric} | final loss | sent/target (median) | bytes/step/device "
        "| / dense | s/step |",
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
    lines.append(f"\nratio {ratio}; {histories[0].parameters:,} parameters")
    return "\n".join(lines)


def plots(histories: list[History], metric: str, workdir: str | pathlib.Path) -> list[pathlib.Path]:
    """Writes ``loss.png``, ``<metric>.png`` and ``density.png``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workdir = pathlib.Path(workdir)
    panels = {
        "loss": ("training loss", lambda h: (h.steps, _smooth(h.loss))),
        metric: (f"test {metric}", lambda h: (h.eval_steps, h.evals)),
        "density": ("sent / target density", lambda h: (h.steps, _smooth(h.achieved))),
    }
    paths = []
    for name, (label, series) in panels.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for h in histories:
            if name == "density" and h.compressor == "dense":
                continue
            ax.plot(*series(h), label=h.compressor)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        if name == "density":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        path = workdir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _smooth(values: list[float], window: int = 10) -> np.ndarray:
    values = np.asarray(values, float)
    if len(values) < window:
        return values
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="same")
