"""Communication time per step past one machine, from the alpha-beta model of ``sidco_jax.costs``.

Nothing runs on devices: for a model of ``--params`` float32 parameters on
``P`` devices, ``--per-node`` of them per node, it evaluates the modelled time of
one aggregation (the gradient of one step) for

- dense: a ring all-reduce of the whole gradient;
- all_gather: ``communication="sparse"``, every device's payload to every device;
- sparse all-reduce: ``communication="sparse_allreduce"``;
- hierarchical: a dense all-reduce inside each node over its fast links, then
  the cheapest compressed mode across the ``P / per-node`` nodes
  (``inner_axis``), as ``communication="auto"`` would pick it;
- sharded: the same, each device of a node compressing and sending its
  ``1 / per-node`` slice of the node's mean (``inner_shards``).

The compressed modes run in each wire format of ``--wires`` (``values/indices``,
as :func:`sidco_jax.compress` takes them): ``float32/int32`` by default.

Flat modes run over the inter-node link once ``P`` spans more than one node (a
collective is as fast as its slowest hop), over the node's own link otherwise.
It also prints, per link and ratio, the device count from which one mode
overtakes another for good (scanning P over powers of two up to 2^16). The model's byte counts are
checked against the compiled HLO by ``benchmarks/aggregation.py`` and against
the wire by ``benchmarks/network.py --hierarchical`` (docs/benchmarks.md).

    python -m benchmarks.scale --params 1e9 --ratios 0.01 0.001 \\
        --devices 8 64 512 4096 --gbits 10 100 400 --wires float32/int32 int8/chunked
"""

import argparse
import itertools
import pathlib

from benchmarks import harness
from sidco_jax import costs

MODES = ("dense", "sparse", "sparse_allreduce")
LABELS = {"dense": "dense ring", "sparse": "all_gather", "sparse_allreduce": "sparse all-reduce"}


def step_seconds(
    size: int,
    ratio: float,
    devices: int,
    per_node: int,
    outer: costs.Link,
    wire: costs.Codec,
) -> dict:
    """Modelled seconds of each way to aggregate one gradient of ``size`` entries.

    ``wire`` is the format of the compressed modes' messages.
    """
    capacity = max(1, round(ratio * size))
    flat_link = outer if devices > per_node else costs.NODE_LINK
    row = {
        mode: costs.seconds(mode, size, capacity, devices, flat_link, False, wire) for mode in MODES
    }
    nodes, local = max(1, devices // per_node), min(devices, per_node)
    for name, share in (("hierarchical", 1), ("sharded", local)):
        cut, slots = -(-size // share), -(-capacity // share)
        mode = costs.choose(cut, slots, nodes, outer, False, wire) if nodes > 1 else "dense"
        row[name] = costs.hierarchical_seconds(
            mode, size, capacity, nodes, local, outer, costs.NODE_LINK, wire, sharded=share > 1
        )
        row[f"{name}_mode"] = mode if nodes > 1 else "-"
    return row


def crossovers(
    size: int, ratio: float, per_node: int, outer: costs.Link, wire: costs.Codec
) -> dict:
    """Per overtaking, the power-of-two device count from which it holds up to 2^16 (None: never).

    Where an overtaking holds at some device counts and not at larger ones (hierarchical
    aggregation on a slow link, for example), only the final, lasting crossing is given.
    """
    checks = {
        "all_gather slower than dense": lambda r: r["sparse"] > r["dense"],
        "sparse all-reduce beats all_gather": lambda r: r["sparse_allreduce"] < r["sparse"],
        "hierarchical beats every flat mode": lambda r: (
            r["hierarchical"] < min(r[m] for m in MODES)
        ),
        "sharded beats every flat mode": lambda r: r["sharded"] < min(r[m] for m in MODES),
    }
    found = dict.fromkeys(checks)
    for power in range(1, 17):
        row = step_seconds(size, ratio, 2**power, per_node, outer, wire)
        for name, holds in checks.items():
            if not holds(row):
                found[name] = None
            elif found[name] is None:
                found[name] = 2**power
    return found


def tables(rows: list[dict], crossings: list[dict]) -> str:
    """Markdown: modelled milliseconds per step, then the crossover device counts."""
    lines = [
        "| ratio | wire | inter-node Gbit/s | P | dense ring | all_gather | sparse all-reduce "
        "| hierarchical (outer mode) | sharded (outer mode) | best |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        times = {k: r[k] for k in (*MODES, "hierarchical", "sharded")}
        best = min(times, key=times.get)
        cells = " | ".join(f"{1e3 * r[m]:.1f}" for m in MODES)
        lines.append(
            f"| {r['ratio']} | {r['wire']} | {r['gbits']:g} | {r['devices']} | {cells} | "
            f"{1e3 * r['hierarchical']:.1f} ({r['hierarchical_mode']}) | "
            f"{1e3 * r['sharded']:.1f} ({r['sharded_mode']}) | {LABELS.get(best, best)} |"
        )
    lines += [
        "",
        "| ratio | wire | inter-node Gbit/s | " + " | ".join(crossings[0]["at"]) + " |",
    ]
    lines.append("|---:|---|---:|" + "---:|" * len(crossings[0]["at"]))
    for c in crossings:
        cells = " | ".join("never" if p is None else f"P = {p}" for p in c["at"].values())
        lines.append(f"| {c['ratio']} | {c['wire']} | {c['gbits']:g} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=1e9, help="model size (default 1e9)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument(
        "--gbits", type=float, nargs="+", default=[10, 100, 400], help="inter-node link, per device"
    )
    parser.add_argument("--per-node", type=int, default=8, help="devices per node (default 8)")
    parser.add_argument(
        "--latency-us", type=float, default=1e6 * costs.DEFAULT_LINK.latency, help="per message"
    )
    parser.add_argument(
        "--wires", nargs="+", default=["float32/int32"], help="values/indices of the messages"
    )
    parser.add_argument("--json", type=pathlib.Path, help="write the rows here")
    args = parser.parse_args(argv)
    size = int(args.params)
    rows, crossings = [], []
    for ratio, wire, gbits in itertools.product(args.ratios, args.wires, args.gbits):
        values, _, indices = wire.partition("/")
        codec = costs.Codec(values, indices)
        outer = costs.Link(args.latency_us * 1e-6, gbits * 1e9 / 8)
        for devices in args.devices:
            row = step_seconds(size, ratio, devices, args.per_node, outer, codec)
            rows.append({"ratio": ratio, "wire": wire, "gbits": gbits, "devices": devices, **row})
        at = crossovers(size, ratio, args.per_node, outer, codec)
        crossings.append({"ratio": ratio, "wire": wire, "gbits": gbits, "at": at})
    print(
        f"Modelled communication per step: {size:.3g} float32 parameters, "
        f"{args.per_node} devices per node (inner link {costs.NODE_LINK.bandwidth * 8e-9:g} "
        f"Gbit/s, {costs.NODE_LINK.latency * 1e6:g} us), inter-node latency {args.latency_us:g} us."
    )
    print(tables(rows, crossings))
    if args.json:
        harness.write(args.json, {"rows": rows, "crossovers": crossings})


if __name__ == "__main__":
    main()
