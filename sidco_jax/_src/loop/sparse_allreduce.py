"""A sparse all-reduce whose traffic per device does not grow with the device count.

Gathering every device's payload (``communication="sparse"``) makes each
device receive ``(P - 1) x k`` slots. Here, as in Ok-Topk (Li and Hoefler,
PPoPP 2022), the index space is cut into ``P`` contiguous regions, region ``i``
owned by device ``i`` along the axis, and one step is

1. **route**: each device sorts its payload by owner and sends each owner up
   to ``s = ceil(2k / P)`` of its entries with one ``lax.all_to_all`` (fixed
   slots: static shapes). Entries that do not fit are not sent and stay in the
   sender's residual;
2. **reduce**: each owner averages what it received into its region and selects
   again, with the compressor's own rule at the same ratio (about ``k / P``
   slots);
3. **gather**: one ``all_gather`` of the reduced regions, scattered into the
   mean, identical on every device. From it each device also learns which of
   its routed entries their owners sent on: the others stay in its own
   residual, so nothing is lost (over the steps, ``P`` x the updates plus
   every residual sum to every gradient), and no residual holds a sum of
   several devices' entries, which could overflow.

Each device receives about ``(s + k / P) x (P - 1) x 8 <= 3 k x 8`` bytes
with float32 values and int32 indices. In a compact wire format (:mod:`codecs`)
the routed slots travel with indices relative to their owner's region, and an
owner's residual also keeps what the rounding of its reduced payload lost.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sidco_jax._src.analysis import costs
from sidco_jax._src.base import AxisName
from sidco_jax._src.loop import collectives
from sidco_jax._src.ops import codecs
from sidco_jax._src.ops import payload as payload_lib
from sidco_jax._src.ops.payload import Payload


class Routed(NamedTuple):
    """One device's payload sorted into fixed slots per region owner.

    Attributes:
      values: ``(devices, slots)`` float32 values for each owner, zero-padded.
      indices: ``(devices, slots)`` int32 global indices (``size``: padding),
        ascending in each row; what did not fit stays in the residual.
      count: int32 number of entries that fit.
    """

    values: jax.Array
    indices: jax.Array
    count: jax.Array


class Reduced(NamedTuple):
    """The outcome of one sparse all-reduce on one device.

    Attributes:
      mean: the mean update, one float32 vector per size, invariant across
        the axis.
      sent: ``(indices, values)`` this device routed and their owners sent
        on, global indices (``size``: padding), values as the owners decode
        them.
      kept: ``(indices, values)`` pairs to add back to this device's
        residual: what the rounding of its reduced payload lost, times the
        devices (the residuals owe the sum).
      message: static bytes this device sends.
    """

    mean: list[jax.Array]
    sent: tuple[jax.Array, jax.Array]
    kept: list[tuple[jax.Array, jax.Array]]
    message: int


def check_fits(size: int, capacity: int, devices: int) -> None:
    """Refuses sizes a sparse all-reduce cannot split (raises ``ValueError``)."""
    if devices > size:
        raise ValueError(
            f"communication='sparse_allreduce' splits the {size} entries into one region per "
            f"device and cannot fit them on {devices} devices: use 'sparse' or 'dense'"
        )
    slots = devices * costs.plan(size, capacity, devices).route
    if slots >= 2**31 - 1:
        raise ValueError(
            f"a payload capacity of {capacity} routed to {devices} devices needs {slots} slots, "
            "more than int32 indices address: lower the ratio or the capacity_factor"
        )


def route(payload: Payload, size: int, devices: int) -> Routed:
    """Sorts ``payload`` (indexed over ``size`` entries) into fixed slots per owner; local."""
    check_fits(size, payload.values.shape[0], devices)
    values, indices = payload.values, payload.indices
    sizes_of = costs.plan(size, values.shape[0], devices)
    region, slots = sizes_of.region, sizes_of.route
    owner = jnp.where(indices < size, indices // region, devices)  # padding: no owner
    order = jnp.argsort(owner, stable=True)
    owner = owner[order]
    rank = jnp.arange(owner.shape[0]) - jnp.searchsorted(owner, owner, side="left")
    fits = (owner < devices) & (rank < slots)
    slot = jnp.where(fits, owner * slots + rank, devices * slots)
    out_values = jnp.zeros(devices * slots, values.dtype).at[slot].set(values[order], mode="drop")
    out_indices = (
        jnp.full(devices * slots, size, jnp.int32).at[slot].set(indices[order], mode="drop")
    )
    shape = (devices, slots)
    return Routed(
        out_values.reshape(shape), out_indices.reshape(shape), jnp.sum(fits, dtype=jnp.int32)
    )


def _all_to_all(message: codecs.Message, axis_name: AxisName) -> codecs.Message:
    return jax.tree.map(lambda x: lax.all_to_all(x, axis_name, 0, 0, tiled=True), message)


def _sent_on(routed: jax.Array, reduced: jax.Array, size: int) -> jax.Array:
    """``routed`` (a row of global indices per owner), where the owner sent the entry on,
    else the padding ``size``: what an owner did not select stays in its sender's residual,
    which owes it, and no owner's residual ever holds a sum of devices' entries."""
    reduced = jnp.sort(reduced, axis=1)
    at = jax.vmap(jnp.searchsorted)(reduced, routed)
    found = jnp.take_along_axis(reduced, jnp.minimum(at, reduced.shape[1] - 1), axis=1)
    return jnp.where((found == routed) & (routed < size), routed, size)


def exchange(
    routed: Routed,
    sizes: Sequence[int],
    axis_name: AxisName,
    reselect: Callable[[jax.Array], Payload],
    wire: codecs.Codec = codecs.DEFAULT,
) -> Reduced:
    """The mean over ``axis_name`` of every device's routed payload.

    Args:
      routed: the payload :func:`route` sorted on this device (values already gated).
      sizes: lengths of the dense vectors (one per gradient leaf).
      axis_name: the mesh axis (or tuple of axes) to average over.
      reselect: the owner's selection: given its region's float32 mean, a
        payload indexed within the region (the region's length = padding).
      wire: the :class:`~sidco_jax._src.ops.codecs.Codec` of both messages.

    Returns:
      A :class:`Reduced`.
    """
    size = sum(sizes)
    devices, slots = routed.values.shape
    region = -(-size // devices)
    owners = jnp.arange(devices, dtype=jnp.int32)[:, None] * region
    # Routed: each row relative to its owner's region.
    codec = wire.at(slots, region)
    relative = jnp.where(routed.indices < size, routed.indices - owners, region)
    message = codec.encode(routed.values, relative, region)
    routed_values = codec.decode_values(message, slots)
    values, local = codec.decode(_all_to_all(message, axis_name), slots, region)
    values, local = values.reshape(-1), local.reshape(-1)

    # Each value divided before the sum, as the other modes do: devices x 1e38 overflow.
    mean = jnp.zeros(region, values.dtype).at[local].add(values / devices, mode="drop")
    chosen = reselect(mean)

    # Reduced: one row per owner, relative to its region, then made global.
    reduced_slots = chosen.values.shape[0]
    reduced_codec = wire.at(reduced_slots, region)
    mine = reduced_codec.encode(chosen.values[None], chosen.indices[None], region)
    # The rounding, kept as the devices' share of it (the residuals owe the sum).
    rounding = (chosen.values - reduced_codec.decode_values(mine, reduced_slots)[0]) * devices
    gathered = jax.tree.map(lambda x: x[:, 0], collectives.all_gather(mine, axis_name))
    share, reduced = reduced_codec.decode(gathered, reduced_slots, region)
    # The region may run past the last entry; those slots hold zeros: dropped.
    reduced = jnp.where(reduced < region, reduced + owners, size)
    reduced = jnp.where(reduced < size, reduced, size)
    start = lax.axis_index(axis_name) * region

    return Reduced(
        mean=payload_lib.scatter(share.reshape(-1), reduced.reshape(-1), sizes),
        sent=(_sent_on(routed.indices, reduced, size).reshape(-1), routed_values.reshape(-1)),
        kept=[(jnp.where(chosen.indices < region, chosen.indices + start, size), rounding)],
        message=codec.bytes(slots, region, devices) + reduced_codec.bytes(reduced_slots, region),
    )
