"""The code on the multi-device docs page runs as written."""

import pathlib
import re

DOCS = pathlib.Path(__file__).parent.parent / "docs"


def test_multi_device_page_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "distributed.md").read_text(), flags=re.S)
    assert len(blocks) == 4
    namespace = {}
    for block in blocks:
        exec(block, namespace)
    density, shape = capsys.readouterr().out.split("\n")[:2]
    assert 0.005 < float(density) < 0.02  # ratio 0.01, averaged over devices
    assert shape == "(8, 100)"
    restored, params = namespace["restored"], namespace["params"]
    assert (restored["params"]["w"] == params["w"]).all()
