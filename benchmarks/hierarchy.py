"""A node's devices sharing its compression, against the replicated hierarchy and the flat modes.

Compiles SIDCo-E's update under ``jax.shard_map`` on forced CPU meshes of
``("node", "local")`` devices (2 x 4 and 4 x 2) for

- flat: ``communication="sparse"`` or ``"sparse_allreduce"`` over both axes;
- replicated: ``axis_name="node", inner_axis="local"``: the node's dense mean,
  then ``"sparse"`` across the nodes, every device compressing the whole mean;
- sharded: the same with ``inner_shards``: a ``psum_scatter`` over the node,
  each device compressing its slice, an ``all_gather`` over the node after;
- params: ``inner_shards="params"``, the parameters themselves sharded over
  the node (each leaf along its largest dimension that splits evenly): the
  ``psum_scatter`` of FSDP's backward pass, each device compressing its
  shards, no ``all_gather`` in the update (the next forward pass gathers the
  parameters instead).

From the compiled HLO it reads the collectives of each axis, the slow one
(groups of a node's peers across the nodes, or the whole mesh for the flat
modes) and the fast one (a node's devices), and counts the bytes one device
receives in each as a ring moves them (:func:`received`); the step's agreed
figures (a few scalars) are left out. The residual
per device is the size of one device's; the state per device adds the
parameters and Adam's two moments as each variant holds them. ``--time`` also times the
update on each mesh, replicated and sharded interleaved, on the same gradients.

    python -m benchmarks.hierarchy --trees flat gpt2 --ratios 0.01 0.001
    python -m benchmarks.hierarchy --trees resnet50 --ratios 0.01 --time --rounds 7
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
import numpy as np

import sidco_jax as sidco
from benchmarks import harness, trees
from examples.common import parallel as example_parallel

FIGURES = 64  # bytes: collectives this small carry the step's agreed figures
SHAPES = {"flat": lambda: [(2**22,)], **trees.TREES}
MESHES = ((2, 4), (4, 2))
BOTH = ("node", "local")
VARIANTS = ("flat sparse", "flat sparse_allreduce", "replicated", "sharded", "params")


def compressor(variant: str, ratio: float, local: int):
    """SIDCo-E as ``variant`` aggregates, and the axes its residual is split over."""
    if variant.startswith("flat"):
        mode = variant.split()[1]
        return sidco.compress(ratio, axis_name=BOTH, communication=mode, layout="buckets"), BOTH
    options = {"axis_name": "node", "inner_axis": "local", "communication": "sparse"}
    if variant in ("sharded", "params"):
        shards = local if variant == "sharded" else "params"
        return sidco.compress(ratio, inner_shards=shards, **options), BOTH
    return sidco.compress(ratio, layout="buckets", **options), "node"


def param_specs(variant: str, shapes, mesh) -> list:
    """Replicated parameters, or (``"params"``) each leaf split over the node's devices as the
    examples split them (along its largest dimension they divide)."""
    if variant != "params":
        return [jax.P()] * len(shapes)
    leaves = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return example_parallel.param_specs(leaves, mesh)


def step_of(tx, mesh, axes, shapes, specs):
    """The jitted update under ``shard_map``, the state's shapes, the gradients' shapes.

    Each device's gradient reaches the compressor as the parameters are held: whole, or
    (sharded parameters) its shard of the node's mean, through FSDP's backward pass.
    """
    params = [
        jax.ShapeDtypeStruct(s, jnp.float32, sharding=jax.NamedSharding(mesh, p))
        for s, p in zip(shapes, specs, strict=True)
    ]
    init = functools.partial(
        sidco.parallel.shard_init, tx, mesh=mesh, axis_name=axes, param_specs=specs
    )
    state = jax.eval_shape(init, params)
    out_specs = sidco.parallel.state_specs(state, axes)
    owned = any(s != jax.P() for s in specs)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(specs, out_specs, jax.P(BOTH)),
        out_specs=(specs, out_specs),
    )
    def step(params, state, grads):
        grads = [g[0] for g in grads]
        if owned:  # the transpose of gathering the parameters: the node's mean, scattered
            at = jax.lax.pcast(params, "node", to="varying")
            grads = jax.vjp(lambda p: sidco.parallel.gather(p, specs), at)[1](grads)[0]
        return tx.update(grads, state, params)

    devices = mesh.devices.size
    split = jax.NamedSharding(mesh, jax.P(BOTH))
    grads = [jax.ShapeDtypeStruct((devices, *s), jnp.float32, sharding=split) for s in shapes]
    return step, params, state, grads


def per_device_bytes(tree) -> int:
    """Bytes of one device's piece of every leaf of ``tree`` (global arrays or their shapes)."""
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)


