"""The README's quickstart runs as written and shows what it claims."""

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_quickstart_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python block"
    namespace = {}
    for block in blocks:
        exec(block, namespace)
    selected, count, overflow = map(int, capsys.readouterr().out.split())
    assert count + overflow == selected and overflow == 0
    grad, residual = np.asarray(namespace["grad"]), np.asarray(namespace["residual"])
    sent = grad - residual
    assert np.count_nonzero(sent) == count
    assert 0.5 < count / (0.001 * grad.size) < 1.5
    metrics = namespace["metrics"]
    sent = np.count_nonzero(namespace["updates"]["w"])
    assert float(metrics["density"]) == pytest.approx(sent / grad.size)
    assert 0.5 < float(metrics["density"]) / 0.001 < 2
