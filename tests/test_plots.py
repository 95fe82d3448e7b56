"""benchmarks/plots.py draws the benchmark page's plots from the benchmarks' JSON."""

import json

import pytest

pytest.importorskip("matplotlib")


def tree_row(tree, leaves, ratio):
    def times(median):
        return {"median": median, "p25": 0.9 * median, "p75": 1.1 * median}

    return {
        "tree": tree,
        "leaves": leaves,
        "entries": 1000,
        "ratio": ratio,
        "ms": {
            "one pass": times(1.0),
            "sidco-e [tree]": times(5.0),
            "topk [tree]": times(40.0),
            "dense [tree]": times(2.0),
        },
    }


def test_trees_updates_plot_from_its_json(tmp_path):
    from benchmarks import plots

    results = tmp_path / "results"
    results.mkdir()
    record = {
        "meta": {"cpu": "test CPU", "cores": 2, "jax": "0", "backend": "cpu"},
        "rows": [tree_row("resnet50", 161, 0.001), tree_row("lstm", 6, 0.001)],
    }
    (results / "trees_updates.json").write_text(json.dumps(record))
    written = plots.main(["--results", str(results), "--out", str(tmp_path / "img")])
    assert written == [tmp_path / "img" / "trees_updates.png"]  # the other files are absent
    assert written[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
