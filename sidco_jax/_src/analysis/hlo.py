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

import jax
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_ITEM_BYTES |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# "%name = <result type> <kind>(", the result type being an array or a tuple of arrays.
_OP = re.compile(r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(" + "|".join(KINDS) + r")(-start)?\(")
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{(\{[0-9,{}]*\})\}")
# The iota form: G groups of S devices from iota(dims), transposed by perm, then cut.
_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_COMMENT = re.compile(r"/\*.*?\*/")  # long tuples carry /*index=5*/ markers


class Collective(NamedTuple):
    """One collective of a compiled computation.

    Attributes:
      kind: the HLO op (``"all-gather"``, ``"all-reduce"``, ...).
      operand_bytes: bytes one device contributes.
      result_bytes: bytes one device receives as the result.
      group_size: devices taking part (0 where the program does not say:
        a transfer between TPU slices).
      between_slices: whether it crosses the data-center network between TPU
        slices (a multi-slice program sends those as host transfers).
      groups: the device ids of each group that runs it together (empty
        where the program does not say).
    """

    kind: str
    operand_bytes: int
    result_bytes: int
    group_size: int
    between_slices: bool = False
    groups: tuple[tuple[int, ...], ...] = ()


def _bytes(result_type: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(result_type):
        if dtype in _ITEM_BYTES:
            total += _ITEM_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _text(compiled: Any) -> str:
    """The optimized HLO of a compiled program (or the text itself), refusing anything else."""
    if isinstance(compiled, str):
        return compiled
    if isinstance(compiled, jax.stages.Lowered):
        raise TypeError(
            "give the compiled program, jax.jit(f).lower(...).compile(), not the lowered one: "
            "collectives and kernels are read from the optimized HLO, which a lowered program "
            "does not have yet"
        )
    if not isinstance(compiled, jax.stages.Compiled):
        raise TypeError(
            "compiled must be jax.jit(f).lower(...).compile() or its as_text(), got "
            f"{type(compiled).__name__}"
        )
    return compiled.as_text()


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    """The device groups of one collective's ``replica_groups``, in either form."""
    explicit = _GROUPS.search(line)
    if explicit:
        rows = re.findall(r"\{([0-9,]*)\}", explicit.group(1))
        return tuple(tuple(int(d) for d in row.split(",") if d) for row in rows if row)
    iota = _IOTA.search(line)
    if iota is None:
        return ()
    count, size, dims, perm = iota.groups()
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = ids.transpose([int(p) for p in perm.split(",")])
    return tuple(tuple(int(d) for d in row) for row in ids.reshape(int(count), int(size)))


def collectives(compiled: Any) -> list[Collective]:
    """The cross-device collectives of a compiled computation.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.

    Returns:
      One :class:`Collective` per collective op, in program order; an
      asynchronous ``-start``/``-done`` pair (GPU, TPU) once, read from its
      ``-start`` (whose result tuple holds the operand and the result: the
      result's bytes are the last array's).

    Examples:
      >>> import jax, jax.numpy as jnp, sidco_jax as sidco
      >>> f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
      >>> x = jnp.zeros((1, 1000))
      >>> [(c.kind, c.operand_bytes) for c in sidco.hlo.collectives(f.lower(x).compile())]
      [('all-reduce', 4000)]
    """
    text = _text(compiled)
    found = []
    for line in text.splitlines():
        line = _COMMENT.sub("", line)
        match = _OP.search(line)
        if match is None:
            continue
        result_type, kind, start = match.groups()
        groups = _groups(line)
        size = len(groups[0]) if groups else 1
        arrays = _ARRAY.findall(result_type)
        if start and kind != "all-reduce" and len(arrays) > 1:  # (operand, result, ...)
            result_type = "{}[{}]".format(*arrays[1])
        result = _bytes(result_type)
        operand = {"all-gather": result // size, "reduce-scatter": result * size}.get(kind, result)
        found.append(Collective(kind, operand, result, size, groups=groups))
    return found + _between_slices(text)


# Multi-slice TPU programs send what crosses slices through the runtime: a send and a
# recv per collective, named by a rendezvous and tagged with the collective's kind.
_TRANSFER = re.compile(r"=\s*\(([a-z0-9]+\[[0-9,]*\])[^=]*?\s(send|recv)\(")
_TAG = re.compile(r'_xla_host_transfer_rendezvous="([^"]+)".*_xla_megascale_transfer_type="(\w+)"')


def _between_slices(text: str) -> list[Collective]:
    """The collectives of a multi-slice TPU program that cross slices, from its sends and
    recvs (the data each device sends, and what it gets back)."""
    sent, got, kinds = {}, {}, {}
    for line in text.splitlines():
        transfer, tag = _TRANSFER.search(line), _TAG.search(line)
        if transfer is None or tag is None:
            continue
        array, op = transfer.groups()
        rendezvous, kind = tag.groups()
        kinds[rendezvous] = kind.lower().replace("_", "-")
        (sent if op == "send" else got)[rendezvous] = _bytes(array)
    return [
        Collective(kinds[r], sent[r], got.get(r, 0), 0, between_slices=True) for r in sorted(sent)
    ]


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
    text = _text(compiled)
    counts = dict.fromkeys(LAUNCH_KINDS, 0)
    for line in text.splitlines():
        match = _LAUNCH.match(line.split(", metadata=")[0])
        if match:
            counts[match.group(1)] += 1
    return counts


# Ops that launch nothing: values already in place, views, and the second half
# of an asynchronous pair (its ``-start`` is the launch).
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "iota",
}
# Custom calls that annotate the program for the compiler and run nothing.
ANNOTATIONS = ("AssumeGatherIndicesInBound", "ConcatBitcast", "Sharding", "SPMDFullToShardShape")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_CALLED = re.compile(r"(body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations=\{|true_computation=|false_computation=)([^}]*)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


class Kernels(NamedTuple):
    """The kernels a compiled program runs, counted along its paths.

    A while loop counts its body and condition once; a conditional counts its
    largest branch on the longest path and its smallest on the cheapest.

    Attributes:
      longest: kernels on the longest path.
      cheapest: kernels on the cheapest path.
      sorts: sort ops anywhere in the program.
      loops: while loops anywhere in the program.
      largest_sort: entries of the widest sort's first operand (0 without one).
    """

    longest: int
    cheapest: int
    sorts: int
    loops: int
    largest_sort: int


def _computations(text: str) -> tuple[dict[str, list[tuple[str, str, str]]], str]:
    """``{name: [(result type, op, rest of line)]}`` and the entry computation's name."""
    found, entry, current = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = found.setdefault(header.group(2), [])
            if header.group(1):
                entry = header.group(2)
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None:
            match = _INSTRUCTION.match(_COMMENT.sub("", line.split(", metadata=")[0]))
            if match:
                current.append(match.groups())
    return found, entry


def _is_kernel(result_type: str, op: str, rest: str) -> bool:
    """Whether one instruction runs as a kernel of its own."""
    if op in _FREE or op.endswith("-done") or op in ("while", "conditional", "call"):
        return False
    if op == "custom-call":
        target = _TARGET.search(rest)
        return not (target and target.group(1) in ANNOTATIONS)
    if op in ("fusion", "sort") or op.startswith(KINDS):
        return True
    # Unfused glue on scalars and one-entry arrays (a TPU's scalar unit, folded into
    # launches on a GPU), copies of them included, is not a kernel.
    return any(
        math.prod(int(d) for d in dims.split(",") if d) > 1
        for _, dims in _ARRAY.findall(result_type)
    )


def kernels(compiled: Any) -> Kernels:
    """Counts the kernels of an optimized HLO module (CPU, GPU or TPU) along its paths.

    Fusions, sorts, copies, collectives (an asynchronous ``-start``/``-done``
    pair once), custom calls other than the compiler's annotations, and any
    other unfused op on arrays count one each; a fusion's inside does not.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()``, or its ``as_text()``.

    Returns:
      A :class:`Kernels`.
    """
    text = _text(compiled)
    computations, entry = _computations(text)
    memo: dict[tuple[str, bool], int] = {}

    def count(name: str, longest: bool) -> int:
        if (name, longest) in memo:
            return memo[name, longest]
        total = 0
        for result_type, op, rest in computations.get(name, []):
            if op == "conditional":
                names = [
                    n.strip().lstrip("%") for n in ",".join(_BRANCHES.findall(rest)).split(",")
                ]
                sizes = [count(n, longest) for n in names if n]
                total += (max if longest else min)(sizes) if sizes else 0
            elif op in ("while", "call"):
                total += sum(count(c, longest) for _, c in _CALLED.findall(rest))
            else:
                total += _is_kernel(result_type, op, rest)
        memo[name, longest] = total
        return total

    ops = [(t, op, rest) for body in computations.values() for t, op, rest in body]
    sorts = [_ARRAY.search(t) for t, op, _ in ops if op == "sort"]
    widest = max(
        (math.prod(int(d) for d in m.group(2).split(",") if d) for m in sorts if m), default=0
    )
    loops = sum(op == "while" for _, op, _ in ops)
    return Kernels(count(entry, True), count(entry, False), len(sorts), loops, widest)
