"""Threshold quality: achieved / target density on synthetic and on captured real gradients.

For each law (Laplace, Student-t(3), normal, +-gamma(0.3)), ratio and estimator, prints
``count(|x| > eta) / (ratio * n)`` for each stage count; 1.0 is ideal.

    python benchmarks/quality.py --log2-n 20 --ratios 0.01 0.001 --stages 1 3

With ``--compressors``, every compressor's one-step selection (its defaults, and
SIDCo with one stage) on the synthetic laws and on the whole-model gradients
the example trainers captured (``--capture-steps``; npz files given with
``--gradients``), then the median per compressor and ratio:

    python benchmarks/quality.py --compressors --gradients runs/cnn/gradients_dense.npz
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sidco_jax as sidco


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
    one = {"stages": 1, "adaptation": None, "error_feedback": False}
    return {
        "sidco-e M=1": sidco.compress(ratio, **one),
        "sidco-e": sidco.compress(ratio, error_feedback=False),
        "sidco-p M=1": sidco.compress(ratio, estimator="gpareto", **one),
        "sidco-p": sidco.compress(ratio, estimator="gpareto", error_feedback=False),
        "sidco-gp M=1": sidco.compress(ratio, estimator="gamma", **one),
        "sidco-gp": sidco.compress(ratio, estimator="gamma", error_feedback=False),
        "dgc": sidco.dgc(ratio, error_feedback=False),
        "gaussiank": sidco.gaussiank(ratio, error_feedback=False),
        "redsync": sidco.redsync(ratio, error_feedback=False),
        "topk": sidco.topk(ratio, error_feedback=False),
    }


def captured(paths: list[Path]) -> dict[str, np.ndarray]:
    """The gradient vectors of the trainers' npz files, named ``file:key``."""
    vectors = {}
    for path in paths:
        with np.load(path) as data:
            for key in data.files:
                vectors[f"{path.parent.name}/{path.stem}:{key}"] = data[key]
    return vectors


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


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-n", type=int, default=20)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/quality.json"))
    parser.add_argument("--compressors", action="store_true", help="compare every compressor")
    parser.add_argument("--gradients", type=Path, nargs="*", default=[], help="captured npz files")
    args = parser.parse_args(argv)
    if args.compressors:
        vectors = {**laws(2**args.log2_n, args.seed), **captured(args.gradients)}
        rows = compare(vectors, args.ratios)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
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
    args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
