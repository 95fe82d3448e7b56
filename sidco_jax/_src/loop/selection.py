"""The select phase: the rule chooses what to send, and the choices become one payload.

With ``granularity="model"`` the rule sees every part at once; with ``"leaf"``
each leaf (then a part of its own) on its own, and the per-leaf payloads are
merged into one message. A step on which the rule selected nothing, though
there was something to send, is filled with the largest magnitudes, and every
sent value is rounded to its leaf's dtype so that the residual keeps the
rounding.
"""

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidco_jax._src.base import SLOT_BYTES, VALUE_BYTES
from sidco_jax._src.loop.rule import Rule, Selection
from sidco_jax._src.ops import payload as payload_lib


class Chosen(NamedTuple):
    """What the select phase hands on.

    Attributes:
      payload: one payload over all parts, values rounded to their leaves'
        dtypes; None sends every entry.
      thresholds: float32 threshold (one per floating-point leaf with
        ``granularity="leaf"``, 0 for zero-size ones).
      bytes: static bytes of the sparse message.
      shared: whether the indices are the same on every device.
    """

    payload: payload_lib.Payload | None
    thresholds: jax.Array
    bytes: int
    shared: bool


def everything(vectors, abs_sums, state, key) -> Selection:
    """The :class:`~sidco_jax.typing.SelectFn` of no compression: every entry is sent."""
    del abs_sums, state, key
    return Selection(None, jnp.zeros((), jnp.float32), VALUE_BYTES * sum(v.size for v in vectors))


def every_entry(vectors: Sequence[jax.Array]) -> Selection:
    """What a rule asked for every entry sends (``k = n``: ratio 1, or a single entry).

    A threshold estimated from the data (a sample's smallest magnitude, a
    bisection, a normal quantile) leaves the entries at or below it behind:
    at ``k = n`` a rule returns this instead, a payload of all ``n`` entries
    in index order (zeros included), so that it sends the dense mean and
    leaves nothing in the residual. Decided at trace time, so a rule's
    ordinary path is untouched.
    """
    n = sum(v.shape[0] for v in vectors)
    values = jnp.concatenate(vectors) if len(vectors) > 1 else vectors[0]
    count = jnp.int32(n)
    payload = payload_lib.Payload(values, jnp.arange(n, dtype=jnp.int32), count, count)
    return Selection(payload, jnp.zeros((), jnp.float32), n * SLOT_BYTES)


def fill_if_starved(chosen: Selection, vectors, abs_sum) -> Selection:
    """Fills the payload with the largest magnitudes where a rule selected nothing to send.

    Ties at the threshold (all-equal magnitudes, which error feedback keeps
    tied) or a threshold over the top would otherwise leave the paid-for
    payload empty step after step. The exact top-``capacity`` then fills it,
    ties going to the lower index as in top-k; it only runs on such steps. It
    is found by counting passes, not ``lax.top_k``: on a GPU the sort of an
    untaken branch still reserves its temporaries (docs/design.md).
    """
    payload = chosen.payload
    if payload is None or chosen.shared or chosen.filled:
        return chosen
    capacity = payload.values.shape[0]
    payload, eta = payload_lib.fill_starved(payload, chosen.threshold, vectors, abs_sum, capacity)
    return chosen._replace(payload=payload, threshold=eta)


def _merge(chosen: list[Selection], sizes: list[int]) -> payload_lib.Payload:
    """One payload over the concatenated groups from per-group payloads (k-sized).

    Each group's filled slots move ahead of every padding slot, so the merged
    payload keeps the index order (the groups' ranges follow each other).
    """
    if len(chosen) == 1:
        return chosen[0].payload
    n = sum(sizes)
    offsets = np.cumsum([0, *sizes[:-1]]).tolist()
    indices = jnp.concatenate(
        [
            jnp.where(c.payload.indices < size, c.payload.indices + offset, n)
            for c, size, offset in zip(chosen, sizes, offsets, strict=True)
        ]
    ).astype(jnp.int32)
    filled = indices < n
    ahead = jnp.cumsum(filled, dtype=jnp.int32)
    at = jnp.where(filled, ahead - 1, ahead[-1] + jnp.cumsum(~filled, dtype=jnp.int32) - 1)
    values = jnp.concatenate([c.payload.values for c in chosen])
    return payload_lib.Payload(
        jnp.zeros_like(values).at[at].set(values),
        jnp.zeros_like(indices).at[at].set(indices),
        sum((c.payload.count for c in chosen), jnp.int32(0)),
        sum((c.payload.selected for c in chosen), jnp.int32(0)),
    )


