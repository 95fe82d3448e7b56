"""Compression overhead: SIDCo vs lax.top_k vs one pass over the gradient.

Times, in one process and on the same arrays, the work a compressor adds to a
step: SIDCo-E/P/GP (threshold + fixed-capacity payload), ``lax.top_k`` plus
the same payload (values gathered at its indices), the naive
``jnp.nonzero(size=capacity)`` payload for reference, and one ``sum(|x|)``
pass, which is the floor for anything that reads the gradient. Methods run
round-robin within each repetition so that machine noise hits all alike;
the table reports medians and ratios to top-k and to the one pass.

    python benchmarks/overhead.py                      # full grid, ~5 min on 2 cores
    python benchmarks/overhead.py --sizes 20 --ratios 0.01 --repeats 5
    python benchmarks/overhead.py --transforms    # every compressor's optax update
"""

import argparse
import json
import math
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import sidco_jax as sidco

VARIANTS = {"sidco-e": "exponential", "sidco-p": "gpareto", "sidco-gp": "gamma"}


def methods(n: int, ratio: float, stages: list[int], factor: float) -> dict:
    """Jitted functions of the gradient, each producing what would be sent."""
    k = max(math.floor(n * ratio), 1)
    cap = sidco.capacity(n, ratio, factor)

    def topk(x):
        _, idx = lax.top_k(jnp.abs(x), k)
        return x[idx], idx.astype(jnp.int32)

    def nonzero(x, eta):
        (idx,) = jnp.nonzero(jnp.abs(x) > eta, size=cap, fill_value=n)
        return x.at[idx].get(mode="fill", fill_value=0), idx

    out = {
        "one pass": jax.jit(lambda x: jnp.sum(jnp.abs(x))),
        "top_k": jax.jit(topk),
        "sidco-e M=1 nonzero payload": jax.jit(lambda x: nonzero(x, sidco.threshold(x, ratio))),
    }
    for name, estimator in VARIANTS.items():
        for m in stages:
            if m > 1 and m > sidco.max_stages(ratio):
                continue

            def compress(x, estimator=estimator, m=m):
                eta = sidco.threshold(x, ratio, estimator=estimator, stages=m)
                return sidco.sparsify(x, eta, cap)

            out[f"{name} M={m}"] = jax.jit(compress)
    return out


def transforms(ratio: float) -> dict:
    """Jitted ``update`` of every compressor on a flat gradient, state included."""
    out = {}
    for name in sidco.COMPRESSORS:
        tx = sidco.compressor(name, ratio)
        out["top_k" if name == "topk" else name] = (jax.jit(tx.update), tx.init)
    return out


def measure_transforms(fns: dict, x: jax.Array, repeats: int) -> dict[str, float]:
    """Like :func:`measure` for ``update(x, state)``; the state is built once per method."""
    states = {name: init(x) for name, (_, init) in fns.items()}
    calls = {name: (lambda x, f=f, s=states[name]: f(x, s)) for name, (f, _) in fns.items()}
    calls = {"one pass": jax.jit(lambda x: jnp.sum(jnp.abs(x))), **calls}
    return measure(calls, x, repeats)


def measure(fns: dict, x: jax.Array, repeats: int) -> dict[str, float]:
    """Median milliseconds of each function, interleaved round-robin after warm-up."""
    for f in fns.values():
        jax.block_until_ready(f(x))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f(x))
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: float(np.median(t)) for name, t in times.items()}


def table(rows: list[dict]) -> str:
    lines = [
        "| n | ratio | method | ms | / top_k | / one pass |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        base, floor = row["ms"]["top_k"], row["ms"]["one pass"]
        for name, ms in row["ms"].items():
            lines.append(
                f"| 2^{row['log2_n']} | {row['ratio']} | {name} | {ms:.2f} "
                f"| {ms / base:.3f} | {ms / floor:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24], help="log2 of n")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3], help="stage counts")
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs after warm-up (>= 5)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/overhead.json"))
    parser.add_argument(
        "--transforms",
        action="store_true",
        help="time the optax update of every compressor (error feedback and state included) "
        "instead of the bare threshold + payload",
    )
    args = parser.parse_args(argv)

    rows = []
    rng = np.random.default_rng(0)
    for log2_n in args.sizes:
        x = jnp.asarray(rng.standard_t(3, size=2**log2_n).astype(np.float32))
        for ratio in args.ratios:
            if args.transforms:
                ms = measure_transforms(transforms(ratio), x, args.repeats)
                ms["top_k"] = ms.pop("top_k")  # keep the column the ratios are taken against
            else:
                fns = methods(x.size, ratio, args.stages, args.capacity_factor)
                ms = measure(fns, x, args.repeats)
            rows.append({"log2_n": log2_n, "ratio": ratio, "ms": ms})
            print(table(rows[-1:]).split("\n", 2)[2], flush=True)
    print()
    print(table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "machine": platform.machine(),
        "repeats": args.repeats,
        "capacity_factor": args.capacity_factor,
    }
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"\nwrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
