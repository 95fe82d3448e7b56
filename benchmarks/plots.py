"""The benchmark page's plots, drawn again from the benchmarks' JSON output.

Each plot reads one result file, as its benchmark writes it with ``--json``, and
writes a PNG into ``--out`` (``docs/img`` by default). A missing file is skipped,
so the command redraws whatever has been measured:

* ``trees_updates.json`` (``python -m benchmarks.trees updates``) ->
  ``trees_updates.png``: every method's update over top-k's in the same layout,
  per model tree (bars: median; whiskers: p25-p75), one panel per ratio.
* ``quality.json`` (``python -m benchmarks.quality --compressors``) ->
  ``quality_spread.png``: selected / target density per compressor.
* ``network.json`` (``python -m benchmarks.network --json ...``) ->
  ``network_<job>.png`` and ``network_time_to_loss.png``.

    python -m benchmarks.plots                  # benchmarks/results/*.json -> docs/img/
    python -m benchmarks.plots --results runs --out /tmp/img

Importing this module draws nothing and imports neither matplotlib nor JAX.
"""

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _split(key: str) -> tuple[str, str]:
    """``"sidco-e paper [tree]"`` -> ``("sidco-e paper", "tree")``; no layout -> ``""``."""
    if key.endswith("]") and " [" in key:
        method, layout = key[:-1].rsplit(" [", 1)
        return method, layout
    return key, ""


def trees_updates(record: dict, out: Path) -> list[Path]:
    """Bar chart of each update's time over top-k's, per model tree and method."""
    plt = _pyplot()
    rows = record["rows"]
    ratios = list(dict.fromkeys(row["ratio"] for row in rows))
    figure, axes = plt.subplots(
        1, len(ratios), figsize=(8.5 * len(ratios), 4.5), squeeze=False, sharey=True
    )
    for axis, ratio in zip(axes[0], ratios, strict=True):
        chosen = [row for row in rows if row["ratio"] == ratio]
        keys = list(dict.fromkeys(k for row in chosen for k in row["ms"]))
        layouts = {_split(k)[1] for k in keys} - {""}
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            method, layout = _split(key)
            x, y, low, high = [], [], [], []
            for j, row in enumerate(chosen):
                # top-k of the same layout; "one pass" has none, so any top-k of the row.
                tops = [k for k in row["ms"] if _split(k)[0] == "topk"]
                top = next((k for k in tops if _split(k)[1] == layout), tops[0] if tops else None)
                if key not in row["ms"] or top is None:
                    continue
                t, base = row["ms"][key], row["ms"][top]["median"]
                x.append(j - 0.4 + width * (i + 0.5))
                y.append(t["median"] / base)
                low.append((t["median"] - t["p25"]) / base)
                high.append((t["p75"] - t["median"]) / base)
            label = method if len(layouts) < 2 else f"{method} [{layout}]"
            axis.bar(x, y, width, yerr=[low, high], capsize=2, label=label)
        axis.set_xticks(
            range(len(chosen)), [f"{row['tree']}\n({row['leaves']} leaves)" for row in chosen]
        )
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set(yscale="log", title=f"ratio {ratio:g}", ylabel="update time / top-k's")
        axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    meta = record.get("meta", {})
    if meta:
        figure.suptitle(
            f"{meta.get('cores', '?')} cores of an {meta.get('cpu', '?')}, "
            f"jax {meta.get('jax', '?')} ({meta.get('backend', '?')})",
            fontsize=9,
        )
    figure.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trees_updates.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return [path]


def quality(record: dict, out: Path) -> list[Path]:
    """The spread plot of ``benchmarks.quality --compressors``, from its JSON."""
    if not isinstance(record, dict) or "rows" not in record:
        return []  # the --tails and --sampled modes write other rows
    from benchmarks.quality import plot  # imports JAX: only when there is something to draw

    path = out / "quality_spread.png"
    plot(record["rows"], path)
    return [path]


def network(record: dict, out: Path) -> list[Path]:
    """The step-against-bandwidth and loss-against-time plots of ``benchmarks.network``."""
    from benchmarks.network import plots

    plots(record["rows"], record.get("traces", []), out)
    return sorted(out.glob("network_*.png"))


PLOTS = {
    "trees_updates.json": trees_updates,
    "quality.json": quality,
    "network.json": network,
}


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    written = []
    for name, draw in PLOTS.items():
        source = args.results / name
        if source.exists():
            written += draw(json.loads(source.read_text()), args.out)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
