"""The LM example: a tiny end-to-end run on a text file, reporting validation perplexity."""

import json
import pathlib

import numpy as np
import pytest

from examples.lm import main

ENGLISH = pathlib.Path(__file__).parents[2] / "docs" / "algorithm.md"  # real English prose


@pytest.mark.slow
def test_tiny_config_trains_on_a_text_file_and_reports_validation_perplexity(tmp_path):
    histories = main.main(["--config", "tiny", "--workdir", str(tmp_path), "--text", str(ENGLISH)])
    vocab = len(set(ENGLISH.read_text(encoding="utf-8")[:20_000]))
    for h in histories:
        assert h.eval_steps == [3]
        assert 1.0 < h.evals[0] < 2 * vocab  # near-uniform at the start: about the vocabulary size
    assert histories[0].bytes_per_step < histories[1].bytes_per_step / 5
    assert json.loads((tmp_path / "results.json").read_text())["metric"] == "perplexity"
    summary = (tmp_path / "summary.md").read_text()
    assert "| validation perplexity |" in summary and "test" not in summary.split("\n")[0]
    assert (tmp_path / "perplexity.png").is_file()
    with np.load(tmp_path / "gradients_sidco-e.npz") as captured:
        assert captured["grad_step2"].size == histories[0].parameters


@pytest.mark.slow
def test_a_tiny_transformer_holds_a_quarter_of_its_state_with_sharded_parameters(tmp_path):
    tiny = ["--config", "tiny", "--model", "transformer", "--embed", "16", "--heads", "2"]
    tiny += ["--nodes", "2", "--capture-steps", "--text", str(ENGLISH)]
    sharded = main.main([*tiny, "--shard-params", "--workdir", str(tmp_path / "sharded")])
    whole = main.main([*tiny, "--workdir", str(tmp_path / "whole")])
    vocab = len(set(ENGLISH.read_text(encoding="utf-8")[:20_000]))
    for h in sharded:
        assert 1.0 < h.evals[0] < 2 * vocab
    # Parameters and momentum a quarter each; SIDCo's residual is a quarter with or without.
    for mine, theirs in zip(sharded, whole, strict=True):
        assert mine.parameters == theirs.parameters
        assert mine.state_bytes < 0.4 * theirs.state_bytes, (mine.compressor, mine, theirs)
    assert sharded[0].bytes_per_step < sharded[1].bytes_per_step / 5


@pytest.mark.slow
def test_a_tiny_transformer_takes_outer_steps_with_sharded_parameters(tmp_path):
    tiny = ["--config", "tiny", "--model", "transformer", "--embed", "16", "--heads", "2"]
    tiny += ["--nodes", "2", "--shard-params", "--outer-every", "2", "--capture-steps"]
    flags = ["--compressors", "sidco-e", "--text", str(ENGLISH), "--workdir", str(tmp_path)]
    [history] = main.main([*tiny, *flags])
    vocab = len(set(ENGLISH.read_text(encoding="utf-8")[:20_000]))
    assert 1.0 < history.evals[0] < 2 * vocab
    assert history.bytes_per_step > 0 and np.all(np.isfinite(history.loss))
