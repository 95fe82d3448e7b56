"""Wire formats of a sparse message: how its values and its indices travel.

A message is ``rows`` of ``slots``: one row for the all-gather, one per
region owner for the sparse all-reduce. In each row the filled slots come
first, in ascending index order (:class:`~sidco_jax.Payload`'s order), then
padding, whose index is the row's ``space`` (its index range).

Values (``values=``):

* ``"float32"``: 4 bytes a slot, as selected;
* ``"bfloat16"``: 2 bytes, rounded to nearest;
* ``"int8"``: 1 byte, ``round(v / s)`` with ``s`` the largest magnitude of
  its block of ``BLOCK`` slots over 127, and a float32 ``s`` per block;
* ``"sign"``: 1 bit, packed, and a float32 scale per block: the mean
  magnitude of the block's filled slots (scaled sign compression).

Indices (``indices=``):

* ``"int32"``: 4 bytes a slot;
* ``"chunked"``: the index space is cut into chunks of ``CHUNK`` entries; a
  slot carries its uint16 offset in its chunk, a row an int32 count of its
  slots per chunk (int32: a chunk can be wholly selected). The receiver finds
  each slot's chunk from the counts' prefix sums: static shapes throughout;
* ``"auto"``: the smaller of the two for the message's sizes.

Whatever a coarse value loses stays in the sender's residual: the loop
subtracts :meth:`Codec.decode_values` of its own message, exactly what every
receiver decodes.
"""

from typing import Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
from jax import lax

from sidco_jax._src.base import check_choice

ValueCodec = Literal["float32", "bfloat16", "int8", "sign"]
IndexCodec = Literal["auto", "int32", "chunked"]
VALUE_CODECS: tuple[str, ...] = get_args(ValueCodec)
INDEX_CODECS: tuple[str, ...] = get_args(IndexCodec)

BLOCK = 256  # slots per scale of "int8" and "sign"
CHUNK = 2**16  # entries per chunk of "chunked": a uint16 offset addresses one


class Message(NamedTuple):
    """One message as it travels; every array has a leading axis of rows.

    Attributes:
      values: ``(rows, slots)`` float32, bfloat16 bits (uint16) or int8, or
        ``(rows, ceil(slots / 8))`` uint8 sign bits.
      scales: ``(rows, blocks)`` float32 scales of ``"int8"`` and ``"sign"``, else None.
      indices: ``(rows, slots)`` int32 indices, or uint16 offsets in their chunk.
      counts: ``(rows, chunks)`` int32 slots per chunk of ``"chunked"``, else None.
    """

    values: jax.Array
    scales: jax.Array | None
    indices: jax.Array
    counts: jax.Array | None


