"""How the devices of a node take part in a step: alone, averaged, or sharing slices.

* :data:`ALONE` (no ``inner_axis``): each device compresses its own gradient
  across ``axis_name``.
* :class:`Averaged` (``inner_axis``): the node's mean first, over the fast
  links (``pmean``); every device of the node then compresses the same vector
  identically, and the residual is per node.
* :class:`Sharded` (``inner_axis`` and ``inner_shards``): each device
  compresses its own slice of the node's mean (:mod:`slices`) and keeps that
  slice's residual; the slices' updates are gathered back.
* :class:`Owned` (``inner_axis`` and ``inner_shards="params"``): the
  parameters are sharded over ``inner_axis`` (FSDP within a node), so the
  gradient arrives as this device's shard of the node's mean; each device
  compresses that shard, keeps its residual, and its update stays a shard.

The loop calls the node's phases and never asks which it is.
"""

from typing import NamedTuple

from jax import lax

from sidco_jax._src.base import AxisName, axis_names
from sidco_jax._src.loop import slices


def devices(axis_name, name: str = "axis_name") -> int:
    """Devices along ``axis_name`` (1 for None), with a clear error naming the option ``name``
    where it is unbound."""
    if axis_name is None:
        return 1
    try:
        return lax.axis_size(axis_name)
    except NameError as error:
        raise NameError(
            f"{name} {axis_name!r} is not bound here: call the update inside jax.shard_map "
            f"or jax.pmap over that axis, or build the compressor with {name}=None"
        ) from error


class Alone(NamedTuple):
    """Each device compresses its own gradient: no inner axis."""

    def pack(self, g: list, others: list, parts) -> tuple[list, list]:
        """The parts and complex leaves this device compresses."""
        return g, others

    def spans(self, parts, sizes) -> list | None:
        """Each leaf's ``(start, stop)`` in this device's parts (None: they follow each other)."""
        return None

    def agreed(self, axis_name: AxisName | None) -> AxisName | None:
        """The axes a step's figures are agreed over."""
        return axis_name

    def unpack(self, mean: list, parts) -> list:
        """The whole parts' mean from this device's."""
        return mean

    @property
    def copies(self) -> int:
        """How many devices of a node hold different entries."""
        return 1


ALONE = Alone()


class Averaged(NamedTuple):
    """The node's mean over ``inner_axis`` first; its devices then compress it alike."""

    inner_axis: AxisName

    def pack(self, g, others, parts):
        devices(self.inner_axis, "inner_axis")  # a clear error where it is unbound
        return lax.pmean((g, others), self.inner_axis)

    spans, agreed, unpack, copies = Alone.spans, Alone.agreed, Alone.unpack, Alone.copies


class Sharded(NamedTuple):
    """Each device compresses its ``1/shards`` slice of the node's mean of every part."""

    inner_axis: AxisName
    shards: int

    def pack(self, g, others, parts):
        devices(self.inner_axis, "inner_axis")
        slices.check_bound(self.inner_axis, self.shards)
        return (
            slices.scatter(g, parts, self.inner_axis, self.shards),
            lax.pmean(others, self.inner_axis),
        )

    def spans(self, parts, sizes):
        return slices.spans(parts, sizes, self.inner_axis, self.shards)

    def agreed(self, axis_name):
        return (*axis_names(axis_name), *axis_names(self.inner_axis))

    def unpack(self, mean, parts):
        return slices.gather(mean, parts, self.inner_axis)

    @property
    def copies(self) -> int:
        return self.shards


class Owned(NamedTuple):
    """Each device compresses its shard of the parameters' gradient, which it already holds."""

    inner_axis: AxisName

    def pack(self, g, others, parts):
        devices(self.inner_axis, "inner_axis")
        return g, others

    def agreed(self, axis_name):
        return (*axis_names(axis_name), *axis_names(self.inner_axis))

    spans, unpack = Alone.spans, Alone.unpack

    @property
    def copies(self) -> int:
        return devices(self.inner_axis, "inner_axis")


def choose(inner_axis: AxisName | None, shards: int | str | None):
    """The node for the loop's options."""
    if inner_axis is None:
        return ALONE
    if shards is None:
        return Averaged(inner_axis)
    return Owned(inner_axis) if shards == slices.PARAMS else Sharded(inner_axis, shards)
