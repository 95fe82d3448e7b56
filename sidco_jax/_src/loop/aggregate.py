"""Averaging the devices' sparse messages over a named mesh axis.

Every device holds one fixed-capacity payload for the whole model. Three ways to
turn the payloads into the mean update, all ending replicated (invariant)
across the axis so that parameters with ``out_specs=P()`` work under
``jax.shard_map(check_vma=True)``:

* ``"sparse"``: ``all_gather`` the values and the indices, in the wire
  format of :mod:`codecs`, then decode and scatter-add all ``devices x
  capacity`` entries into a dense zero vector. Each device receives
  ``(devices - 1) x capacity x 8`` bytes with float32 values and int32 indices.
* ``"dense"``: scatter the local payload into a dense vector and ``psum`` it.
  A ring all-reduce moves ``2 (devices - 1) / devices x 4n`` bytes per device;
  the values travel as selected, whatever the wire format.
* ``"sparse_allreduce"``: route each entry to the device owning its region,
  reduce and select again there, gather the reduced regions
  (:mod:`sparse_allreduce`): under ``3 x capacity x 8`` bytes per device.

``"auto"`` takes the one the alpha-beta model of :mod:`costs` finds cheapest,
decided at trace time from the static sizes and the link. Payloads whose
indices are the same on every device (random-k) need only a ``psum`` of the
values, which is always the cheapest.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sidco_jax._src.analysis import costs
from sidco_jax._src.base import VALUE_BYTES, AxisName
from sidco_jax._src.loop import collectives, sparse_allreduce
from sidco_jax._src.ops import codecs
from sidco_jax._src.ops import payload as payload_lib


def resolve(
    mode: str,
    size: int,
    capacity: int,
    devices: int,
    link: costs.Link = costs.DEFAULT_LINK,
    shared: bool = False,
    wire: codecs.Codec = codecs.DEFAULT,
) -> str:
    """The concrete mode: ``mode`` itself, or for ``"auto"`` the cheapest in :mod:`costs`."""
    if mode != "auto":
        return mode
    return costs.choose(size, capacity, devices, link, shared, wire)


def mean_of(
    payload: payload_lib.Payload,
    sizes: list[int],
    axis_name: AxisName | None,
    mode: str,
    shared: bool = False,
) -> list[jax.Array]:
    """The mean over ``axis_name`` of the densified payloads, values as selected (no codec).

    Args:
      payload: this device's payload, indexed over the concatenation of
        vectors of ``sizes`` entries (the total = padding).
      sizes: lengths of the dense vectors (one per gradient leaf).
      axis_name: the mesh axis (or tuple of axes) to average over.
      mode: ``"sparse"`` or ``"dense"`` (resolved, see :func:`resolve`; the
        sparse all-reduce has its own module).
      shared: whether the indices are the same on every device.

    Returns:
      One float32 vector per size, invariant across ``axis_name``.
    """
    values, indices = payload.values, payload.indices
    # Divided on the k-sized payload, not on the full-size result (a pass saved).
    values = values / lax.axis_size(axis_name)
    if shared:
        values = lax.psum(values, axis_name)
    elif mode == "dense":
        return lax.psum(payload_lib.scatter(values, indices, sizes), axis_name)
    else:
        values, indices = collectives.all_gather((values, indices), axis_name)
    # scatter adds into jnp.zeros: a target built with zeros_like from a
    # varying value would make the mean varying too.
    return payload_lib.scatter(values, indices, sizes)


def gathered_mean(
    payload: payload_lib.Payload, sizes: list[int], axis_name: AxisName | None, codec
) -> tuple[list[jax.Array], jax.Array]:
    """The ``"sparse"`` mean with the payload encoded by ``codec``, and the values this device sent.

    Every device decodes the same gathered messages in the same order, so the
    mean is identical everywhere; the sender's residual subtracts the values
    it sent as decoded, so it keeps the rounding.
    """
    n, slots = sum(sizes), payload.values.shape[0]
    message = codec.encode(payload.values[None], payload.indices[None], n)
    sent = codec.decode_values(message, slots)[0]
    if axis_name is None:
        return payload_lib.scatter(sent, payload.indices, sizes), sent
    devices = lax.axis_size(axis_name)
    message = jax.tree.map(lambda x: x[:, 0], collectives.all_gather(message, axis_name))
    values, indices = codec.decode(message, slots, n)
    mean = payload_lib.scatter((values / devices).reshape(-1), indices.reshape(-1), sizes)
    return mean, sent


class Figures(NamedTuple):
    """A step's figures, agreed across the axis by :func:`agree`.

    Attributes:
      finite: whether every device's gradient was finite.
      sent: int32 entries sent (summed over devices).
      selected: float32 entries above the threshold (summed over devices).
      thresholds: float32 threshold(s), the mean over devices.
      dropped: int32 non-finite residual entries dropped (summed over devices).
    """

    finite: jax.Array
    sent: jax.Array
    selected: jax.Array
    thresholds: jax.Array
    dropped: jax.Array


def agree(axis_name: AxisName | None, local: Figures) -> Figures:
    """This step's figures, identical on every device; one ``psum``.

    Every device agrees on the step before anything is sent: one non-finite
    device makes all of them send nothing, and the rule sees the same figures
    everywhere.
    """
    if axis_name is None:
        return local
    finite, sent, selected, eta, dropped = local
    # Scalars, not stacked: XLA combines the reductions into one all-reduce either way, and
    # a stack is a kernel of its own on a TPU. Selected counts can exceed int32 once
    # summed: float32 is enough for a density.
    bad, sent, selected, eta, dropped = lax.psum(
        (
            (~finite).astype(jnp.int32),
            sent.astype(jnp.int32),
            selected.astype(jnp.float32),
            eta.astype(jnp.float32),
            dropped,
        ),
        axis_name,
    )
    return Figures(bad == 0, sent, selected, eta / lax.axis_size(axis_name), dropped)


class Aggregated(NamedTuple):
    """What the aggregate phase hands on.

    Attributes:
      mean: the mean update, one float32 vector per part (the part's shape
        when everything was sent), identical on every device.
      others: the mean of each complex leaf.
      figures: the step's agreed :class:`Figures`.
      message: static bytes one device sent.
      sent: ``(indices, values)`` this device sent, global indices, values
        as every receiver decodes them; None when it sent every entry (or
        nothing, on a non-finite step).
      kept: ``(indices, values)`` pairs to add back to this device's
        residual: as an owner of the sparse all-reduce, what it received and
        did not send on, and what its own message's rounding lost; empty in
        the other modes.
    """

    mean: list[jax.Array]
    others: list[jax.Array]
    figures: Figures
    message: int
    sent: tuple[jax.Array, jax.Array] | None
    kept: list[tuple[jax.Array, jax.Array]]


def _dense_mean(xs, finite, axis_name):
    """The gated ``pmean`` of ``xs`` (or ``xs`` itself, gated, without an axis)."""
    xs = [jnp.where(finite, x, jnp.zeros((), x.dtype)) for x in xs]
    return xs if axis_name is None else lax.pmean(xs, axis_name)


def _shared_codec(chosen, wire: codecs.Codec) -> None:
    if chosen.shared and wire != codecs.DEFAULT:
        raise ValueError(
            f"values={wire.values!r} and indices={wire.indices!r} need a rule that sends its own "
            "indices: this one's are the same on every device and only float32 values travel "
            "(use values='float32', indices='int32')"
        )


def aggregate(
    chosen,
    fed,
    others: Sequence[jax.Array],
    axis_name: AxisName | None,
    communication: str,
    link: costs.Link,
    reselect: Callable[[jax.Array], payload_lib.Payload],
    wire: codecs.Codec = codecs.DEFAULT,
    agree_over: AxisName | None = None,
) -> Aggregated:
    """The mean over ``axis_name`` of every device's choice, in the resolved mode.

    Args:
      chosen: the select phase's :class:`~sidco_jax._src.loop.selection.Chosen`.
      fed: the error-feedback phase's :class:`~sidco_jax._src.loop.feedback.Fed`.
      others: the complex leaves, averaged densely.
      axis_name: the mesh axis (or tuple of axes), or None for local.
      communication: the ``communication`` option (``"auto"`` resolved here).
      link: the link of ``axis_name`` for ``"auto"``.
      reselect: the owner's selection in the sparse all-reduce.
      wire: the sparse messages' :class:`~sidco_jax._src.ops.codecs.Codec`.
      agree_over: the axes the step's figures are agreed over (default
        ``axis_name``): in the sharded hierarchy, the inner axis's too.
    """
    sizes = [x.size for x in fed.u]
    n = sum(sizes)
    payload, routed, mode = chosen.payload, None, "sparse"
    if payload is None:
        sent, selected = jnp.where(fed.finite, n, 0).astype(jnp.int32), jnp.int32(n)
    else:
        _shared_codec(chosen, wire)
        capacity = payload.values.shape[0]
        if axis_name is not None and not chosen.shared:
            mode = resolve(communication, n, capacity, lax.axis_size(axis_name), link, wire=wire)
        if mode == "sparse_allreduce":  # what does not fit its owner's slots stays here
            routed = sparse_allreduce.route(payload, n, lax.axis_size(axis_name))
        count = payload.count if routed is None else routed.count
        sent, selected = jnp.where(fed.finite, count, 0), payload.selected
    local = Figures(fed.finite, sent, selected, chosen.thresholds, fed.dropped)
    figures = agree(axis_name if agree_over is None else agree_over, local)
    finite, sent_at, kept = figures.finite, None, []
    with jax.named_scope("aggregate"):
        if payload is None:
            mean = _dense_mean(fed.u, finite, axis_name)
            message = sum(x.size * x.dtype.itemsize for x in fed.u)
        else:  # a non-finite step sends zeros everywhere
            payload = payload._replace(values=jnp.where(finite, payload.values, 0.0))
        if routed is not None:
            routed = routed._replace(values=jnp.where(finite, routed.values, 0.0))
            reduced = sparse_allreduce.exchange(routed, sizes, axis_name, reselect, wire)
            mean, message, sent_at, kept = reduced.mean, reduced.message, reduced.sent, reduced.kept
        elif payload is not None and (mode == "dense" or (chosen.shared and axis_name is not None)):
            mean = mean_of(payload, sizes, axis_name, mode, chosen.shared)
            message = VALUE_BYTES * n if mode == "dense" else chosen.bytes
            sent_at = (payload.indices, payload.values)
        elif payload is not None:
            codec = wire.at(capacity, n)
            mean, values = gathered_mean(payload, sizes, axis_name, codec)
            message = chosen.bytes if codec.identity else codec.bytes(capacity, n)
            sent_at = (payload.indices, values)
        # Complex leaves are averaged densely: never left out of the collective.
        others = _dense_mean(others, finite, axis_name)
    message += sum(c.size * c.dtype.itemsize for c in others)
    return Aggregated(mean, others, figures, message, sent_at, kept)
