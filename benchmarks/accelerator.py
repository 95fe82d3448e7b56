"""The program each compressor's update compiles to for a TPU, compiled without one.

libtpu (``pip install -e ".[tpu-compile]"``) compiles for a TPU topology on a
machine that has none. Each method's whole update (error feedback, selection,
the all-gather over 4 chips of a v5e:2x2 slice, write-back, metrics), in the
bucketed layout, is compiled for one leaf of 2^22 entries and for the ResNet-50
and GPT-2 small trees (``benchmarks.trees``), and read with
``sidco.hlo.kernels``: kernels on the longest and the cheapest path (a
conditional as its largest or smallest branch, a loop's body once), sorts and
the widest, while loops, XLA's TPU cost model (``optimal_seconds``, which sums
every branch of a conditional; negative where it has no estimate) and the
compile time.

    python -m benchmarks.accelerator
    python -m benchmarks.accelerator --trees leaf --methods sidco-e topk
"""

import argparse
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import P

import sidco_jax as sidco
from benchmarks import harness
from benchmarks.harness import compressor
from benchmarks.trees import gpt2, resnet50

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("dense", "topk", "approxk", "dgc", "redsync", "gaussiank", "sidco-e", "sidco-p")
METHODS += ("sidco-gp", "sidco-e paper")
TREES = {"leaf": lambda: [(2**22,)], "resnet50": resnet50, "gpt2": gpt2}
TOPOLOGY, CHIPS = "v5e:2x2", 4


def tpu_mesh():
    """A mesh over the 4 chips of a v5e:2x2 slice, from libtpu's topology (no TPU needed)."""
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling needs no lock
    topology = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY)
    return topologies.make_mesh(topology, (CHIPS,), ("data",))


def two_slices_mesh():
    """A (slice, chip) mesh of two v5e:2x2 slices, joined by the data-center network."""
    from jax.experimental import mesh_utils, topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    topology = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGY, num_slices=2)
    # Each slice's chips along "chip", the slices along "slice" (the slow axis).
    devices = mesh_utils.create_hybrid_device_mesh((1, CHIPS), (2, 1), devices=topology.devices)
    return jax.sharding.Mesh(devices, ("slice", "chip"))


def compile_update(method: str, shapes, ratio: float, mesh):
    """The compiled ``shard_map``ped update of ``method`` over ``mesh``, and its seconds."""
    tx = compressor(method, ratio, axis_name="data", layout="buckets")
    params = {f"{i:03d}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)}
    state = jax.eval_shape(tx.init, params)
    specs = sidco.parallel.state_specs(state, "data")

    def placed(x, spec):  # a per-device leaf is stacked along its leading axis
        shape = x.shape if spec == P() else (CHIPS * x.shape[0], *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=jax.NamedSharding(mesh, spec))

    step = jax.shard_map(
        lambda g, s: tx.update(jax.lax.pcast(g, "data", to="varying"), s),
        mesh=mesh,
        in_specs=(P(), specs),
        out_specs=(P(), specs),
    )
    start = time.perf_counter()
    compiled = (
        jax.jit(step)
        .trace(jax.tree.map(lambda x: placed(x, P()), params), jax.tree.map(placed, state, specs))
        .lower()
        .compile()
    )
    return compiled, time.perf_counter() - start


def row(method: str, tree: str, ratio: float, mesh) -> dict:
    compiled, seconds = compile_update(method, TREES[tree](), ratio, mesh)
    cost = (compiled.cost_analysis() or {}).get("optimal_seconds", -1.0)
    return {
        "method": method,
        "tree": tree,
        **sidco.hlo.kernels(compiled)._asdict(),
        "cost_ms": cost * 1e3 if cost >= 0 else None,
        "compile_s": seconds,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=list(TREES), choices=list(TREES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/accelerator.json")
    args = parser.parse_args(argv)
    mesh = tpu_mesh()
    print(
        "| tree | method | longest | cheapest | sorts (widest) | loops | TPU cost model ms", end=""
    )
    print(" | compile s |\n|---|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for tree in args.trees:
        for method in args.methods:
            r = row(method, tree, args.ratio, mesh)
            rows.append(r)
            cost = f"{r['cost_ms']:.3f}" if r["cost_ms"] is not None else "none"
            print(
                f"| {tree} | {method} | {r['longest']} | {r['cheapest']} | {r['sorts']} "
                f"({r['largest_sort']}) | {r['loops']} | {cost} | {r['compile_s']:.0f} |",
                flush=True,
            )
    from importlib.metadata import version

    more = {"topology": TOPOLOGY, "ratio": args.ratio, "libtpu": version("libtpu")}
    meta = harness.meta("benchmarks.accelerator", argv, **more)
    harness.write(args.json, {"meta": meta, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
