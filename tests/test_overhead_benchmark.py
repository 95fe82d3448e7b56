"""benchmarks/overhead.py runs every mode on small inputs and reports what it claims."""

import json
import pathlib

import pytest

pytestmark = pytest.mark.slow  # -m 'not slow' leaves this file out of a quick run

ROOT = pathlib.Path(__file__).parent.parent


@pytest.fixture(scope="module")
def overhead():
    from benchmarks import overhead

    return overhead


def check(rows, path):
    saved = json.loads(path.read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    for row in rows:
        for t in row["ms"].values():
            assert 0 < t["p25"] <= t["median"] <= t["p75"]


def test_updates_on_a_tree_and_its_flat_copy(overhead, tmp_path):
    path = tmp_path / "u.json"
    rows = overhead.main(["updates", "--source", "lm:tiny", "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert [r["source"] for r in rows] == ["lm:tiny (tree)", "lm:tiny (one flat leaf)"]
    for row in rows:
        names = set(row["ms"])
        fill = {"sidco-e fill", "sidco-p fill"}
        assert {"one pass", "sidco-e threshold+payload"} | set(
            overhead.sidco.COMPRESSORS
        ) | fill == names
        assert row["ms"]["topk"]["/ base"] == 1.0 and row["ms"]["one pass"]["/ one pass"] == 1.0
        # The temporary bytes of an update are measured, and finite, for every compressor.
        assert set(row["temp"]) == set(overhead.sidco.COMPRESSORS) | fill
        assert all(0 <= v < 10 for v in row["temp"].values())


def test_phases_kernels_step_and_axis(overhead, tmp_path):
    path = tmp_path / "p.json"
    rows = overhead.main(["phases", "--source", "flat:12", "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert [k for k in rows[0]["ms"] if k[0].isdigit()] == [
        "1 error-feedback add + first pass",
        "2 threshold",
        "3 payload",
        "4 aggregation (local densify)",
        "5 write-back",
    ]
    rows = overhead.main(["kernels", "--sizes", "12", "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert {"one pass", "top_k", "sidco-e M=3", "sidco-gp M=1"} <= set(rows[0]["ms"])
    argv = ["step", "--source", "cnn:tiny", "--compressors", "dense", "sidco-e"]
    rows = overhead.main([*argv, "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert set(rows[0]["ms"]) == {"gradient alone", "dense", "sidco-e"}
    argv = ["axis", "--source", "flat:12", "--compressors", "sidco-e", "topk"]
    rows = overhead.main([*argv, "--repeats", "2", "--json", str(path)])
    check(rows, path)
    assert set(rows[0]["ms"]) == {
        f"{c} {how}" for c in ("sidco-e", "topk", "dense") for how in ("shard_map", "pmap")
    }
