"""Error feedback: the first and last phases of the loop, around selection and aggregation.

``error_feedback`` adds the residual to the gradient in the first pass over
each part, which also sums ``|g + r|`` for the finite check and for the rules'
statistics. Only where a sum is not finite does a second look tell a bad
gradient (the step is skipped) from bad residual entries (dropped) or a mere
overflow. ``write_back`` keeps in the residual, exactly, whatever was not sent.
"""

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sidco_jax._src.ops import passes


class Fed(NamedTuple):
    """What the error-feedback phase hands on.

    Attributes:
      u: ``g + residual`` per part; on a non-finite step, what is finite of it.
      abs_sums: float32 ``sum(|u|)`` per part, then per complex leaf.
      finite: whether this device's gradient is finite.
      dropped: int32 count of the non-finite residual entries dropped here.
    """

    u: list[jax.Array]
    abs_sums: jax.Array
    finite: jax.Array
    dropped: jax.Array


def _abs_sum(pair, zero):
    g, r = pair
    return jnp.abs(g.astype(r.dtype) + r) + zero


def _finite(x) -> jax.Array:
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def _recovered(g, r, gradient_ok):
    """``g + r`` without what is not finite: a bad gradient or bad residual entries are dropped.

    A sum beyond float32's range saturates, so the entry is sent early rather than lost.
    """
    top = jnp.finfo(r.dtype).max
    g = jnp.where(gradient_ok, g.astype(r.dtype), jnp.zeros((), r.dtype))
    return jnp.clip(_finite(g) + _finite(r), -top, top)


def _checks(g, r) -> tuple[jax.Array, ...]:
    """Non-finite entries of ``g`` and of ``r``, and ``sum |g + r|`` of what is finite,
    with and without ``g``: one variadic reduction."""
    r = jnp.broadcast_to(r, g.shape)  # a scalar zero without error feedback
    terms = (
        (~jnp.isfinite(g)).astype(jnp.int32),
        (~jnp.isfinite(r)).astype(jnp.int32),
        jnp.abs(_recovered(g, r, True)).astype(jnp.float32),
        jnp.abs(_recovered(g, r, False)).astype(jnp.float32),
    )
    zeros = (np.int32(0), np.int32(0), np.float32(0), np.float32(0))
    add = lambda a, b: tuple(x + y for x, y in zip(a, b, strict=True))  # noqa: E731
    return lax.reduce(terms, zeros, add, tuple(range(g.ndim)))


def _diagnose(pairs, others, error_feedback):
    """Runs only when a per-part sum is not finite: what exactly is wrong.

    Returns whether every gradient entry is finite, how many residual entries
    are not (to be dropped), and the per-part sums ``|g + r|`` of what remains.
    """
    # One variadic pass per part (on a TPU one kernel, not one per reduction): its
    # non-finite gradient and residual entries, and |g + r| with and without the gradient.
    checks = [_checks(g, r) for g, r in pairs]
    gradient_ok = jnp.all(
        jnp.stack([bad_g == 0 for bad_g, *_ in checks] + [jnp.all(jnp.isfinite(c)) for c in others])
    )
    dropped = jnp.zeros_like(gradient_ok, jnp.int32)  # varies across devices like the rest
    if error_feedback:
        # Counted in the metrics, not warned about from the device: a host
        # callback anywhere in the update, even in this branch that seldom
        # runs, slowed every update on XLA's CPU backend.
        dropped += sum(bad_r for _, bad_r, _, _ in checks)
    sums = [jnp.where(gradient_ok, with_g, without) for *_, with_g, without in checks]
    sums += [jnp.sum(jnp.abs(_finite(c))) for c in others]
    return gradient_ok, dropped, jnp.stack(sums).astype(jnp.float32)


def error_feedback(pairs, others: Sequence[jax.Array], error_feedback: bool) -> Fed:
    """``u = g + r`` for each ``(g, r)`` of ``pairs``, with the non-finite diagnosis.

    Args:
      pairs: ``(gradient, residual)`` per part; without error feedback the
        residual is a scalar zero of the residual's dtype.
      others: the complex leaves (averaged densely, checked for finiteness).
      error_feedback: whether the residual is kept (and bad entries counted).
    """
    with jax.named_scope("error_feedback"):
        abs_sums = passes.reduce_parts(pairs, _abs_sum)
        abs_sums += [jnp.sum(jnp.abs(c)) for c in others]
        abs_sums = jnp.stack(abs_sums).astype(jnp.float32)
        sums_ok = jnp.all(jnp.isfinite(abs_sums))

        def fine(_):
            return sums_ok, jnp.zeros_like(sums_ok, jnp.int32), abs_sums

        finite, dropped, abs_sums = lax.cond(
            sums_ok, fine, lambda _: _diagnose(pairs, others, error_feedback), None
        )
        # A non-finite device keeps its residual (less any bad entry): it sends nothing.
        u = [
            jnp.where(sums_ok, g.astype(r.dtype) + r, _recovered(g, r, finite))
            if error_feedback
            else g.astype(r.dtype)
            for g, r in pairs
        ]
    return Fed(u, abs_sums, finite, dropped)


def _subtract_at(x: jax.Array, flat_index: jax.Array, values: jax.Array, in_order: bool):
    """``x`` with ``values`` subtracted at row-major ``flat_index`` (outside ``[0, x.size)``:
    dropped).

    Indexed in ``x``'s own shape, so XLA updates it in place in its buffer.
    ``in_order``: the indices ascend (a payload's), so a GPU or TPU scatters
    without sorting them first.
    """
    if x.size == 0:
        return x
    index, rest = [], flat_index
    for dim in reversed(x.shape[1:]):
        index.append(rest % dim)
        rest = rest // dim
    index.append(rest)  # outside x: past (or before) the first axis, so dropped
    rank = len(index)
    numbers = lax.ScatterDimensionNumbers(
        update_window_dims=(),
        inserted_window_dims=tuple(range(rank)),
        scatter_dims_to_operand_dims=tuple(range(rank)),
    )
    # lax's scatter, not .at[]: that would wrap a negative index into x.
    return lax.scatter_add(
        x,
        jnp.stack(index[::-1], axis=-1),
        -values.astype(x.dtype),
        numbers,
        indices_are_sorted=in_order,
        mode=lax.GatherScatterMode.FILL_OR_DROP,
    )


def write_back(u, finite, sent, kept, sizes: Sequence[int]) -> list[jax.Array]:
    """The residual per part: ``u`` less what this device sent, plus what it kept.

    Args:
      u: the parts from :func:`error_feedback`.
      finite: whether every device was finite (else nothing was sent).
      sent: ``(indices, values)`` this device sent, global indices, values as
        the receivers decode them (so the residual keeps the rounding); None
        when it sent everything.
      kept: ``(indices, values)`` pairs to add back: what it received as an
        owner of the sparse all-reduce and did not send on, and what the
        rounding of its reduced payload lost.
      sizes: the parts' sizes.
    """
    with jax.named_scope("write_back"):
        if sent is None:
            return [jnp.where(finite, jnp.zeros((), x.dtype), x) for x in u]
        # Subtracted in place, part by part: exactly what was not sent stays.
        starts = np.cumsum([0, *sizes[:-1]])
        for indices, values, in_order in [(*sent, True), *((i, -v, False) for i, v in kept)]:
            u = [
                _subtract_at(x, indices - int(start), values, in_order)
                for x, start in zip(u, starts, strict=True)
            ]
        return u