def _blocks(x: jax.Array) -> jax.Array:
    """``(rows, slots)`` as ``(rows, blocks, BLOCK)``, zero-padded."""
    rows, slots = x.shape
    blocks = -(-slots // BLOCK)
    return jnp.pad(x, ((0, 0), (0, blocks * BLOCK - slots))).reshape(rows, blocks, BLOCK)


def _per_slot(scales: jax.Array, slots: int) -> jax.Array:
    return jnp.repeat(scales, BLOCK, axis=1)[:, :slots]


def _top(dtype) -> float:
    return float(jnp.finfo(dtype).max)


class Codec(NamedTuple):
    """A wire format: the ``values`` and ``indices`` options of a compressor, as one object.

    The loop carries it from construction to the aggregation and the cost
    model; :mod:`sidco_jax.costs` takes it as ``wire``. ``indices="auto"`` is
    resolved for each message's sizes by :meth:`at`; the other methods need it
    resolved.

    Examples:
      >>> import sidco_jax as sidco
      >>> wire = sidco.costs.Codec(values="int8", indices="chunked")
      >>> sidco.costs.message_bytes("sparse", 2**20, 1000, 8, wire)
      3080
    """

    values: str = "float32"
    indices: str = "int32"

    def at(self, slots: int, space: int) -> "Codec":
        """This format for a message of ``slots`` over ``space``: ``"auto"`` takes the smaller."""
        if self.indices != "auto":
            return self
        both = (self._replace(indices="int32"), self._replace(indices="chunked"))
        return min(both, key=lambda c: c.bytes(slots, space))

    @property
    def identity(self) -> bool:
        """Whether the message travels as selected (float32 values, int32 indices)."""
        return self == Codec()

    def bytes(self, slots: int, space: int, rows: int = 1) -> int:
        """Bytes of ``rows`` rows of ``slots`` slots over an index range of ``space``."""
        blocks = -(-slots // BLOCK)
        value = {
            "float32": 4 * slots,
            "bfloat16": 2 * slots,
            "int8": slots + 4 * blocks,
            "sign": -(-slots // 8) + 4 * blocks,
        }[self.values]
        index = 4 * slots if self.indices == "int32" else 2 * slots + 4 * chunks(space)
        return rows * (value + index)

    def decode_values(self, message: Message, slots: int) -> jax.Array:
        """The float32 values of a :class:`Message`: what the sender's residual subtracts."""
        return self._decode_values(message.values, message.scales, slots)

    def encode(self, values: jax.Array, indices: jax.Array, space: int) -> Message:
        """The wire form of ``(rows, slots)`` float32 values and int32 indices in ``[0, space]``."""
        valid = indices < space
        scales, coded = self._encode_values(values, valid)
        if self.indices == "int32":
            return Message(coded, scales, indices, None)
        chunk = jnp.where(valid, indices // CHUNK, chunks(space))  # padding: dropped
        rows = jnp.arange(indices.shape[0])[:, None]
        counts = jnp.zeros((indices.shape[0], chunks(space)), jnp.int32)
        counts = counts.at[rows, chunk].add(1, mode="drop")
        offsets = jnp.where(valid, indices % CHUNK, 0).astype(jnp.uint16)
        return Message(coded, scales, offsets, counts)

    def decode(self, message: Message, slots: int, space: int) -> tuple[jax.Array, jax.Array]:
        """``(values, indices)`` of a :class:`Message`: float32, and int32 (``space``: padding)."""
        values = self.decode_values(message, slots)
        if self.indices == "int32":
            return values, message.indices
        counts = message.counts
        starts = jnp.cumsum(counts, axis=1) - counts  # each chunk's first slot
        rows = jnp.arange(counts.shape[0])[:, None]
        marks = jnp.zeros((counts.shape[0], slots + 1), jnp.int32)
        marks = marks.at[rows, jnp.minimum(starts, slots)].add(1)
        chunk = jnp.cumsum(marks[:, :slots], axis=1) - 1
        filled = jnp.arange(slots) < jnp.sum(counts, axis=1, keepdims=True)
        indices = chunk * CHUNK + message.indices.astype(jnp.int32)
        return values, jnp.where(filled, indices, space)

    def _encode_values(self, values, valid):
        if self.values == "float32":
            return None, values
        if self.values == "bfloat16":
            # As uint16 bits: XLA's CPU backend widens a bfloat16 collective to float32.
            top = _top(jnp.bfloat16)
            rounded = jnp.clip(values, -top, top).astype(jnp.bfloat16)
            return None, lax.bitcast_convert_type(rounded, jnp.uint16)
        magnitude = jnp.where(valid, jnp.abs(values), 0.0)
        if self.values == "int8":
            scales = jnp.max(_blocks(magnitude), axis=2) / 127
            step = _per_slot(scales, values.shape[1])
            q = jnp.where(step > 0, jnp.round(values / jnp.where(step > 0, step, 1)), 0)
            return scales, jnp.clip(q, -127, 127).astype(jnp.int8)
        filled = jnp.sum(_blocks(valid.astype(jnp.float32)), axis=2)
        # Each magnitude over the count first: the sum stays finite.
        share = _blocks(magnitude) / jnp.maximum(filled, 1)[:, :, None]
        scales = jnp.minimum(jnp.sum(share, axis=2), _top(jnp.float32))
        return scales, jnp.packbits(values < 0, axis=1)

    def _decode_values(self, coded, scales, slots: int) -> jax.Array:
        if self.values == "float32":
            return coded
        if self.values == "bfloat16":
            return lax.bitcast_convert_type(coded, jnp.bfloat16).astype(jnp.float32)
        step = _per_slot(scales, slots)
        if self.values == "int8":
            top = _top(jnp.float32)
            return jnp.clip(coded.astype(jnp.float32) * step, -top, top)
        negative = jnp.unpackbits(coded, axis=1, count=slots).astype(bool)
        return jnp.where(negative, -step, step)


def chunks(space: int) -> int:
    """Chunks of ``CHUNK`` entries that cover ``space`` (at least one)."""
    return max(-(-space // CHUNK), 1)


def check(values, indices) -> None:
    """Raises ``ValueError`` unless ``values`` and ``indices`` name codecs."""
    check_choice("values", values, VALUE_CODECS)
    check_choice("indices", indices, INDEX_CODECS)


DEFAULT = Codec()


def refuse(compressor: str, options: dict, why: str) -> None:
    """Raises ``ValueError`` where ``options`` ask for a codec a compressor has no use for."""
    values, indices = options["values"], options["indices"]
    if Codec(values, indices) != DEFAULT:
        raise ValueError(
            f"{compressor} {why}: values={values!r} and indices={indices!r} do not apply "
            "(leave them at 'float32' and 'int32')"
        )
