"""Whole updates on real model trees, in both layouts, and what each compiles to.

The trees are the parameter shapes of ResNet-50 (161 leaves, 25.6M entries),
GPT-2 small (148 leaves, 124M) and the example LSTM (``lm:large``, 6 leaves,
11.2M), filled with Student-t(3) values at a different scale per leaf. Three
modes:

* ``updates``: every method's jitted update, its state donated and carried, in
  ``layout="tree"`` and ``layout="buckets"``, interleaved round-robin with one
  pass over the gradient; medians and quartiles, ratios to top-k's update in
  the same layout taken in the same run.
* ``launches``: kernels launched per update (fusions, while loops, sorts and
  custom calls in the optimized HLO) for 2^22 entries in 1, 16 and 161
  leaves, each method in both layouts (XLA's default CPU flags; the test
  suite's differ).
* ``compile``: seconds and peak memory to compile every compressor's update
  for 1000 leaves of 3 entries, in both layouts, each in a fresh process;
  ``--check`` fails past 60 s or 4 GiB. CI checks one compressor of each kind
  of rule in the tree layout, where the rule's passes grow with the leaves
  (rules of one kind share them), and SIDCo-E and dense in the buckets, where
  every rule sees the same few buckets.

    python -m benchmarks.trees updates --trees resnet50 gpt2 lstm --ratios 0.001
    python -m benchmarks.trees launches
    python -m benchmarks.trees compile --check
"""

import argparse
import concurrent.futures
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import sidco_jax as sidco
from benchmarks import harness
from benchmarks.harness import compressor, measure
from benchmarks.overhead import carried, one_pass

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("tree", "buckets")
# Each method's row: a registry name, or SIDCo-E with the adaptation that fills the payload.
METHODS = ("sidco-e", "sidco-p", "sidco-gp", "sidco-e paper", "topk", "dgc", "dense")
COMPILE_SECONDS, COMPILE_BYTES = 60, 4 * 2**30


def resnet50() -> list[tuple[int, ...]]:
    """ResNet-50's parameter shapes (convolutions HWIO, batch-norm scale and bias, the head)."""
    shapes = [(7, 7, 3, 64), (64,), (64,)]
    width_in = 64
    for blocks, width in ((3, 64), (4, 128), (6, 256), (3, 512)):
        for block in range(blocks):
            for kernel, cin, cout in (
                (1, width_in, width),
                (3, width, width),
                (1, width, 4 * width),
            ):
                shapes += [(kernel, kernel, cin, cout), (cout,), (cout,)]
            if block == 0:  # the projection of the shortcut
                shapes += [(1, 1, width_in, 4 * width), (4 * width,), (4 * width,)]
            width_in = 4 * width
    return [*shapes, (2048, 1000), (1000,)]


def gpt2() -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes: embeddings, 12 blocks, the final layer norm."""
    d = 768
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,)]  # layer norm, attention
    block += [(d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]  # layer norm, MLP
    return [(50257, d), (1024, d), *block * 12, (d,), (d,)]


def lstm() -> list[tuple[int, ...]]:
    """The example LSTM's (``lm:large``) parameter shapes."""
    from examples.common.training import example

    task, config = example("lm:large")
    return [tuple(np.shape(p)) for p in jax.tree.leaves(task.init(config.seed))]


TREES = {"resnet50": resnet50, "gpt2": gpt2, "lstm": lstm}


def gradient(shapes, seed: int = 0) -> dict:
    """Student-t(3) leaves of ``shapes``, each at its own scale (10^-3 to 1)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, shape in enumerate(shapes):
        scale = np.float32(10 ** rng.uniform(-3, 0))
        out[f"{i:03d}"] = jnp.asarray(rng.standard_t(3, size=shape).astype(np.float32) * scale)
    return out


def updates(name: str, ratio: float, repeats: int, layouts=LAYOUTS, methods=METHODS) -> dict:
    """Each method's update on tree ``name`` in each layout, interleaved."""
    grads = gradient(TREES[name]())
    calls = {"one pass": jax.jit(one_pass)}
    for layout in layouts:
        for method in methods:
            tx = compressor(method, ratio, layout=layout)
            calls[f"{method} [{layout}]"], _ = carried(tx.update, tx.init(grads))
    ms = measure(calls, (grads,), repeats)
    for label, t in ms.items():
        layout = label.split("[")[-1].rstrip("]") if "[" in label else None
        top = ms.get(f"topk [{layout}]")
        t["/ topk"] = t["median"] / top["median"] if top else None
        t["/ one pass"] = t["median"] / ms["one pass"]["median"]
    size = sum(int(np.prod(s)) for s in TREES[name]())
    return {"tree": name, "leaves": len(TREES[name]()), "entries": size, "ratio": ratio, "ms": ms}


