"""Accelerator benchmark: SIDCo against top-k on model trees and flat vectors, in one command.

First, on the parameter trees of ``--trees`` (ResNet-50's 161 leaves and GPT-2
small's 148 by default; Student-t(3) values generated on the device, a scale
per leaf), the training-like step a user runs (gradient in, parameters out:
the compressor's update and ``optax.apply_updates``, parameters and state
donated and carried) for SIDCo-E, top-k, DGC and ``dense()``, each in
``layout="tree"`` and ``layout="buckets"``, with one pass over the gradient;
ratios to top-k's step in the same layout and each method's speed-up from
buckets.

Then, on flat float32 vectors (``--sizes``), what a compressor adds to a
step: one ``sum(|x|)`` pass (the floor for anything that reads the gradient),
``lax.top_k`` and ``lax.approx_max_k`` plus the gather of the selected values,
SIDCo-E/P/GP (threshold with ``min(3, max_stages)`` stages + fixed-capacity
payload), and the whole jitted optax ``update`` of ``sidco.compress`` (its
default ``adaptation="fill"`` on both of its paths, and the paper's rule), ``sidco.dgc`` and
``sidco.topk``. Methods run round-robin within each repetition after a
warm-up, so that machine noise hits all alike; the tables report the median
and interquartile range in ms, ratios of medians, and the achieved density of
each SIDCo threshold over the target.

A size or tree that fails with an XLA resource error (out of memory) is
recorded with its error and skipped. No new size starts once the elapsed time
plus the time the previous size took exceeds ``--budget``. On one GPU the
default run is meant to finish within 5 minutes, mostly compilation (untested
on a GPU yet).

    python -m benchmarks.device                          # full grid, <= 5 min on one GPU
    python -m benchmarks.device --json $OUT/device.json  # table next to it as device.md
    python -m benchmarks.device --trees --sizes 20 --ratios 0.01 --repeats 5   # CPU smoke
"""

import argparse
import datetime
import gc
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import sidco_jax as sidco
from benchmarks import harness, trees

VARIANTS = {"sidco-e": "exponential", "sidco-p": "gpareto", "sidco-gp": "gamma"}
STAGES = 3
BASE, FLOOR = "lax.top_k", "one pass"
# Substrings of the messages XLA and the runtimes raise when memory runs out.
RESOURCE_ERRORS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")


def data(log2_n: int, seed: int) -> jax.Array:
    """``2**log2_n`` float32 Student-t(3) draws, generated on the default device."""
    n = 2**log2_n
    make = jax.jit(lambda key: jax.random.t(key, 3.0, (n,), jnp.float32))
    return jax.block_until_ready(make(jax.random.fold_in(jax.random.key(seed), log2_n)))


def stages(ratio: float) -> int:
    """The stage count used for every SIDCo variant: ``STAGES`` clipped to the ceiling."""
    return min(STAGES, sidco.stats.max_stages(ratio))


def methods(n: int, ratio: float) -> dict:
    """Jitted functions of the gradient ``x``, each producing what would be sent."""
    k = max(math.floor(n * ratio), 1)
    cap = sidco.capacity(n, ratio)
    m = stages(ratio)

    def top_k(x):
        _, idx = lax.top_k(jnp.abs(x), k)
        return x[idx], idx

    def approx_max_k(x):
        _, idx = lax.approx_max_k(jnp.abs(x), k)
        return x[idx], idx

    out = {
        FLOOR: jax.jit(lambda x: jnp.sum(jnp.abs(x))),
        BASE: jax.jit(top_k),
        "lax.approx_max_k": jax.jit(approx_max_k),
    }
    for name, estimator in VARIANTS.items():

        def compress(x, estimator=estimator):
            eta = sidco.threshold(x, ratio, estimator=estimator, stages=m)
            return sidco.sparsify(x, eta, cap)

        out[name] = jax.jit(compress)
    return out


