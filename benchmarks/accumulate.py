"""What a micro-step of gradient accumulation costs: sidco.accumulate against optax.MultiSteps.

Under ``jax.shard_map`` over forced CPU devices, one jitted update per variant
on a flat gradient of ``--size`` entries, timed over the micro-steps only (the
first ``every_k - 1`` of each optimizer step), and the collectives of each
compiled step read from its HLO::

    python -m benchmarks.accumulate --size 362000 --every-k 4 --repeats 20
"""

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sidco_jax as sidco

AXIS = "data"


def variants(ratio: float, every_k: int) -> dict:
    def chain(compressor):
        return optax.chain(compressor, optax.sgd(0.1))

    sparse = chain(sidco.compress(ratio, axis_name=AXIS))
    return {
        "MultiSteps(dense)": optax.MultiSteps(chain(sidco.dense(axis_name=AXIS)), every_k),
        "MultiSteps(sidco-e)": optax.MultiSteps(sparse, every_k),
        "accumulate(sidco-e)": sidco.accumulate(sparse, every_k),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=362_000)
    parser.add_argument("--ratio", type=float, default=0.001)
    parser.add_argument("--every-k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    mesh = jax.make_mesh((8,), (AXIS,))
    params = jnp.zeros(args.size)
    grads = jax.device_put(
        np.random.default_rng(0).standard_t(3, (8, args.size)).astype(np.float32),
        NamedSharding(mesh, P(AXIS)),
    )
    print("| variant | micro-step (ms, median) | p25-p75 | collectives in the step |")
    print("|---|---:|---:|---|")
    for label, tx in variants(args.ratio, args.every_k).items():
        state = sidco.parallel.shard_init(tx, params, mesh, AXIS)
        specs = sidco.parallel.state_specs(state, AXIS)
        # MultiSteps' accumulator varies across devices but is not marked per device.
        if isinstance(state, optax.MultiStepsState):
            specs = specs._replace(acc_grads=P(AXIS))
            state = jax.device_put(
                state._replace(acc_grads=jnp.zeros(8 * args.size)), NamedSharding(mesh, P())
            )
            state = jax.tree.map(
                lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs
            )

        @jax.jit
        @functools.partial(
            jax.shard_map, mesh=mesh, in_specs=(specs, P(AXIS)), out_specs=(P(), specs)
        )
        def step(state, g, tx=tx):
            return tx.update(g[0], state, params)

        compiled = step.lower(state, grads).compile()
        kinds = [c.kind for c in sidco.hlo.collectives(compiled)]
        times = []
        for i in range(args.repeats * args.every_k):
            start = time.perf_counter()
            _, state = compiled(state, grads)
            jax.block_until_ready(state)
            if i % args.every_k != args.every_k - 1:
                times.append(1e3 * (time.perf_counter() - start))
        times = times[args.every_k :]  # the first optimizer step warms up
        p25, p50, p75 = np.percentile(times, [25, 50, 75])
        names = ", ".join(sorted(set(kinds)))
        print(f"| {label} | {p50:.2f} | {p25:.2f}-{p75:.2f} | {len(kinds)} ({names}) |")


if __name__ == "__main__":
    main()
