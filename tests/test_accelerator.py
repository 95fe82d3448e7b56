"""The program for GPUs and TPUs: the same results as XLA:CPU's, and few kernels.

Payloads have two formulations chosen as the program is lowered: bitmask words
on XLA:CPU and dense per-block kernels elsewhere. Here the accelerators' one
runs on the CPU (``passes.formulation``) against the CPU's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sidco_jax as sidco
from sidco_jax._src import passes
from sidco_jax._src import payload as payload_lib


def _gradients(rng, steps, shapes, kind):
    out = []
    for _ in range(steps):
        grads = {}
        for i, shape in enumerate(shapes):
            x = rng.standard_t(3, size=shape).astype(np.float32) * 10.0**-i
            if kind == "ties":  # a few magnitudes, many equal: thresholds land on ties
                x = np.round(x * 2) / 2
            elif kind == "equal":  # every magnitude equal: the rules select nothing
                x = np.sign(x) + (x == 0)
            grads[f"{i}"] = jnp.asarray(x)
        out.append(grads)
    return out


def _run(tx, stream, formulation):
    with passes.formulation(formulation):
        update = jax.jit(tx.update)  # traced inside, so the formulation holds
        state = tx.init(stream[0])
        out = []
        for g in stream:
            u, state = update(g, state)
            out.append((u, state))
    return out


@pytest.mark.parametrize(
    "label",
    ["sidco-e", "sidco-p", "sidco-gp", "sidco-e paper", "dgc", "redsync", "gaussiank"],
)
@pytest.mark.parametrize("kind", ["t", "ties", "equal"])
def test_the_accelerators_payloads_give_the_cpus_updates(rng, label, kind):
    name, *adaptation = label.split()
    options = {"adaptation": adaptation[0]} if adaptation else {}
    tx = sidco.compressor(name, 0.01, **options)
    stream = _gradients(rng, 6, [(70, 300), (5000,), (129,)], kind)
    words, blocks = _run(tx, stream, "words"), _run(tx, stream, "blocks")
    for (u1, s1), (u2, s2) in zip(words, blocks, strict=True):
        jax.tree.map(np.testing.assert_array_equal, (u1, s1), (u2, s2))


@pytest.mark.parametrize("sizes", [[1], [127, 129], [5000, 1, 20000], [40000]])
@pytest.mark.parametrize("k", [1, 7, 300])
def test_top_by_count_is_the_same_in_both_formulations(rng, sizes, k):
    vectors = [jnp.asarray(np.round(rng.standard_t(3, size=s)).astype(np.float32)) for s in sizes]
    k = min(k, sum(sizes))
    got = {}
    for formulation in ("words", "blocks"):
        with passes.formulation(formulation):
            got[formulation] = jax.jit(lambda v: payload_lib.top_by_count(v, k))(vectors)
    jax.tree.map(np.testing.assert_array_equal, got["words"], got["blocks"])
    # And the oracle: top-k's entries (ties to the lower index), in index order.
    x = np.concatenate([np.asarray(v) for v in vectors])
    want = np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
    np.testing.assert_array_equal(np.asarray(got["blocks"][0].indices), want)