def received(c: sidco.hlo.Collective) -> float:
    """Bytes one device receives in collective ``c`` over a ring of its group."""
    g = c.group_size
    share = {"all-reduce": 2 * (g - 1) / g, "all-gather": g - 1}.get(c.kind, (g - 1) / g)
    return share * c.operand_bytes


def measured_bytes(variant: str, nodes: int, local: int, shapes, ratio: float) -> dict:
    """Operand bytes per device on each axis, from the HLO, and the residual per device."""
    mesh = jax.make_mesh((nodes, local), BOTH, devices=jax.devices()[: nodes * local])
    tx, axes = compressor(variant, ratio, local)
    specs = param_specs(variant, shapes, mesh)
    step, params, state, grads = step_of(tx, mesh, axes, shapes, specs)
    found = sidco.hlo.collectives(step.lower(params, state, grads).compile())
    slow, fast = 0, 0
    for c in found:
        if c.result_bytes <= FIGURES:
            continue
        if c.group_size == local and not variant.startswith("flat"):
            fast += received(c)
        else:
            slow += received(c)
    residual = per_device_bytes(state.residual)
    return {
        "slow_bytes": round(slow),
        "fast_bytes": round(fast),
        "residual_bytes": residual,
        # Parameters and Adam's two moments, held as the parameters are (state_specs with
        # param_specs shards the moments with them), and the residual.
        "state_bytes": residual + 3 * per_device_bytes(params),
    }


def bytes_rows(tree_names, ratios) -> list[dict]:
    out = []
    for name, ratio, (nodes, local), variant in itertools.product(
        tree_names, ratios, MESHES, VARIANTS
    ):
        shapes = SHAPES[name]()
        row = {"tree": name, "ratio": ratio, "mesh": f"{nodes}x{local}", "variant": variant}
        row |= measured_bytes(variant, nodes, local, shapes, ratio)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def time_rows(tree_names, ratios, rounds: int) -> list[dict]:
    """The update's time, replicated, sharded and on sharded parameters, interleaved, on the
    same gradients."""
    out = []
    for name, ratio, (nodes, local) in itertools.product(tree_names, ratios, MESHES):
        shapes = SHAPES[name]()
        mesh = jax.make_mesh((nodes, local), BOTH, devices=jax.devices()[: nodes * local])
        fns, args = {}, {}
        for variant in ("replicated", "sharded", "params"):
            tx, axes = compressor(variant, ratio, local)
            specs = param_specs(variant, shapes, mesh)
            step, _, _ = step_of(tx, mesh, axes, shapes, specs)
            params = sidco.parallel.place([np.zeros(s, np.float32) for s in shapes], mesh)
            params = [
                jax.reshard(p, jax.NamedSharding(mesh, q))
                for p, q in zip(params, specs, strict=True)
            ]
            state = sidco.parallel.shard_init(tx, params, mesh, axes, specs)
            fns[variant], args[variant] = functools.partial(step, params), state
        one = trees.gradient(shapes)
        split = jax.NamedSharding(mesh, jax.P(BOTH))
        grads = [
            jax.device_put(np.broadcast_to(x, (nodes * local, *x.shape)), split)
            for x in one.values()
        ]
        runs = {v: functools.partial(lambda f, s, g: f(s, g), fns[v], args[v]) for v in fns}
        times = harness.measure(runs, (grads,), rounds)
        row = {"tree": name, "ratio": ratio, "mesh": f"{nodes}x{local}", **times}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def table(found: list[dict]) -> str:
    lines = [
        "| tree | ratio | mesh | aggregation | slow axis, bytes | fast axis, bytes | residual "
        "| state |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in found:
        lines.append(
            f"| {r['tree']} | {r['ratio']} | {r['mesh']} | {r['variant']} | "
            f"{r['slow_bytes']:,} | {r['fast_bytes']:,} | {r['residual_bytes']:,} "
            f"| {r['state_bytes']:,} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", nargs="+", choices=sorted(SHAPES), default=["flat", "gpt2"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--time", action="store_true", help="time the updates instead")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds, interleaved")
    parser.add_argument("--json", type=pathlib.Path, help="write the rows here")
    args = parser.parse_args(argv)
    if args.time:
        found = time_rows(args.trees, args.ratios, args.rounds)
    else:
        found = bytes_rows(args.trees, args.ratios)
        print(table(found))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        harness.write(args.json, found)
    return found


if __name__ == "__main__":
    main()
