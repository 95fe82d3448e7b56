"""Compressors under error feedback: achieved density over training, and the final loss.

Error feedback changes what is thresholded step by step, so a threshold that is right on a
fresh gradient can drift. This trains three problems with plain SGD through every compressor
setting and reports, after a warm-up, the median of ``sent / target`` density, the fraction
of steps within [0.5, 2] x target, the fraction sending at least half the target, and the
final loss (and accuracy):

* ``least-squares``: 512 x 2000 Gaussian design, full-batch, lr 0.05;
* ``logistic``: softmax regression on scikit-learn's bundled digits (64 -> 10), lr 0.5;
* ``mlp``: a 64-256-256-10 tanh MLP on the digits, minibatches of 128, lr 0.1;
* ``t3-stream``: no model, fresh Student-t(3) noise as the gradient of every step (2^16
  entries), to see the controllers on data that one stage over-selects.

    python -m benchmarks.error_feedback --ratios 0.05 0.01 --steps 2000

Needs scikit-learn (``pip install -e ".[examples]"``) for the digits.
"""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sidco_jax as sidco
from benchmarks import harness

WARMUP = 100  # steps left out of the density figures (--warmup)


def least_squares():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(512, 2000)).astype(np.float32) / np.sqrt(2000)
    b = a @ rng.normal(size=2000).astype(np.float32)

    def loss(x, _):
        return 0.5 * jnp.sum((a @ x - b) ** 2)

    return loss, jnp.zeros(2000), 0.05, None, None


def _digits():
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(data.target)


def logistic():
    x, y = _digits()

    def loss(w, _):
        logits = x @ w["w"] + w["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def accuracy(w):
        return jnp.mean(jnp.argmax(x @ w["w"] + w["b"], -1) == y)

    return loss, {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}, 0.5, accuracy, None


def mlp():
    x, y = _digits()
    sizes = [64, 256, 256, 10]
    keys = jax.random.split(jax.random.key(0), len(sizes))
    params = [
        {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
        for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=False)
    ]

    def forward(p, inputs):
        h = inputs
        for layer in p[:-1]:
            h = jnp.tanh(h @ layer["w"] + layer["b"])
        return h @ p[-1]["w"] + p[-1]["b"]

    def loss(p, batch):
        inputs, labels = (x, y) if batch is None else (x[batch], y[batch])
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, inputs), labels).mean()

    def accuracy(p):
        return jnp.mean(jnp.argmax(forward(p, x), -1) == y)

    def batches(key):
        return jax.random.randint(key, (128,), 0, x.shape[0])

    return loss, params, 0.1, accuracy, batches


def t3_stream():
    """No model: the 'gradient' is fresh Student-t(3) noise every step (2^16 entries)."""

    def loss(p, key):
        # Student-t(3) as normal / sqrt(chi2_3 / 3): jax.random.t's gamma sampler is ~50x slower.
        z = jax.random.normal(jax.random.key(0) if key is None else key, (4, *p.shape))
        noise = z[0] / jnp.sqrt(jnp.sum(z[1:] ** 2, axis=0) / 3.0)
        return jnp.vdot(p, noise)

    return loss, jnp.zeros(2**16), 0.0, None, lambda key: key


PROBLEMS = {
    "least-squares": least_squares,
    "logistic": logistic,
    "mlp": mlp,
    "t3-stream": t3_stream,
}


def settings(ratio: float) -> dict:
    out = {"dense": sidco.dense()}
    for name, estimator in (("e", "exponential"), ("p", "gpareto"), ("gp", "gamma")):
        for m in (1, 3):
            out[f"sidco-{name} M={m}"] = sidco.compress(
                ratio, estimator=estimator, stages=m, adaptation=None
            )
        for rule in sidco.ADAPTATIONS:
            for start in (1, 3):
                out[f"sidco-{name} {rule} from {start}"] = sidco.compress(
                    ratio, estimator=estimator, stages=start, adaptation=rule
                )
    for name in sidco.COMPRESSORS:
        if not name.startswith("sidco") and name != "dense":
            out[name] = sidco.compressor(name, ratio)
    # The wire formats, against SIDCo-E's default (float32 values, int32 indices).
    out["sidco-e"] = sidco.compress(ratio)
    for values in sidco.VALUE_CODECS[1:]:
        out[f"sidco-e {values}/chunked"] = sidco.compress(ratio, values=values, indices="chunked")
    return out


def train(problem, compressor, steps: int):
    loss, params, lr, accuracy, batches = problem
    tx = optax.chain(compressor, optax.sgd(lr))

    def step(carry, key):
        params, state = carry
        batch = None if batches is None else batches(key)
        grads = jax.grad(loss)(params, batch)
        updates, state = tx.update(grads, state, params)
        m = sidco.metrics(state)
        return (optax.apply_updates(params, updates), state), (
            m["density"] / m["target_density"],
            m["stages"],
        )

    keys = jax.random.split(jax.random.key(1), steps)
    (params, _), (achieved, stages) = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), keys))(
        params, tx.init(params)
    )
    final = float(loss(params, None))
    acc = float(accuracy(params)) if accuracy is not None else None
    return final, acc, np.asarray(achieved), np.asarray(stages)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS), choices=list(PROBLEMS))
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.01])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--only", nargs="+", default=None, help="compressor labels to keep")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="steps left out of the figures")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/error_feedback.json"))
    args = parser.parse_args(argv)

    rows = []
    for name in args.problems:
        problem = PROBLEMS[name]()
        initial = float(problem[0](problem[1], None))
        for ratio in args.ratios:
            print(f"\n### {name}, ratio {ratio} (initial loss {initial:.4g})\n")
            print(
                "| compressor | median sent/target | steps in [0.5, 2] | steps >= 0.5 | final loss "
                "| accuracy | final stages |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|")
            for label, compressor in settings(ratio).items():
                if args.only is not None and label not in args.only:
                    continue
                final, acc, achieved, stages = train(problem, compressor, args.steps)
                tail = achieved[args.warmup :]
                within = float(np.mean((tail >= 0.5) & (tail <= 2.0)))
                half = float(np.mean(tail >= 0.5))
                rows.append(
                    {
                        "problem": name,
                        "ratio": ratio,
                        "compressor": label,
                        "final_loss": final,
                        "accuracy": acc,
                        "median_achieved": float(np.median(tail)),
                        "within_half_double": within,
                        "at_least_half": half,
                        "final_stages": int(stages[-1]),
                    }
                )
                acc_text = "-" if acc is None else f"{acc:.3f}"
                print(
                    f"| {label} | {np.median(tail):.2f} | {within:.2f} | {half:.2f} | {final:.3g} "
                    f"| {acc_text} "
                    f"| {int(stages[-1])} |",
                    flush=True,
                )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    harness.write(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
