"""The code on the docs pages runs as written, and their lists of compressors are the registry's."""

import pathlib
import re

import pytest

import sidco_jax as sidco

DOCS = pathlib.Path(__file__).parent.parent / "docs"


@pytest.mark.slow
def test_multi_device_page_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "distributed.md").read_text(), flags=re.S)
    assert len(blocks) == 7
    namespace = {}
    for block in blocks:
        exec(block, namespace)
    printed = capsys.readouterr().out.split("\n")
    density, shape, message = printed[:3]
    assert printed[3] == "P('local', None) 1.0"  # sharded parameters: the loss at zero weights
    assert 0.005 < float(density) < 0.02  # ratio 0.01, averaged over devices
    assert shape == "(8, 100)"
    assert float(message) == 3 * 8  # hierarchical: a quarter of 1000 entries, 3 slots, "sparse"
    weights = namespace["weights"]
    assert 0 < int((weights != 0).sum()) <= 2 * 10
    restored, params = namespace["restored"], namespace["params"]
    assert (restored["params"]["w"] == params["w"]).all()


@pytest.mark.slow
def test_the_outer_steps_page_runs(capsys):
    (block,) = re.findall(r"```python\n(.*?)```", (DOCS / "outer.md").read_text(), flags=re.S)
    exec(block, {})
    assert capsys.readouterr().out.split() == ["16", "True"]  # 16 steps, the loss went down


def test_the_flax_nnx_example_trains(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "optax.md").read_text(), flags=re.S)
    (block,) = [b for b in blocks if "nnx.Optimizer" in b]
    exec(block, {})
    assert capsys.readouterr().out.split() == ["True"]  # the loss went down


def test_the_custom_rule_example_is_a_working_compressor(rng):
    import jax
    import numpy as np

    (block,) = re.findall(r"```python\n(.*?)```", (DOCS / "api.md").read_text(), flags=re.S)
    namespace = {}
    exec(block, namespace)
    tx = namespace["above_mean_multiple"](0.05, multiple=2.0)
    grads = {
        "w": rng.standard_t(3, size=(30, 20)).astype(np.float32),
        "b": rng.normal(size=77).astype(np.float32),
    }
    sent, state = jax.jit(tx.update)(grads, tx.init(grads))
    flat = np.concatenate([grads["b"], grads["w"].ravel()])  # jax.tree.leaves order
    eta = 2.0 * np.abs(flat).mean()
    want = np.where(np.abs(flat) > eta, flat, 0)[: flat.size]
    kept = np.flatnonzero(want)[: int(np.ceil(0.05 * flat.size))]  # capacity: first in order
    want = np.zeros_like(flat)
    want[kept] = flat[kept]
    got = np.concatenate([np.asarray(sent["b"]), np.asarray(sent["w"]).ravel()])
    np.testing.assert_allclose(got, want, rtol=0, atol=0)
    residual = np.concatenate([np.ravel(state.residual["b"]), np.ravel(state.residual["w"])])
    np.testing.assert_array_equal(got + residual, flat)


def test_every_list_of_all_compressors_is_the_registrys():
    # Prose cannot import the registry: where a page names every compressor, it names
    # exactly sidco.COMPRESSORS (a new one added there must be added here too).
    names = "|".join(map(re.escape, sidco.COMPRESSORS))
    found = 0
    for page in sorted(DOCS.glob("*.md")):
        for paragraph in page.read_text().split("\n\n"):
            listed = set(re.findall(rf'[`"]({names})[`"]', paragraph))
            if len(listed) >= len(sidco.COMPRESSORS) - 1:  # a list of (nearly) all of them
                assert listed == set(sidco.COMPRESSORS), (page.name, paragraph[:200])
                found += 1
    assert found >= 3
    # The network benchmark keeps its list without importing JAX: every one but randomk
    # (it does not converge) and approxk (on the CPU it is top-k).
    from benchmarks import network

    assert set(network.COMPRESSORS) == set(sidco.COMPRESSORS) - {"randomk", "approxk"}
