"""Bytes per step each compressor communicates, read from the compiled HLO, and step time.

Compiles one data-parallel training step of an MLP (784-1024-256-10, 1.07M
parameters) under ``jax.shard_map`` over 8 forced CPU devices for every
compressor, lists the collectives XLA emitted (``sidco.hlo.collectives``) and
times the step (median over repetitions, compressors run round-robin).

    python -m benchmarks.communication --ratios 0.01 0.001 --repeats 20
"""

import argparse
import functools
import itertools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco
from benchmarks import harness

AXIS = "data"
LAYERS = (784, 1024, 256, 10)
PER_DEVICE = 32


def compressors(ratio: float) -> dict:
    """Every registered compressor, and SIDCo-E forced to a dense psum."""
    out = {name: sidco.compressor(name, ratio, axis_name=AXIS) for name in sidco.COMPRESSORS}
    out["sidco-e dense psum"] = sidco.compressor(
        "sidco-e", ratio, axis_name=AXIS, communication="dense"
    )
    return out


def init_params(rng):
    return [
        {
            "w": rng.normal(scale=m**-0.5, size=(m, n)).astype(np.float32),
            "b": np.zeros(n, np.float32),
        }
        for m, n in itertools.pairwise(LAYERS)
    ]


def loss(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def build(compressor, mesh, params):
    tx = optax.chain(compressor, optax.sgd(0.01))
    state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
    specs = sidco.parallel.state_specs(state, AXIS)

    @jax.jit
    @functools.partial(
        jax.shard_map, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)
    )
    def step(params, state, x, y):
        grads = jax.grad(loss)(jax.lax.pcast(params, AXIS, to="varying"), x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    devices = jax.device_count()
    mesh = jax.make_mesh((devices,), (AXIS,))
    rng = np.random.default_rng(0)
    params = jax.device_put(init_params(rng), NamedSharding(mesh, P()))
    n = sum(x.size for x in jax.tree.leaves(params))
    x = jax.device_put(
        rng.normal(size=(devices * PER_DEVICE, LAYERS[0])).astype(np.float32),
        NamedSharding(mesh, P(AXIS)),
    )
    y = jax.device_put(rng.integers(0, 10, devices * PER_DEVICE), NamedSharding(mesh, P(AXIS)))
    print(f"{n} parameters, {devices} devices, jax {jax.__version__}, {jax.devices()[0].platform}")

    for ratio in args.ratios:
        steps, found = {}, {}
        for name, compressor in compressors(ratio).items():
            step, state = build(compressor, mesh, params)
            found[name] = sidco.hlo.collectives(step.lower(params, state, x, y).compile())
            steps[name] = functools.partial(step, params, state)
        times = harness.measure(steps, (x, y), args.repeats)
        dense_ms = times["dense"]["median"]
        print(f"\nratio {ratio}")
        print(
            "| compressor | collectives | bytes sent / device | bytes received / device "
            "| / dense | step ms | / dense step |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        dense_bytes = sum(c.operand_bytes for c in found["dense"])
        for name, collectives in found.items():
            sent = sum(c.operand_bytes for c in collectives)
            got = sum(c.result_bytes for c in collectives)
            kinds = ", ".join(sorted({c.kind for c in collectives}))
            ms = times[name]["median"]
            print(
                f"| {name} | {kinds} | {sent:,} | {got:,} | {sent / dense_bytes:.4f} "
                f"| {ms:.1f} | {ms / dense_ms:.2f} |"
            )


if __name__ == "__main__":
    main()