def in_hand(state, x: jax.Array, ratio: float):
    """The default ``adaptation="fill"``'s state with a last threshold 2x the capacity passes.

    The update then takes the path of a step whose last threshold is still in
    hand (no fit, no bracket): a selection 4x the capacity wide and the pick of
    its largest entries.
    """
    rank = 2 * sidco.capacity(x.size, ratio)
    last = lax.top_k(jnp.abs(x), rank + 1)[0][rank]  # exactly `rank` entries above it
    return state._replace(rule=state.rule._replace(previous=last))


def updates(x: jax.Array, ratio: float) -> dict:
    """Jitted optax ``update`` on ``{"w": x}``, as functions of ``x`` with a fixed state.

    SIDCo-E with its default ``adaptation="fill"`` runs twice: from a fresh
    state (no last threshold: it fits and brackets on every call) and with a
    last threshold in hand (see :func:`in_hand`), the two paths a training
    step takes; ``"update sidco-e"`` is the paper's rule.
    """
    fill = sidco.compress(ratio)
    out = {}
    for name, tx, prepare in [
        ("update sidco-e", sidco.compress(ratio, adaptation="paper"), None),
        ("update sidco-e fill, refit", fill, None),
        ("update sidco-e fill, in hand", fill, in_hand),
        ("update dgc", sidco.dgc(ratio), None),
        ("update topk", sidco.topk(ratio), None),
    ]:
        update = jax.jit(tx.update)
        state = tx.init({"w": x})
        if prepare is not None:
            state = prepare(state, x, ratio)
        state = jax.block_until_ready(state)
        out[name] = lambda x, update=update, state=state: update({"w": x}, state)
    return out


def densities(fns: dict, x: jax.Array, ratio: float) -> dict[str, float]:
    """Achieved density of each SIDCo threshold, ``mean(|x| > eta)``, over ``ratio``.

    Read from the payload's ``selected`` count, so that nothing is compiled again.
    """
    return {name: int(fns[name](x).selected) / x.size / ratio for name in VARIANTS}


def run_size(log2_n: int, ratios: list[float], repeats: int, seed: int, rows: list[dict]) -> None:
    """Appends one row per ratio for ``n = 2**log2_n`` to ``rows`` as it goes."""
    x = data(log2_n, seed)
    n = x.size
    for ratio in ratios:
        fns = {**methods(n, ratio), **updates(x, ratio)}
        ms = harness.measure(fns, (x,), repeats)
        base, floor = ms[BASE]["median"], ms[FLOOR]["median"]
        rows.append(
            {
                "log2_n": log2_n,
                "n": n,
                "ratio": ratio,
                "k": max(math.floor(n * ratio), 1),
                "capacity": sidco.capacity(n, ratio),
                "stages": stages(ratio),
                "ms": ms,
                "vs_top_k": {name: t["median"] / base for name, t in ms.items()},
                "vs_one_pass": {name: t["median"] / floor for name, t in ms.items()},
                "density": densities(fns, x, ratio),
            }
        )
        del fns
        print(table(rows[-1:]).split("\n", 2)[2], flush=True)


TREE_METHODS = ("sidco-e", "topk", "dgc", "dense")


def tree_gradient(name: str, seed: int) -> dict:
    """Student-t(3) leaves shaped like model ``name``'s parameters, each at its own scale."""
    shapes = trees.TREES[name]()
    scales = 10 ** np.random.default_rng(seed).uniform(-3, 0, len(shapes))

    @jax.jit
    def make(key):
        keys = jax.random.split(key, len(shapes))
        return {
            f"{i:03d}": jax.random.t(k, 3.0, shape, jnp.float32) * scale
            for i, (k, shape, scale) in enumerate(zip(keys, shapes, scales, strict=True))
        }

    return jax.block_until_ready(make(jax.random.key(seed)))


