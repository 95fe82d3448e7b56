"""Bytes per slot of each wire format, read from the compiled HLO on 8 forced CPU devices.

Compiles SIDCo-E's update under ``jax.shard_map`` for each ``values`` x
``indices`` pair, each communication mode (``"sparse"``, ``"sparse_allreduce"``,
and ``"sparse"`` between the 2 nodes of a 2 x 4 mesh, hierarchically) and
each ratio, on a gradient of one leaf of 2^22 entries and on GPT-2 small's
parameter shapes; nothing runs, so no gradient is allocated. The bytes are
the operands of the message's collectives (what one device puts in: the
step's agreed figures, a psum of a few scalars, are left out), per slot the
message carries: ``k`` for the all-gather, ``P x s + r`` routed and reduced
slots for the sparse all-reduce (``sidco.costs.plan``). Each row is set
against ``sidco.costs.message_bytes``, the model ``"auto"`` decides with.

    python -m benchmarks.codecs --trees flat gpt2 --ratios 0.01 0.001 --layout buckets

The layout changes nothing sent (the payload indexes the same entries in both);
buckets compile GPT-2's 148 leaves faster.
"""

import argparse
import functools
import itertools
import json
import math
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

import sidco_jax as sidco
from benchmarks import harness, trees

FIGURES = 64  # bytes: collectives this small carry the step's agreed figures
PAIRS = [(v, i) for v in sidco.VALUE_CODECS for i in ("int32", "chunked")]
SHAPES = {"flat": lambda: [(2**22,)], "gpt2": trees.gpt2}
# (mode, axis the compressor averages over, inner axis): "hierarchical" is "sparse" over 2 nodes.
MODES = {
    "sparse": ("data", None),
    "sparse_allreduce": ("data", None),
    "hierarchical": ("node", "local"),
}


def _mesh(mode: str):
    if mode == "hierarchical":
        return jax.make_mesh((2, 4), ("node", "local"), devices=jax.devices()[:8])
    return jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])


def message_bytes(
    shapes, ratio: float, mode: str, values: str, indices: str, layout: str = "tree"
) -> int:
    """Operand bytes of the message's collectives in SIDCo-E's compiled update."""
    axis, inner = MODES[mode]
    tx = sidco.compress(
        ratio,
        axis_name=axis,
        inner_axis=inner,
        communication="sparse" if mode == "hierarchical" else mode,
        values=values,
        indices=indices,
        layout=layout,
    )
    mesh = _mesh(mode)
    params = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    init = functools.partial(sidco.parallel.shard_init, tx, mesh=mesh, axis_name=axis)
    state = jax.eval_shape(init, params)  # shapes and shardings: nothing allocated
    specs = sidco.parallel.state_specs(state, axis)
    data = tuple(mesh.axis_names)

    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(specs, jax.P(data)), out_specs=(jax.P(), specs)
    )
    def step(state, grads):
        return tx.update([g[0] for g in grads], state)

    split = jax.NamedSharding(mesh, jax.P(data))
    grads = [jax.ShapeDtypeStruct((8, *s), jnp.float32, sharding=split) for s in shapes]
    found = sidco.hlo.collectives(jax.jit(step).lower(state, grads).compile())
    inside_a_node = 4  # the hierarchical mesh's dense mean over "local"
    return sum(
        c.operand_bytes
        for c in found
        if c.result_bytes > FIGURES
        and not (mode == "hierarchical" and c.group_size == inside_a_node)
    )


def model_bytes(size: int, k: int, mode: str, values: str, indices: str) -> int:
    """The same from the cost model: what ``sidco.costs`` charges for one device's message."""
    wire = sidco.costs.Codec(values, indices)
    if mode != "sparse_allreduce":
        return sidco.costs.message_bytes("sparse", size, k, 1, wire)
    plan = sidco.costs.plan(size, k, 8)

    def one(slots):
        return sidco.costs.message_bytes("sparse", plan.region, slots, 1, wire)

    return 8 * one(plan.route) + one(plan.reduced)


def slots(size: int, k: int, mode: str) -> int:
    """The slots one device's message carries."""
    if mode != "sparse_allreduce":
        return k
    plan = sidco.costs.plan(size, k, 8)
    return 8 * plan.route + plan.reduced


def rows(tree_names, ratios, layout: str = "tree") -> list[dict]:
    out = []
    for name in tree_names:
        shapes = SHAPES[name]()
        size = sum(math.prod(s) for s in shapes)
        for ratio, mode, (values, indices) in itertools.product(ratios, MODES, PAIRS):
            k = sidco.capacity(size, ratio)
            hlo = message_bytes(shapes, ratio, mode, values, indices, layout)
            out.append(
                {
                    "tree": name,
                    "size": size,
                    "ratio": ratio,
                    "mode": mode,
                    "values": values,
                    "indices": indices,
                    "slots": slots(size, k, mode),
                    "hlo_bytes": hlo,
                    "model_bytes": model_bytes(size, k, mode, values, indices),
                    "per_slot": hlo / slots(size, k, mode),
                }
            )
            print(json.dumps(out[-1]), flush=True)
    return out


def table(found: list[dict]) -> str:
    pairs = [f"{v}/{i}" for v, i in PAIRS]
    lines = [
        "| tree | ratio | mode | " + " | ".join(pairs) + " |",
        "|---|---:|---|" + "---:|" * len(pairs),
    ]
    keys = sorted({(r["tree"], r["ratio"], r["mode"]) for r in found}, key=str)
    for tree, ratio, mode in keys:
        cells = {
            f"{r['values']}/{r['indices']}": r["per_slot"]
            for r in found
            if (r["tree"], r["ratio"], r["mode"]) == (tree, ratio, mode)
        }
        lines.append(
            f"| {tree} | {ratio} | {mode} | " + " | ".join(f"{cells[p]:.2f}" for p in pairs) + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=["flat", "gpt2"], choices=list(SHAPES))
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.01, 0.001])
    parser.add_argument(
        "--layout", default="tree", choices=sidco.LAYOUTS, help="the same bytes, faster compiles"
    )
    parser.add_argument("--json", type=pathlib.Path, help="write the rows here")
    args = parser.parse_args(argv)
    found = rows(args.trees, args.ratios, args.layout)
    print(table(found))
    if args.json:
        harness.write(args.json, found)
    return found


if __name__ == "__main__":
    main()