def launch_counts(method: str, layout: str, leaves: int, total: int = 2**22) -> int:
    sizes = [total // leaves] * leaves
    sizes[0] += total - sum(sizes)
    params = {f"{i:03d}": jax.ShapeDtypeStruct((s,), jnp.float32) for i, s in enumerate(sizes)}
    tx = compressor(method, 0.01, layout=layout)
    compiled = jax.jit(tx.update).lower(params, jax.eval_shape(tx.init, params)).compile()
    return sum(sidco.hlo.launches(compiled).values())


def compile_one(method: str, layout: str) -> dict:
    """Compiles ``method``'s update for 1000 leaves of 3 entries in this process."""
    params = {f"{i:04d}": jax.ShapeDtypeStruct((3,), jnp.float32) for i in range(1000)}
    tx = compressor(method, 0.01, layout=layout)
    state = jax.eval_shape(tx.init, params)
    start = time.perf_counter()
    jax.jit(tx.update).lower(params, state).compile()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"method": method, "layout": layout, "seconds": seconds, "peak_bytes": peak}


def _compile_in_a_fresh_process(method: str, layout: str) -> dict:
    code = (
        "import json, sys; from benchmarks.trees import compile_one; "
        f"print(json.dumps(compile_one({method!r}, {layout!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compile_all(methods, layouts=LAYOUTS, workers: int = 1) -> list[dict]:
    """:func:`compile_one` for each method and layout, each in a fresh process.

    ``workers`` processes run at once; each compile is one thread, so up to one per core
    leaves its seconds those of a machine to itself.
    """
    pairs = [(method, layout) for method in methods for layout in layouts]
    rows = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for row in pool.map(lambda pair: _compile_in_a_fresh_process(*pair), pairs):
            rows.append(row)
            print(
                f"| {row['method']} | {row['layout']} | {row['seconds']:.1f} "
                f"| {row['peak_bytes'] / 2**30:.2f} |",
                flush=True,
            )
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("updates", "launches", "compile"))
    parser.add_argument("--trees", nargs="+", default=list(TREES), choices=list(TREES))
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.001])
    parser.add_argument("--repeats", type=int, default=9, help="updates: timed rounds")
    parser.add_argument(
        "--methods", nargs="+", default=None, help="methods (default: every one of the mode)"
    )
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--check", action="store_true", help="compile: fail past the targets")
    parser.add_argument(
        "--each-kind",
        action="store_true",
        help="compile: the first compressor of each kind of rule (sidco_jax.traits), not all",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="compile: processes at once (at most the cores)"
    )
    parser.add_argument("--json", type=Path, help="default: benchmarks/results/trees_<mode>.json")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")

    rows = []
    if args.mode == "updates":
        print(
            "| tree | ratio | method | ms (median) | p25-p75 | / topk (same layout) | / one pass |"
        )
        print("|---|---:|---|---:|---:|---:|---:|")
        for ratio in args.ratios:
            for name in args.trees:
                methods = args.methods or METHODS
                rows.append(updates(name, ratio, args.repeats, args.layouts, methods))
                for label, t in rows[-1]["ms"].items():
                    top = f"{t['/ topk']:.3f}" if t["/ topk"] else ""
                    print(
                        f"| {name} | {ratio} | {label} | {t['median']:.1f} "
                        f"| {t['p25']:.1f}-{t['p75']:.1f} | {top} | {t['/ one pass']:.1f} |",
                        flush=True,
                    )
    elif args.mode == "launches":
        methods = args.methods or METHODS
        print("| method | layout | 1 leaf | 16 leaves | 161 leaves |\n|---|---|---:|---:|---:|")
        for method in methods:
            for layout in LAYOUTS:
                counts = [launch_counts(method, layout, leaves) for leaves in (1, 16, 161)]
                rows.append({"method": method, "layout": layout, "launches": counts})
                print(f"| {method} | {layout} | " + " | ".join(map(str, counts)) + " |", flush=True)
    else:
        print("| method | layout | compile s | peak GiB |\n|---|---|---:|---:|")
        methods = args.methods or sidco.COMPRESSORS
        if args.each_kind:
            firsts = {}
            for method in methods:
                firsts.setdefault(sidco.traits(method).kind, method)
            methods = list(firsts.values())
        rows = compile_all(methods, args.layouts, args.workers)
    meta = harness.meta("benchmarks.trees", argv)
    path = args.json or ROOT / "benchmarks" / "results" / f"trees_{args.mode}.json"
    print(f"wrote {harness.write(path, {'meta': meta, 'rows': rows})}")
    if args.check and args.mode == "compile":
        slow = [
            r for r in rows if r["seconds"] > COMPILE_SECONDS or r["peak_bytes"] > COMPILE_BYTES
        ]
        if slow:
            sys.exit(f"past {COMPILE_SECONDS} s or 4 GiB: {slow}")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