def training_steps(grads: dict, ratio: float) -> dict:
    """Training-like steps (gradient in, parameters out), each method in both layouts.

    ``params, state = step(params, state, grads)``: the compressor's update and
    ``optax.apply_updates``, jitted with the parameters and the state donated
    and carried from call to call, as a training loop runs them.
    """
    out = {FLOOR: jax.jit(lambda g: sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(g)))}
    for layout in trees.LAYOUTS:
        for name in TREE_METHODS:
            tx = sidco.compressor(name, ratio, layout=layout)

            def step(params, state, g, tx=tx):
                update, state = tx.update(g, state, params)
                return optax.apply_updates(params, update), state

            jitted = jax.jit(step, donate_argnums=(0, 1))
            box = [jax.tree.map(jnp.zeros_like, grads), tx.init(grads)]

            def call(g, jitted=jitted, box=box):
                box[0], box[1] = jitted(box[0], box[1], g)
                return box[0]

            out[f"step {name} [{layout}]"] = call
    return out


def run_tree(name: str, ratio: float, repeats: int, seed: int, rows: list[dict]) -> None:
    """Appends the training-step row of model tree ``name`` to ``rows``."""
    grads = tree_gradient(name, seed)
    ms = harness.measure(training_steps(grads, ratio), (grads,), repeats)
    floor = ms[FLOOR]["median"]
    top = {layout: ms[f"step topk [{layout}]"]["median"] for layout in trees.LAYOUTS}
    rows.append(
        {
            "tree": name,
            "leaves": len(grads),
            "n": sum(x.size for x in jax.tree.leaves(grads)),
            "ratio": ratio,
            "ms": ms,
            "vs_top_k": {
                k: t["median"] / top[k.split("[")[-1].rstrip("]")] if "[" in k else None
                for k, t in ms.items()
            },
            "vs_one_pass": {k: t["median"] / floor for k, t in ms.items()},
            "buckets_speedup": {
                m: ms[f"step {m} [tree]"]["median"] / ms[f"step {m} [buckets]"]["median"]
                for m in TREE_METHODS
            },
        }
    )
    print(tree_table(rows[-1:]), flush=True)


def tree_table(rows: list[dict]) -> str:
    """Markdown table of the training-step rows."""
    lines = [
        "| tree | ratio | method | median ms | p25 | p75 | / topk (same layout) | / one pass |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name, t in row["ms"].items():
            top = row["vs_top_k"][name]
            lines.append(
                f"| {row['tree']} ({row['leaves']} leaves) | {row['ratio']} | {name} "
                f"| {t['median']:.3f} | {t['p25']:.3f} | {t['p75']:.3f} "
                f"| {'' if top is None else f'{top:.3f}'} | {row['vs_one_pass'][name]:.1f} |"
            )
        speedups = ", ".join(f"{m} {x:.2f}x" for m, x in row["buckets_speedup"].items())
        lines.append(f"\nbuckets over the tree, {row['tree']}: {speedups}")
    return "\n".join(lines)


def is_resource_error(error: BaseException) -> bool:
    """Whether ``error`` is XLA (or the runtime) running out of memory."""
    return any(s in str(error) for s in RESOURCE_ERRORS)


def table(rows: list[dict], notes: list[str] = ()) -> str:
    """Markdown table, one line per (row, method); ``notes`` follow it as plain lines."""
    lines = [
        "| n | ratio | method | median ms | p25 | p75 | / top_k | / one pass | density / ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name, t in row["ms"].items():
            density = row["density"].get(name)
            density = "" if density is None else f"{density:.2f}"
            lines.append(
                f"| 2^{row['log2_n']} | {row['ratio']} | {name} | {t['median']:.3f} "
                f"| {t['p25']:.3f} | {t['p75']:.3f} | {row['vs_top_k'][name]:.3f} "
                f"| {row['vs_one_pass'][name]:.1f} | {density} |"
            )
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trees",
        nargs="*",
        default=["resnet50", "gpt2"],
        choices=list(trees.TREES),
        help="model trees whose training-like step is timed in both layouts (first)",
    )
    parser.add_argument("--tree-ratio", type=float, default=0.001, help="the trees' ratio")
    parser.add_argument("--sizes", type=int, nargs="+", default=[24, 26], help="log2 of n")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs after warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budget",
        type=float,
        default=270.0,
        help="seconds; no new size starts once elapsed + the previous size's time exceeds it",
    )
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/device.json"))
    parser.add_argument("--table", type=Path, default=None, help="markdown (default: JSON's .md)")
    return parser


