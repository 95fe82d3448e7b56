"""A sparse all-reduce whose traffic per device does not grow with the device count.

Gathering every device's payload (``communication="sparse"``) makes each
device receive ``(P - 1) x k`` slots. Here, as in Ok-Topk (Li and Hoefler,
PPoPP 2022), the index space is cut into ``P`` contiguous regions, region ``i``
owned by device ``i`` along the axis, and one step is

1. **route**: each device sorts its payload by owner and sends each owner up
   to ``s = ceil(2k / P)`` of its entries with one ``lax.all_to_all`` (fixed
   slots: static shapes). Entries that do not fit are not sent and stay in the
   sender's residual;
2. **reduce**: each owner sums what it received into its region and selects
   again, with the compressor's own rule at the same ratio (about ``k / P``
   slots). What the owner does not send stays in *its* residual, so nothing
   is lost globally: over the steps, ``P`` x the updates plus every residual
   sum to every gradient;
3. **gather**: one ``all_gather`` of the reduced regions, scattered into the
   mean, identical on every device.

Each device receives about ``(s + k / P) x (P - 1) x 8 <= 3 k x 8`` bytes.
"""

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sidco_jax._src import collectives, costs
from sidco_jax._src import payload as payload_lib
from sidco_jax._src.base import SLOT_BYTES, AxisName
from sidco_jax._src.payload import Payload


class Routed(NamedTuple):
    """One device's payload sorted into fixed slots per region owner.

    Attributes:
      values: ``(devices, slots)`` float32 values for each owner, zero-padded.
      indices: ``(devices, slots)`` int32 global indices (``size``: padding).
      sent: the payload's indices that fit their owner's slots, in payload
        order; ``size`` for those that did not (they stay in the residual).
      count: int32 number of entries that fit.
    """

    values: jax.Array
    indices: jax.Array
    sent: jax.Array
    count: jax.Array


class Reduced(NamedTuple):
    """The outcome of one sparse all-reduce on one device.

    Attributes:
      mean: the mean update, one float32 vector per size, invariant across
        the axis.
      kept_indices: global indices of entries this device received as an
        owner and did not send on (``size`` for none).
      kept_values: their values, to add back to this device's residual.
      message: static bytes this device sends.
    """

    mean: list[jax.Array]
    kept_indices: jax.Array
    kept_values: jax.Array
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
    sent = jnp.full_like(indices, size).at[order].set(jnp.where(fits, indices[order], size))
    shape = (devices, slots)
    return Routed(
        out_values.reshape(shape),
        out_indices.reshape(shape),
        sent,
        jnp.sum(fits, dtype=jnp.int32),
    )


def exchange(
    routed: Routed,
    sizes: Sequence[int],
    axis_name: AxisName,
    reselect: Callable[[jax.Array], Payload],
) -> Reduced:
    """The mean over ``axis_name`` of every device's routed payload.

    Args:
      routed: the payload :func:`route` sorted on this device (values already gated).
      sizes: lengths of the dense vectors (one per gradient leaf).
      axis_name: the mesh axis (or tuple of axes) to average over.
      reselect: the owner's selection: given its region's float32 sum, a
        payload indexed within the region (the region's length = padding).

    Returns:
      A :class:`Reduced`.
    """
    size = sum(sizes)
    devices, slots = routed.values.shape
    region = -(-size // devices)
    values = lax.all_to_all(routed.values, axis_name, 0, 0, tiled=True).reshape(-1)
    indices = lax.all_to_all(routed.indices, axis_name, 0, 0, tiled=True).reshape(-1)

    start = lax.axis_index(axis_name) * region
    local = jnp.where(indices < size, indices - start, region)  # padding: dropped
    summed = jnp.zeros(region, values.dtype).at[local].add(values, mode="drop")
    chosen = reselect(summed)
    picked = jnp.zeros(region, bool).at[chosen.indices].set(True, mode="drop")
    keep = (local < region) & ~picked[jnp.minimum(local, region - 1)]

    # The region may run past the last entry; those slots hold zeros: dropped.
    reduced = jnp.where(chosen.indices < region, chosen.indices + start, size)
    reduced = jnp.where(reduced < size, reduced, size).astype(jnp.int32)
    share = chosen.values / devices  # divided on the small payload
    share, reduced = collectives.all_gather((share, reduced), axis_name)
    return Reduced(
        mean=payload_lib.scatter(share, reduced, sizes),
        kept_indices=jnp.where(keep, indices, size),
        kept_values=jnp.where(keep, values, jnp.zeros((), values.dtype)),
        message=(devices * slots + chosen.values.shape[0]) * SLOT_BYTES,
    )
