"""What the benchmarks share: compressors by row label, the timing loop, and the record of a run.

Every timing benchmark calls its methods in one process on the same arrays,
round-robin within each repetition, so that machine noise hits all alike
(:func:`measure`), and reports medians with their interquartile range
(:func:`quartiles`). Every result file holds what ran it (:func:`meta`: the
command, jax, the backend and the host's processor) beside its rows
(:func:`write`).
"""

import ast
import json
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import sidco_jax as sidco
from benchmarks import host

# SIDCo-E/P with the paper's stage adaptation (docs/optax.md), beside the registry's
# compressors, which keep the default adaptation ("fill").
PAPER = {f"{name} paper": name for name in ("sidco-e", "sidco-p")}
LABELS = (*sidco.COMPRESSORS, *PAPER)


def parse_label(label: str) -> tuple[str, dict]:
    """``"sidco-e:values=int8,indices=chunked"`` -> ``("sidco-e", {...})``: a name, its options."""
    name, _, rest = label.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[key] = value
    return name, options


def compressor(label: str, ratio: float, **options) -> optax.GradientTransformation:
    """The compressor a row label names: a name of :data:`LABELS`, options after a colon."""
    name, given = parse_label(label)
    if name in PAPER:
        return sidco.compressor(PAPER[name], ratio, adaptation="paper", **given, **options)
    return sidco.compressor(name, ratio, **given, **options)


def measure(fns: dict[str, Callable], args: tuple, repeats: int) -> dict[str, dict]:
    """Milliseconds of each ``fn(*args)``, round-robin over ``repeats`` rounds after a warm-up.

    Returns, per name, the :func:`quartiles` of the timed calls and ``first``, the
    warm-up call (its compilation included).
    """
    first = {}
    for name, f in fns.items():
        f_args = own_arguments(f, args)
        start = time.perf_counter()
        jax.block_until_ready(f(*f_args))
        first[name] = (time.perf_counter() - start) * 1e3
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            f_args = own_arguments(f, args)
            start = time.perf_counter()
            jax.block_until_ready(f(*f_args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {**quartiles(t), "first": first[name]} for name, t in times.items()}


def quartiles(times: list[float]) -> dict[str, float]:
    """The median and the interquartile range of ``times``."""
    p25, median, p75 = np.percentile(times, [25, 50, 75])
    return {"median": float(median), "p25": float(p25), "p75": float(p75)}


def own_arguments(f, args: tuple) -> tuple:
    """``args``, or fresh copies of them, made before the timer starts, for a call that
    donates them (``f.donates``): a donated buffer is gone after the call."""
    if getattr(f, "donates", False):
        return jax.block_until_ready(jax.tree.map(jnp.copy, args))
    return args


def meta(module: str, argv: list[str] | None, **more) -> dict:
    """What ran a benchmark: its command line, jax, the backend, the host, and ``more``."""
    command = ["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]
    return {
        "command": shlex.join(command),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        **host.describe(),
        **more,
    }


def write(path: Path, record) -> Path:
    """Writes ``record`` as JSON to ``path`` (its folder made if missing); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return path
