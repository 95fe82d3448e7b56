"""The private families import one way: each only those below it (docs/design.md)."""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parent.parent / "sidco_jax" / "_src"
# From the bottom; base.py holds what all of them share.
ORDER = ["base", "ops", "stats", "analysis", "loop", "rules", "wrappers", "parallel", "checkpoint"]


def _family(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC).parts
    return parts[0] if len(parts) > 1 else path.stem


def _imported_families(path: pathlib.Path) -> set[str]:
    """The families a module imports at run time (not under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and id(node) not in typing_only:
            module = node.module or ""
            if module.startswith("sidco_jax._src."):
                found.add(module.split(".")[2])
    return found


def test_every_module_belongs_to_a_family():
    modules = [p for p in SRC.rglob("*.py") if p.name != "__init__.py"]
    assert {_family(p) for p in modules} == set(ORDER)


@pytest.mark.parametrize("family", ORDER)
def test_a_family_imports_only_those_below_it(family):
    below = set(ORDER[: ORDER.index(family)])
    for path in SRC.rglob("*.py"):
        if _family(path) == family:
            upward = _imported_families(path) - below - {family}
            assert not upward, f"{path.relative_to(SRC)} imports {sorted(upward)}, above {family}"
