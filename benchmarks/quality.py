"""Threshold quality: achieved / target density on synthetic and on captured real gradients.

For each law (Laplace, Student-t(3), normal, +-gamma(0.3)), ratio and estimator, prints
``count(|x| > eta) / (ratio * n)`` for each stage count; 1.0 is ideal.

    python -m benchmarks.quality --log2-n 20 --ratios 0.01 0.001 --stages 1 3

With ``--compressors``, every compressor's one-step selection (its defaults, and
SIDCo with one stage) on the synthetic laws and on the whole-model gradients
the example trainers captured (``--capture-steps``; npz files given with
``--gradients``), then the median per compressor and ratio:

    python -m benchmarks.quality --compressors --gradients runs/cnn/gradients_dense.npz

Medians are also given per group of vectors: the synthetic laws, and each
trainer's gradients early (its first captured step) and late (its last).
``--runs`` adds the along-a-run view from the trainers' ``results.json``: the
median achieved/target over all steps under error feedback, and the share of
steps within [0.5, 2] x target. ``--plot`` draws the spread per compressor.

With ``--tails``, SIDCo's last stage alone on the same vectors: from a
previous threshold that exactly 2k or 4k entries exceed, how many times ``k``
the exponential (SIDCo-E) and generalized Pareto (SIDCo-P) final thresholds
pass, beside the excesses' coefficient of variation (see :func:`final_stage`):

    python -m benchmarks.quality --tails --ratios 0.001 --gradients runs/lm/gradients_sidco-e.npz

With ``--sampled``, the thresholds as the library computes them (the stages
between the first and the last fit one block in eight of each long vector)
beside the same thresholds with every stage reading every entry, on the same
vectors, for each estimator and stage count of ``--stages``:

    python -m benchmarks.quality --sampled --ratios 0.001 --stages 3 5 10 --log2-n 23
"""

import argparse
import contextlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sidco_jax as sidco
from benchmarks import harness
from sidco_jax import stats
from sidco_jax._src.stats import thresholds


def laws(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "Laplace": rng.laplace(size=n),
        "Student-t(3)": rng.standard_t(3, size=n),
        "normal": rng.normal(size=n),
        "±gamma(0.3)": rng.choice([-1.0, 1.0], n) * rng.gamma(0.3, size=n),
    }


def compressors(ratio: float) -> dict:
    """Every compressor without error feedback: one step from a fresh state."""
    one = {"stages": 1, "adaptation": None}
    out = {}
    for name in sidco.COMPRESSORS:
        if name in ("dense", "randomk"):  # no threshold to judge
            continue
        if name.startswith("sidco"):
            out[f"{name} M=1"] = sidco.compressor(name, ratio, error_feedback=False, **one)
        out[name] = sidco.compressor(name, ratio, error_feedback=False)
    return out


def captured(paths: list[Path]) -> dict[str, np.ndarray]:
    """The gradient vectors of the trainers' npz files, named ``file:key``."""
    vectors = {}
    for path in paths:
        with np.load(path) as data:
            for key in data.files:
                vectors[f"{path.parent.name}/{path.stem}:{key}"] = data[key]
    return vectors


def group(name: str, steps: dict[str, list[int]]) -> str:
    """``synthetic`` for a law, else ``<trainer> early`` / ``<trainer> late`` by capture step."""
    if ":" not in name:
        return "synthetic"
    file, key = name.split(":")
    trainer = file.split("/")[0].split("_")[0]
    step = int(key.split("step")[1])
    return f"{trainer} {'early' if step == min(steps[file]) else 'late'}"


def medians(rows: list[dict]) -> list[dict]:
    """Median achieved/target per ratio, group of vectors (and all of them), and compressor."""
    steps: dict[str, list[int]] = {}
    for name in {r["gradient"] for r in rows if ":" in r["gradient"]}:
        file, key = name.split(":")
        steps.setdefault(file, []).append(int(key.split("step")[1]))
    out = []
    for ratio in dict.fromkeys(r["ratio"] for r in rows):
        mine = [r for r in rows if r["ratio"] == ratio]
        groups = {"all": mine}
        for r in mine:
            groups.setdefault(group(r["gradient"], steps), []).append(r)
        for label, members in groups.items():
            values = [m["achieved_over_target"] for m in members]
            median = {k: float(np.median([v[k] for v in values])) for k in values[0]}
            # Typical miss of one selection, either way: median |log2(achieved / target)|.
            error = {
                k: float(np.median([abs(np.log2(max(v[k], 1e-9))) for v in values]))
                for k in values[0]
            }
            out.append(
                {"ratio": ratio, "group": label, "vectors": len(values), "median": median}
                | {"log2_error": error}
            )
    return out


