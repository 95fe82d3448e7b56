"""The README's snippets each run on their own, as written, and show what they claim."""

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def run_alone(index: int) -> dict:
    """Runs block ``index`` in a fresh namespace, as a reader pasting only it would."""
    namespace = {}
    exec(BLOCKS[index], namespace)
    return namespace


def test_the_readme_has_two_python_snippets():
    assert len(BLOCKS) == 2


def test_threshold_and_payload_snippet(capsys):
    namespace = run_alone(0)
    selected, count, overflow = map(int, capsys.readouterr().out.split())
    assert count + overflow == selected and overflow == 0
    grad, residual = np.asarray(namespace["grad"]), np.asarray(namespace["residual"])
    sent = grad - residual
    assert np.count_nonzero(sent) == count
    assert 0.5 < count / (0.001 * grad.size) < 1.5


def test_optax_snippet():
    namespace = run_alone(1)
    grad, metrics = np.asarray(namespace["grad"]), namespace["metrics"]
    sent = np.count_nonzero(namespace["updates"]["w"])
    assert float(metrics["density"]) == pytest.approx(sent / grad.size)
    assert 0.5 < float(metrics["density"]) / 0.001 < 2
