"""Averaging the devices' sparse messages over a named mesh axis.

Every device holds one fixed-capacity payload for the whole model. Three ways to
turn the payloads into the mean update, all ending replicated (invariant)
across the axis so that parameters with ``out_specs=P()`` work under
``jax.shard_map(check_vma=True)``:

* ``"sparse"``: ``all_gather`` the values and the indices, then scatter-add
  all ``devices x capacity`` entries into a dense zero vector. Each device
  receives ``(devices - 1) x capacity x 8`` bytes.
* ``"dense"``: scatter the local payload into a dense vector and ``psum`` it.
  A ring all-reduce moves ``2 (devices - 1) / devices x 4n`` bytes per device.
* ``"sparse_allreduce"``: route each entry to the device owning its region,
  reduce and select again there, gather the reduced regions
  (:mod:`sparse_allreduce`): under ``3 x capacity x 8`` bytes per device.

``"auto"`` takes the one the alpha-beta model of :mod:`costs` finds cheapest,
decided at trace time from the static sizes and the link. Payloads whose
indices are the same on every device (random-k) need only a ``psum`` of the
values, which is always the cheapest.
"""

import jax
from jax import lax

from sidco_jax._src import costs
from sidco_jax._src import payload as payload_lib
from sidco_jax._src.base import INDEX_BYTES, VALUE_BYTES, AxisName


def resolve(
    mode: str,
    size: int,
    capacity: int,
    devices: int,
    link: costs.Link = costs.DEFAULT_LINK,
    shared: bool = False,
) -> str:
    """The concrete mode: ``mode`` itself, or for ``"auto"`` the cheapest in :mod:`costs`."""
    if mode != "auto":
        return mode
    return costs.choose(size, capacity, devices, link, shared)


def message_bytes(mode: str, size: int, capacity: int, shared: bool = False) -> int:
    """Bytes of the message one device contributes in ``mode``."""
    if mode == "dense":
        return VALUE_BYTES * size
    return capacity * (VALUE_BYTES + (0 if shared else INDEX_BYTES))


def mean(
    payload: payload_lib.Payload,
    sizes: list[int],
    axis_name: AxisName | None,
    mode: str,
    shared: bool = False,
) -> list[jax.Array]:
    """The mean over ``axis_name`` of the densified payloads, replicated on every device.

    Args:
      payload: this device's payload, indexed over the concatenation of
        vectors of ``sizes`` entries (the total = padding).
      sizes: lengths of the dense vectors (one per gradient leaf).
      axis_name: the mesh axis (or tuple of axes) to average over; None for
        this device's own payload, densified.
      mode: ``"sparse"`` or ``"dense"`` (resolved, see :func:`resolve`; the
        sparse all-reduce has its own module).
      shared: whether the indices are the same on every device.

    Returns:
      One float32 vector per size, invariant across ``axis_name``.
    """
    values, indices = payload.values, payload.indices
    if axis_name is None:
        return payload_lib.scatter(values, indices, sizes)
    # Divided on the k-sized payload, not on the full-size result (a pass saved).
    values = values / lax.axis_size(axis_name)
    if shared:
        values = lax.psum(values, axis_name)
    elif mode == "dense":
        return lax.psum(payload_lib.scatter(values, indices, sizes), axis_name)
    else:
        values = lax.all_gather(values, axis_name, to="invarying")
        indices = lax.all_gather(indices, axis_name, to="invarying")
    # scatter adds into jnp.zeros: a target built with zeros_like from a
    # varying value would make the mean varying too.
    return payload_lib.scatter(values, indices, sizes)