def _round_to_leaves(values, indices, dtypes, spans):
    """Rounds each sent value to the dtype of the leaf it belongs to, saturating.

    The update leaves in the gradient's dtype; rounding here, on the payload,
    lets the residual keep the rounding error so that bf16/fp16 lose nothing.
    A value beyond the dtype's range is sent as its largest finite value, and
    the residual keeps the excess: an update is never infinite. ``spans``
    are each leaf's ``(start, stop)`` among the payload's indices.
    """

    def rounded(dtype):
        top = float(jnp.finfo(dtype).max)
        return jnp.clip(values, -top, top).astype(dtype).astype(jnp.float32)

    narrow = [jnp.finfo(d).bits < 32 for d in dtypes]  # float32 and float64 hold the values
    if not any(narrow):
        return values
    if all(narrow) and len(set(dtypes)) == 1:
        return rounded(dtypes[0])
    out = values
    for dtype, (start, stop), cut in zip(dtypes, spans, narrow, strict=True):
        if cut:
            mine = (indices >= start) & (indices < stop)
            out = jnp.where(mine, rounded(dtype), out)
    return out


def _message(x: jax.Array) -> jax.Array:
    """``x`` as the float32 message carries it, saturating where ``x`` is wider.

    A float64 entry beyond float32's range is sent as its largest finite
    value and the float64 residual keeps the excess (as a float16 leaf's does,
    :func:`_round_to_leaves`): cast, it would be sent as an infinity.
    """
    if jnp.finfo(x.dtype).bits > 32:
        top = float(jnp.finfo(jnp.float32).max)
        x = jnp.clip(x, -top, top)
    return x.astype(jnp.float32)


def select(
    rule: Rule,
    u: Sequence[jax.Array],
    abs_sums: jax.Array,
    rule_state,
    key: jax.Array,
    leaves: Sequence[tuple[int, np.dtype, int]],
    by_leaf: int | None = None,
    spans: Sequence | None = None,
) -> Chosen:
    """Runs ``rule`` on all parts at once, or on each on its own, and merges the choices.

    Args:
      rule: the selection rule.
      u: the parts (``g + residual``).
      abs_sums: ``sum(|u|)`` per part (and more after: ignored).
      rule_state: the rule's state.
      key: this step's key, the same on every device.
      leaves: ``(position among the floating-point leaves, dtype, size)`` of
        every leaf in the parts, in order: the update's dtypes, and whose
        threshold each part's is when selected per leaf.
      by_leaf: None to select over all parts at once (``granularity="model"``),
        else the number of floating-point leaves: each part, one leaf, is
        selected on its own and gets its own threshold.
      spans: each leaf's ``(start, stop)`` among the parts' concatenated
        entries (default: the leaves follow each other, by ``leaves``' sizes).
    """
    groups = [[i] for i in range(len(u))] if by_leaf is not None else [list(range(len(u)))]
    groups = [g for g in groups if g]
    with jax.named_scope("select"):
        keys = jax.random.split(key, len(groups)) if groups else []
        chosen = []
        for group, k in zip(groups, keys, strict=True):
            # The message is float32; a float64 leaf's residual keeps what it cannot carry.
            vectors = [_message(u[i].reshape(-1)) for i in group]
            sums = abs_sums[np.asarray(group)]
            selection = rule.select(vectors, sums, rule_state, k)
            chosen.append(fill_if_starved(selection, vectors, jnp.sum(sums)))
    if by_leaf is None:
        thresholds = chosen[0].threshold if chosen else jnp.zeros((), jnp.float32)
    else:  # one threshold per floating-point leaf, 0 for the zero-size ones
        at = {position: c.threshold for (position, _, _), c in zip(leaves, chosen, strict=True)}
        zero = jnp.zeros((), jnp.float32)
        thresholds = jnp.stack([at.get(i, zero) for i in range(by_leaf)] or [zero])[:by_leaf]
    shared = bool(chosen) and all(c.shared for c in chosen)
    if not chosen or chosen[0].payload is None:
        return Chosen(None, thresholds, 0, shared)
    payload = _merge(chosen, [sum(u[i].size for i in group) for group in groups])
    if spans is None:
        offsets = np.cumsum([0, *(s for _, _, s in leaves)]).tolist()
        spans = list(itertools.pairwise(offsets))
    dtypes = [d for _, d, _ in leaves]
    payload = payload._replace(
        values=_round_to_leaves(payload.values, payload.indices, dtypes, spans)
    )
    return Chosen(payload, thresholds, sum(c.bytes for c in chosen), shared)
