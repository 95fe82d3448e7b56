"""The compressors under XLA's default code generation, beside the suite's own flags.

``conftest.py`` compiles the suite with LLVM's cheaper pipeline and XLA's
legacy CPU fusion emitters, which users do not get. Here a fresh process with
XLA's defaults runs every compressor, and must produce what the suite's
process produces, bit for bit: the harness's gradients are multiples of 1/64,
so the values sent and kept are exact sums in either, and the selection must
not depend on the machine code. Un-jitted ``sidco.accumulate`` must equal
``optax.MultiSteps`` there too: XLA's defaults fuse multiply-adds that the
suite's flags leave alone.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).parent
STEPS = 3
SPREAD = 2  # devices of the shard_map run


def every_compressor_run() -> dict[str, np.ndarray]:
    """Every compressor's updates and residuals over ``STEPS`` steps.

    Each compressor runs locally; SIDCo-E runs under ``shard_map`` on 2 devices as well.
    """
    from harness import AXIS, gradient_stream, run_local, run_shard_map

    import sidco_jax as sidco

    stream = gradient_stream(np.random.default_rng(7), STEPS)
    runs = {name: run_local(sidco.compressor(name, 0.05), stream) for name in sidco.COMPRESSORS}
    tx = sidco.compress(0.05, axis_name=AXIS)
    updates, states, _ = run_shard_map(tx, stream, devices=SPREAD)
    runs["sidco-e over 2 devices"] = updates, states
    out = {}
    for name, (updates, states) in runs.items():
        for i, (update, state) in enumerate(zip(updates, states, strict=True)):
            for part, tree in (("update", update), ("residual", state.residual)):
                for key, leaf in (tree or {}).items():  # dense() keeps no residual
                    out[f"{name} step {i} {part} {key}"] = np.asarray(leaf)
    return out


def under_xla_defaults(statement: str) -> None:
    """Runs ``statement`` in a fresh process with XLA's defaults, this directory importable."""
    script = f"import sys; sys.path.insert(0, {str(HERE)!r}); {statement}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={SPREAD}",
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fusion_emitters" in os.environ["XLA_FLAGS"]  # this process: the suite's flags


def test_xla_defaults_send_and_keep_what_the_suites_flags_do(tmp_path):
    saved = tmp_path / "defaults.npz"
    under_xla_defaults(
        "import numpy as np; from test_default_codegen import every_compressor_run as run;"
        f"np.savez({str(saved)!r}, **run())"
    )
    ours = every_compressor_run()
    with np.load(saved) as defaults:
        assert sorted(defaults.files) == sorted(ours)
        for key, value in ours.items():
            np.testing.assert_array_equal(defaults[key], value, err_msg=key)
    # Not vacuous: on its last step every compressor sent something, and kept something
    # wherever it keeps a residual.
    for name in {key.split(" step ")[0] for key in ours}:
        for part in ("update",) if name == "dense" else ("update", "residual"):
            last = [v for k, v in ours.items() if k.startswith(f"{name} step {STEPS - 1} {part}")]
            assert any(map(np.count_nonzero, last)), f"{name}: no {part}"


def test_xla_defaults_un_jitted_accumulate_equals_multisteps():
    # Defect: un-jitted, accumulate's running mean acc + (g - acc) / (i + 1) ran op by op,
    # rounded twice, where MultiSteps' compiled branch fuses one multiply-add (XLA
    # multiplies by 1 / (i + 1)): a unit in the last place apart, which the momentum and
    # the next selections carried on. The suite's own flags do not fuse it: both agreed.
    under_xla_defaults("from test_accumulate import un_jitted_against_multisteps as run; run()")