def print_medians(table: list[dict]) -> None:
    names = list(table[0]["median"])
    print("\n| ratio | vectors | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    for row in table:
        cells = " | ".join(f"{row['median'][k]:.2f}" for k in names)
        print(f"| {row['ratio']:g} | {row['group']} ({row['vectors']}) | {cells} |")
    print("\nmedian |log2(achieved / target)| over all vectors (0 is exact, 1 is 2x off)")
    print("\n| ratio | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for row in (r for r in table if r["group"] == "all"):
        print(
            f"| {row['ratio']:g} | "
            + " | ".join(f"{row['log2_error'][k]:.2f}" for k in names)
            + " |"
        )


def along_runs(paths: list[Path]) -> list[dict]:
    """Achieved/target along the trainers' runs under error feedback (their results.json)."""
    out = []
    for path in paths:
        record = json.loads(path.read_text())
        for run in record["runs"]:
            if run["compressor"] == "dense":
                continue
            achieved = np.asarray(run["achieved"])
            out.append(
                {
                    "run": path.parent.name,
                    "ratio": record["config"]["ratio"],
                    "compressor": run["compressor"],
                    "median": float(np.median(achieved)),
                    "within_half_double": float(np.mean((achieved >= 0.5) & (achieved <= 2))),
                }
            )
    print("\n| run | ratio | compressor | median sent/target | steps in [0.5, 2] |")
    print("|---|---:|---|---:|---:|")
    for r in out:
        print(
            f"| {r['run']} | {r['ratio']:g} | {r['compressor']} | {r['median']:.2f} | "
            f"{r['within_half_double']:.0%} |"
        )
    return out


def plot(rows: list[dict], path: Path) -> None:
    """Achieved/target of every compressor over all vectors, one panel per ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = list(dict.fromkeys(r["ratio"] for r in rows))
    names = list(rows[0]["achieved_over_target"])
    figure, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 4.5), squeeze=False)
    for axis, ratio in zip(axes[0], ratios, strict=True):
        values = [
            [r["achieved_over_target"][k] for r in rows if r["ratio"] == ratio] for k in names
        ]
        axis.boxplot(values, showfliers=True)
        axis.set_xticks(range(1, len(names) + 1), names, rotation=60, fontsize=8)
        axis.axhspan(0.9, 1.1, color="green", alpha=0.15)
        axis.set(yscale="log", title=f"ratio {ratio:g}", ylabel="selected / target density")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def compare(vectors: dict[str, np.ndarray], ratios: list[float]) -> list[dict]:
    """achieved / target of every compressor's selection on every vector; prints tables."""
    rows = []
    for ratio in ratios:
        txs = compressors(ratio)
        print(f"\nratio {ratio}\n| gradient | " + " | ".join(txs) + " |")
        print("|---|" + "---:|" * len(txs))
        for name, x in vectors.items():
            x = jnp.asarray(x, jnp.float32)
            got = {}
            for label, tx in txs.items():
                _, state = jax.jit(tx.update)(x, tx.init(x))
                got[label] = float(sidco.metrics(state)["selected_density"]) / ratio
            rows.append({"gradient": name, "ratio": ratio, "achieved_over_target": got})
            print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in got.values()) + " |")
        mine = [r["achieved_over_target"] for r in rows if r["ratio"] == ratio]
        medians = {k: float(np.median([r[k] for r in mine])) for k in txs}
        print("| **median** | " + " | ".join(f"**{v:.2f}**" for v in medians.values()) + " |")
    return rows


# Exceedances of a perfect next-to-last stage, in multiples of k = ratio * n.
TAIL_MULTIPLES = (2, 4)


def final_stage(x: np.ndarray, ratio: float) -> list[dict]:
    """How SIDCo's last stage does from a perfect previous one, on the magnitudes of ``x``.

    For each multiple ``m`` of :data:`TAIL_MULTIPLES`, the previous threshold is
    the magnitude that exactly ``m * k`` entries exceed; the last stage fits
    the excesses over it (exponential as SIDCo-E, generalized Pareto as SIDCo-P,
    with the library's own fits) and keeps the ``1 / m`` of them it needs.
    Reports the excesses' coefficient of variation (1 for an exponential law;
    larger means a heavier tail) and how many times ``k`` each final threshold
    passes (1.0 is ideal).
    """
    a = np.abs(np.asarray(x, np.float64)).ravel()
    k = max(int(a.size * ratio), 1)
    top = np.sort(a)[::-1]
    out = []
    for m in TAIL_MULTIPLES:
        eta = top[m * k]  # exactly m * k entries are above it
        excess = a[a > eta] - eta
        count, total, squares = excess.size, float(excess.sum()), float((excess**2).sum())
        fits = {
            "sidco-e": stats.exponential_isf(stats.exponential_from_sums(count, total), 1 / m),
            "sidco-p": stats.gpareto_isf(stats.gpareto_from_sums(count, total, squares), 1 / m),
        }
        passes = {name: float(np.sum(a > eta + float(q))) / k for name, q in fits.items()}
        cv = float(excess.std() / excess.mean())
        out.append({"multiple": m, "cv": cv, "passes_over_k": passes})
    return out


