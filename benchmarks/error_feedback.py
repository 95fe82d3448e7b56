"""Least squares under error feedback: final loss and achieved density per compressor setting.

Plain SGD on an underdetermined least-squares problem (256 x 512, seed 1234), dense against
``compress`` for every estimator and stage count, same steps and learning rate.

    python benchmarks/error_feedback.py --ratio 0.05 --steps 1500 --lr 0.2
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sidco_jax as sidco


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args(argv)

    rng = np.random.default_rng(1234)
    a = rng.normal(size=(256, 512)).astype(np.float32) / 16
    b = a @ rng.normal(size=512).astype(np.float32)

    def loss(x):
        return 0.5 * jnp.sum((a @ x - b) ** 2)

    def train(tx):
        x, state = jnp.zeros(512), tx.init(jnp.zeros(512))

        @jax.jit
        def step(x, state):
            u, state = tx.update(jax.grad(loss)(x), state, x)
            return optax.apply_updates(x, u), state

        for _ in range(args.steps):
            x, state = step(x, state)
        return float(loss(x)), state

    print(f"initial loss {float(loss(jnp.zeros(512))):.4g}\n")
    print("| compressor | final loss | density / target (last step) |\n|---|---:|---:|")
    print(f"| dense | {train(optax.sgd(args.lr))[0]:.3g} | - |")
    for estimator in sidco.ESTIMATORS:
        for m in args.stages:
            final, state = train(
                optax.chain(
                    sidco.compress(args.ratio, estimator=estimator, stages=m), optax.sgd(args.lr)
                )
            )
            density = float(sidco.metrics(state)["density"]) / args.ratio
            print(f"| {estimator}, {m} stage(s) | {final:.3g} | {density:.2f} |")


if __name__ == "__main__":
    main()
