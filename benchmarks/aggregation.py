"""Bytes each aggregation mode moves per device, read from the compiled HLO, against the model.

Compiles the compressor's update (SIDCo-E) on a gradient of 2^20 float32
entries in two leaves under ``jax.shard_map`` over ``P`` forced CPU devices,
for every ``communication`` mode, and reads the collectives XLA emitted
(``sidco.hlo.collectives``). A device receives ``(P - 1) / P`` of an
all-gather's or all-to-all's result and, in a ring all-reduce, twice that; the
step's agreed figures (a psum of a few scalars) are listed apart. Each row is
set against ``sidco.costs.received_bytes``, the model ``"auto"`` decides with.

Then the same on a 2 x 4 mesh, hierarchically (``axis_name="node"``,
``inner_axis="local"``): bytes on the slow axis (collectives between the 2
nodes) and on the fast one (inside a node), against the flat modes over all 8
devices, whose every byte may cross nodes.

    python -m benchmarks.aggregation --ratios 0.01 0.001 --devices 2 4 8
"""

import argparse
import functools
import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco
from benchmarks import harness

SHAPES = {"w": (1024, 896), "b": (131072,)}  # 2^20 entries
SIZE = 1024 * 896 + 131072
MODES = ("dense", "sparse", "sparse_allreduce")
FIGURES = 64  # bytes: collectives this small carry the step's agreed figures


def received(collective: sidco.hlo.Collective) -> float:
    """Bytes one device receives from the others in ``collective``."""
    share = (collective.group_size - 1) / collective.group_size
    factor = 2 if collective.kind == "all-reduce" else 1  # ring: reduce-scatter + all-gather
    return factor * share * collective.result_bytes


def collectives(tx, mesh, state_axis, data_axes) -> list[sidco.hlo.Collective]:
    """The collectives of ``tx.update`` compiled under ``shard_map`` on ``mesh``."""
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = sidco.parallel.shard_init(tx, params, mesh, state_axis)
    specs = sidco.parallel.state_specs(state, state_axis)
    devices = mesh.devices.size

    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(specs, P(data_axes)), out_specs=(P(), specs)
    )
    def step(state, grads):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    split = jax.NamedSharding(mesh, P(data_axes))
    grads = {
        k: jax.ShapeDtypeStruct((devices, *s), jnp.float32, sharding=split)
        for k, s in SHAPES.items()
    }
    return sidco.hlo.collectives(jax.jit(step).lower(state, grads).compile())


def flat_rows(ratios, device_counts) -> list[dict]:
    rows = []
    capacity = {r: sidco.capacity(SIZE, r) for r in ratios}
    for devices in device_counts:
        mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
        for ratio in ratios:
            k = capacity[ratio]
            for mode in (*MODES, "auto"):
                tx = sidco.compress(ratio, axis_name="data", communication=mode)
                found = collectives(tx, mesh, "data", "data")
                payload = [c for c in found if c.result_bytes > FIGURES]
                concrete = mode
                if mode == "auto":
                    concrete = sidco.costs.choose(SIZE, k, devices)
                rows.append(
                    {
                        "devices": devices,
                        "ratio": ratio,
                        "mode": mode if mode != "auto" else f"auto -> {concrete}",
                        "capacity": k,
                        "kinds": sorted({c.kind for c in payload}),
                        "hlo_received": sum(received(c) for c in payload),
                        "figures": sum(received(c) for c in found if c.result_bytes <= FIGURES),
                        "model": sidco.costs.received_bytes(concrete, SIZE, k, devices),
                        "bound_3k8": 3 * k * 8,
                    }
                )
    return rows


def hierarchical_rows(ratios) -> list[dict]:
    mesh = jax.make_mesh((2, 4), ("node", "local"), devices=jax.devices()[:8])
    flat = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    rows = []
    for ratio in ratios:
        for mode in MODES:
            tx = sidco.compress(ratio, axis_name="node", inner_axis="local", communication=mode)
            found = collectives(tx, mesh, "node", ("node", "local"))
            slow = [c for c in found if c.group_size == 2 and c.result_bytes > FIGURES]
            fast = [c for c in found if c.group_size == 4]
            tx = sidco.compress(ratio, axis_name="data", communication=mode)
            everything = [
                c for c in collectives(tx, flat, "data", "data") if c.result_bytes > FIGURES
            ]
            rows.append(
                {
                    "ratio": ratio,
                    "mode": mode,
                    "slow_received": sum(received(c) for c in slow),
                    "fast_received": sum(received(c) for c in fast),
                    "flat_received": sum(received(c) for c in everything),
                    "model_slow": sidco.costs.received_bytes(
                        mode, SIZE, sidco.capacity(SIZE, ratio), 2
                    ),
                }
            )
    return rows


def _kb(x: float) -> str:
    return f"{x / 1024:,.1f}"


def tables(flat: list[dict], hierarchy: list[dict]) -> str:
    lines = [
        f"Gradient: {SIZE} float32 entries in 2 leaves; SIDCo-E; KiB received per device per step.",
        "",
        "| P | ratio | mode | collectives | HLO KiB | model KiB | HLO / model | 3 x k x 8 KiB |",
        "|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in flat:
        lines.append(
            f"| {r['devices']} | {r['ratio']} | {r['mode']} | {', '.join(r['kinds'])} | "
            f"{_kb(r['hlo_received'])} | {_kb(r['model'])} | "
            f"{r['hlo_received'] / r['model']:.3f} | {_kb(r['bound_3k8'])} |"
        )
    lines += [
        "",
        "2 x 4 mesh, hierarchical (dense inside a node, compressed between the 2 nodes) "
        "against the same mode flat over 8 devices:",
        "",
        "| ratio | mode | slow axis KiB | model KiB | fast axis KiB | flat over 8 KiB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in hierarchy:
        lines.append(
            f"| {r['ratio']} | {r['mode']} | {_kb(r['slow_received'])} | {_kb(r['model_slow'])} | "
            f"{_kb(r['fast_received'])} | {_kb(r['flat_received'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8], choices=range(2, 9))
    parser.add_argument("--json", type=pathlib.Path, help="write the rows here")
    args = parser.parse_args(argv)
    flat = flat_rows(args.ratios, args.devices)
    hierarchy = hierarchical_rows(args.ratios)
    print(tables(flat, hierarchy))
    if args.json:
        harness.write(args.json, {"flat": flat, "hierarchical": hierarchy})


if __name__ == "__main__":
    main()