def tails(vectors: dict[str, np.ndarray], ratios: list[float]) -> list[dict]:
    """:func:`final_stage` of every vector at every ratio; prints a table."""
    heads = [f"{m}k: {c}" for m in TAIL_MULTIPLES for c in ("cv", "E passes", "P passes")]
    print("| gradient | ratio | " + " | ".join(heads) + " |")
    print("|---|---|" + "---:|" * len(heads))
    rows = []
    for name, x in vectors.items():
        for ratio in ratios:
            stages = final_stage(x, ratio)
            rows.append({"gradient": name, "ratio": ratio, "stages": stages})
            cells = [
                f"{s['cv']:.2f} | {s['passes_over_k']['sidco-e']:.2f} | "
                f"{s['passes_over_k']['sidco-p']:.2f}"
                for s in stages
            ]
            print(f"| {name} | {ratio} | " + " | ".join(cells) + " |")
    return rows


def sampled(vectors: dict[str, np.ndarray], ratios: list[float], stages: list[int]) -> list[dict]:
    """achieved / target of the library's thresholds and of the all-whole ones, and the ratio
    of the two thresholds; prints a table of the densities."""
    columns = [(e, m) for e in sidco.ESTIMATORS for m in stages]
    heads = [f"{e} M={m}: sampled, whole" for e, m in columns]
    print("| gradient | ratio | " + " | ".join(heads) + " |")
    print("|---|---|" + "---|" * len(columns))
    rows = []
    for name, x in vectors.items():
        x = jnp.asarray(x, jnp.float32).ravel()
        for ratio in ratios:
            got = {}
            for e, m in columns:
                etas = []
                for whole in (False, True):
                    with thresholds.every_stage_whole() if whole else contextlib.nullcontext():
                        # A fresh function traces with the current SAMPLE_MIN.
                        etas.append(
                            jax.jit(
                                lambda x, e=e, m=m, r=ratio: sidco.threshold(
                                    x, r, estimator=e, stages=m
                                )
                            )(x)
                        )
                density = [float(jnp.mean(jnp.abs(x) > eta)) / ratio for eta in etas]
                got[f"{e} M={m}"] = {
                    "sampled": density[0],
                    "whole": density[1],
                    "threshold_ratio": float(etas[0] / etas[1]),
                }
            rows.append({"gradient": name, "ratio": ratio, "achieved_over_target": got})
            cells = [f"{v['sampled']:.3f}, {v['whole']:.3f}" for v in got.values()]
            print(f"| {name} | {ratio} | " + " | ".join(cells) + " |", flush=True)
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-n", type=int, default=20)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/quality.json"))
    parser.add_argument("--compressors", action="store_true", help="compare every compressor")
    parser.add_argument("--gradients", type=Path, nargs="*", default=[], help="captured npz files")
    parser.add_argument("--runs", type=Path, nargs="*", default=[], help="trainers' results.json")
    parser.add_argument("--plot", type=Path, help="PNG of the spread per compressor")
    parser.add_argument(
        "--tails", action="store_true", help="SIDCo's last stage from a perfect previous one"
    )
    parser.add_argument(
        "--sampled", action="store_true", help="sampled middle stages against all-whole ones"
    )
    args = parser.parse_args(argv)
    if args.sampled:
        vectors = {**laws(2**args.log2_n, args.seed), **captured(args.gradients)}
        rows = sampled(vectors, args.ratios, args.stages)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        harness.write(args.json, rows)
        return rows
    if args.tails:
        rows = tails({**laws(2**args.log2_n, args.seed), **captured(args.gradients)}, args.ratios)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        harness.write(args.json, rows)
        return rows
    if args.compressors:
        vectors = {**laws(2**args.log2_n, args.seed), **captured(args.gradients)}
        rows = compare(vectors, args.ratios)
        table = medians(rows)
        print_medians(table)
        runs = along_runs(args.runs) if args.runs else []
        if args.plot:
            plot(rows, args.plot)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        harness.write(args.json, {"rows": rows, "medians": table, "runs": runs})
        return rows

    eta_of = jax.jit(sidco.threshold, static_argnames=("estimator",))
    columns = [(e, m) for e in sidco.ESTIMATORS for m in args.stages]
    header = " | ".join(f"{e} M={m}" for e, m in columns)
    print(f"| law | ratio | {header} |\n|---|---|" + "---:|" * len(columns))
    rows = []
    for law, x in laws(2**args.log2_n, args.seed).items():
        x = jnp.asarray(x.astype(np.float32))
        for ratio in args.ratios:
            got = {
                f"{e} M={m}": float(jnp.mean(jnp.abs(x) > eta_of(x, ratio, estimator=e, stages=m)))
                / ratio
                for e, m in columns
            }
            rows.append({"law": law, "ratio": ratio, "achieved_over_target": got})
            print(f"| {law} | {ratio} | " + " | ".join(f"{v:.2f}" for v in got.values()) + " |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    harness.write(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
