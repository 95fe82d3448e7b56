"""The CNN example: a tiny end-to-end run of its trainer, compared against dense."""

import json

import numpy as np
import pytest

from examples.cnn import main


@pytest.mark.slow
def test_tiny_config_trains_with_sidco_and_dense_and_writes_its_report(tmp_path, capsys):
    histories = main.main(["--config", "tiny", "--workdir", str(tmp_path)])
    assert [h.compressor for h in histories] == ["sidco-e", "dense"]
    sidco_run, dense_run = histories
    for h in histories:
        assert h.steps == [1, 2, 3, 4] and np.all(np.isfinite(h.loss))
        assert h.eval_steps == [2, 4] and all(0.0 <= a <= 1.0 for a in h.evals)
    assert 0 < sidco_run.bytes_per_step < dense_run.bytes_per_step / 5
    assert dense_run.bytes_per_step >= 4 * dense_run.parameters  # a dense all-reduce
    record = json.loads((tmp_path / "results.json").read_text())
    assert record["metric"] == "accuracy" and len(record["runs"]) == 2
    summary = (tmp_path / "summary.md").read_text()
    assert "| sidco-e |" in summary and "| test accuracy |" in summary
    for name in ("loss", "accuracy", "density"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.rstrip().endswith(f"density.png to {tmp_path.resolve()}")
    with np.load(tmp_path / "gradients_sidco-e.npz") as archive:  # closed: no ResourceWarning
        captured = dict(archive)
    assert sorted(captured) == ["grad_step1", "grad_step4", "u_step1", "u_step4"]
    assert captured["grad_step4"].shape == (sidco_run.parameters,)
    np.testing.assert_array_equal(captured["u_step1"], captured["grad_step1"])  # no residual yet
    assert not np.array_equal(captured["u_step4"], captured["grad_step4"])
