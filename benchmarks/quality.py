"""Threshold quality: achieved / target density of SIDCo on synthetic gradients.

For each law (Laplace, Student-t(3), normal, +-gamma(0.3)), ratio and estimator, prints
``count(|x| > eta) / (ratio * n)`` for each stage count; 1.0 is ideal.

    python benchmarks/quality.py --log2-n 20 --ratios 0.01 0.001 --stages 1 3
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


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2-n", type=int, default=20)
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/quality.json"))
    args = parser.parse_args(argv)

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
