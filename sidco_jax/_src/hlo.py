"""What a compiled step communicates, read from its optimized HLO.

The bytes a compressor claims to save are only real if the collectives XLA
emits are small. :func:`collectives` lists every cross-device collective of a
compiled computation with the bytes of its operand (what one device puts in)
and of its result (what one device gets back), so a test or a benchmark can
check the claim instead of trusting a formula.
"""

import math
import re
from typing import Any, NamedTuple

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEM_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# "%name = <result type> <kind>(", the result type being an array or a tuple of arrays.
_OP = re.compile(r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(" + "|".join(KINDS) + r")\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_COMMENT = re.compile(r"/\*.*?\*/")  # long tuples carry /*index=5*/ markers


class Collective(NamedTuple):
    """One collective of a compiled computation.

    Attributes:
      kind: the HLO op (``"all-gather"``, ``"all-reduce"``, ...).
      operand_bytes: bytes one device contributes.
      result_bytes: bytes one device receives as the result.
      group_size: devices taking part.
    """

    kind: str
    operand_bytes: int
    result_bytes: int
    group_size: int


def _bytes(result_type: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(result_type):
        if dtype in _ITEM_BYTES:
            total += _ITEM_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collectives(compiled: Any) -> list[Collective]:
    """The cross-device collectives of a compiled computation.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.

    Returns:
      One :class:`Collective` per synchronous collective op, in program
      order (what XLA's CPU backend emits; asynchronous ``-start``/``-done``
      pairs, as on GPU, are not read).

    Examples:
      >>> import jax, jax.numpy as jnp, sidco_jax as sidco
      >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
      >>> x = jnp.zeros((1, 1000))
      >>> [(c.kind, c.operand_bytes) for c in sidco.hlo.collectives(f.lower(x).compile())]
      [('all-reduce', 4000)]
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    found = []
    for line in text.splitlines():
        line = _COMMENT.sub("", line)
        match = _OP.search(line)
        if match is None:
            continue
        result_type, kind = match.groups()
        groups = _GROUPS.search(line)
        size = len(groups.group(1).split(",")) if groups and groups.group(1) else 1
        result = _bytes(result_type)
        operand = {"all-gather": result // size, "reduce-scatter": result * size}.get(kind, result)
        found.append(Collective(kind, operand, result, size))
    return found


_LAUNCH = re.compile(r"^\s*%?\S+\s*=\s*.*?\s(fusion|while|sort|custom-call)\(")
LAUNCH_KINDS = ("fusion", "while", "sort", "custom-call")


def launches(compiled: Any) -> dict[str, int]:
    """Counts the ops of an optimized HLO module that each launch a kernel on a GPU.

    Fusions, while loops, sorts and custom calls, in every computation (a
    loop's body counts once). XLA:CPU fuses differently from XLA:GPU, so on
    the CPU this is a proxy, but one that grows as the GPU's count grows.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.

    Returns:
      ``{kind: count}`` for each of :data:`LAUNCH_KINDS`.
    """
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    counts = dict.fromkeys(LAUNCH_KINDS, 0)
    for line in text.splitlines():
        match = _LAUNCH.match(line.split(", metadata=")[0])
        if match:
            counts[match.group(1)] += 1
    return counts