def _resource_error(error: Exception) -> str:
    """The first line of a resource error's message; any other error is raised again."""
    if not is_resource_error(error):
        raise error
    return str(error).strip().splitlines()[0][:500]


def _trees(args, errors: list[dict]) -> list[dict]:
    """The trees' rows; a tree the device has no room for goes to ``errors``."""
    rows = []
    for name in args.trees:
        try:
            run_tree(name, args.tree_ratio, args.repeats, args.seed, rows)
        except Exception as error:
            errors.append({"tree": name, "error": _resource_error(error)})
            gc.collect()
            jax.clear_caches()
    return rows


def _sizes(args, start: float, errors: list[dict]) -> tuple[list[dict], list[int]]:
    """The flat vectors' rows, and the sizes skipped for the time budget."""
    rows, skipped, previous = [], [], 0.0
    for log2_n in args.sizes:
        elapsed = time.perf_counter() - start
        if elapsed + previous > args.budget:
            skipped.append(log2_n)
            print(
                f"budget: {elapsed:.1f} s + {previous:.1f} s > {args.budget:g} s, "
                f"skipping n = 2^{log2_n}",
                flush=True,
            )
            continue
        begin = time.perf_counter()
        try:
            run_size(log2_n, args.ratios, args.repeats, args.seed, rows)
        except Exception as error:
            message = _resource_error(error)
            done = [r["ratio"] for r in rows if r["log2_n"] == log2_n]
            errors.append({"log2_n": log2_n, "n": 2**log2_n, "ratios_done": done, "error": message})
            print(f"n = 2^{log2_n}: resource error, going on: {message}", flush=True)
        if errors and errors[-1].get("log2_n") == log2_n:
            gc.collect()  # outside the handler: the traceback no longer holds the buffers
            jax.clear_caches()
        previous = time.perf_counter() - begin
    return rows, skipped


def main(argv=None) -> list[dict]:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    table_path = args.table if args.table is not None else args.json.with_suffix(".md")
    device = jax.devices()[0]
    print(f"# {jax.default_backend()} ({device.device_kind}), jax {jax.__version__}", flush=True)
    errors, start = [], time.perf_counter()
    tree_rows = _trees(args, errors)
    rows, skipped = _sizes(args, start, errors)
    total = time.perf_counter() - start

    notes = [f"{e.get('tree') or 2 ** e['log2_n']}: {e['error']}" for e in errors]
    if skipped:
        notes.append(
            f"budget of {args.budget:g} s exceeded: skipped n = "
            + ", ".join(f"2^{s}" for s in skipped)
        )
    notes.append(f"total {total:.0f} s")
    text = tree_table(tree_rows) + "\n\n" + table(rows, notes)
    print()
    print(text)
    meta = harness.meta(
        "benchmarks.device",
        argv,
        device=str(device.device_kind),
        device_count=jax.device_count(),
        repeats=args.repeats,
        stages=STAGES,
        seed=args.seed,
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        budget_s=args.budget,
        total_s=total,
    )
    result = {"meta": meta, "tree_rows": tree_rows, "rows": rows, "errors": errors}
    harness.write(args.json, {**result, "skipped_sizes": skipped})
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text(text + "\n")
    print(f"\nwrote {args.json} and {table_path}")
    return rows


if __name__ == "__main__":
    main()
