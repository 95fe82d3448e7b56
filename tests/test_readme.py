"""The README's snippets each run on their own, as written, and show what they claim."""

import math
import pathlib
import re

import numpy as np
import pytest

import sidco_jax as sidco

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def run_alone(index: int) -> dict:
    """Runs block ``index`` in a fresh namespace, as a reader pasting only it would."""
    namespace = {}
    exec(BLOCKS[index], namespace)
    return namespace


def test_quickstart_sends_the_target_density():
    namespace = run_alone(0)
    size, metrics = namespace["grads"]["w"].size, namespace["metrics"]
    sent = np.count_nonzero(namespace["updates"]["w"])
    assert float(metrics["density"]) == pytest.approx(sent / size)
    assert sent == sidco.capacity(size, 0.001)  # the default fills the payload


def test_the_multi_device_step_trains_and_sends_one_payload(capsys):
    namespace = run_alone(1)
    loss, sent_bytes = capsys.readouterr().out.split()
    assert math.isfinite(float(loss)) and float(loss) < 1.0  # from 1.0 at w = 0
    size = namespace["params"]["w"].size
    assert int(sent_bytes) == sidco.capacity(size, 0.01) * 8  # float32 value + int32 index
