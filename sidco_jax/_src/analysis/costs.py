"""What each way of averaging the devices' messages costs: an alpha-beta model.

A collective over ``P`` devices costs ``rounds x latency + bytes / bandwidth``
for one device, where ``bytes`` is what that device receives (what it sends is
the same in every mode here) and ``rounds`` the messages it waits for in turn, each
paying the link's latency:

========================  ================  =========================================
mode                      rounds            bytes received per device
========================  ================  =========================================
``"dense"`` (ring)        ``2 (P - 1)``     ``2 (P - 1) / P x 4n``
``"sparse"`` (gather)     ``P - 1``         ``(P - 1) x B(k, n)``
``"sparse_allreduce"``    ``2 (P - 1)``     ``(P - 1) x (B(s, n / P) + B(r, n / P))``
shared indices (psum)     ``2 (P - 1)``     ``2 (P - 1) / P x 4k``
========================  ================  =========================================

with ``n`` entries, ``k`` payload slots per device, and for the sparse
all-reduce ``s = ceil(2k / P)`` slots routed to each region owner and
``r = ceil(k / P)`` reduced slots per owner (:func:`plan`). ``B(slots,
space)`` is the bytes of a message in the compressor's wire format
(a :class:`~sidco_jax.costs.Codec`, the compressor's ``values`` and
``indices``): ``8 x slots`` for float32 values and int32
indices, so the sparse all-reduce stays below ``3 k x 8`` bytes whatever
``P``. Hierarchical aggregation adds a dense all-reduce over the fast inner
axis and runs the mode over the slow outer one, on the node's whole mean or
(sharded) on each device's slice of it.

``communication="auto"`` evaluates this model at trace time, from the static
sizes and the :class:`Link` a compressor was given, and takes the cheapest
mode; ``benchmarks/scale.py`` evaluates it past one machine.
"""

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

from sidco_jax._src.base import (
    VALUE_BYTES,
    check_bool,
    check_choice,
    check_integer,
    check_number,
    static,
)
from sidco_jax._src.ops import codecs

ROUTE_SLACK = 2  # slots per region owner, in units of an even share k / P


class Link(NamedTuple):
    """One device's link to the others along a mesh axis.

    Attributes:
      latency: seconds per message (alpha); 5 us is a typical RDMA hop.
      bandwidth: bytes per second one device receives (beta); 12.5e9 is
        100 Gbit/s.
    """

    latency: float = 5e-6
    bandwidth: float = 12.5e9


def check_link(link) -> Link:
    """``link`` checked (the default :class:`Link` for None).

    Raises:
      TypeError: unless ``link`` is None or a :class:`Link` of real numbers.
      ValueError: for a negative or non-finite latency, or a bandwidth that
        is not positive and finite.
    """
    if link is None:
        return DEFAULT_LINK
    if not isinstance(link, Link):
        raise TypeError(f"link must be None or a sidco_jax.costs.Link, got {link!r}")
    return Link(
        check_number("link.latency", static("link.latency", link.latency), 0.0),
        check_number(
            "link.bandwidth", static("link.bandwidth", link.bandwidth), 0.0, open_low=True
        ),
    )


DEFAULT_LINK = Link()
NODE_LINK = Link(1e-6, 200e9)  # inside a node: NVLink-class, 1 us, 1.6 Tbit/s


class Plan(NamedTuple):
    """Static sizes of a sparse all-reduce of ``k``-slot payloads over ``n`` entries.

    Attributes:
      region: entries each device owns (the last region may be shorter).
      route: slots each device reserves for each region owner.
      reduced: slots of each owner's reduced payload (at least its rule's
        capacity for one region).
    """

    region: int
    route: int
    reduced: int


def plan(size: int, capacity: int, devices: int) -> Plan:
    """The region, routing and reduced sizes of a sparse all-reduce over ``devices``."""
    return Plan(
        region=-(-size // devices),
        route=-(-ROUTE_SLACK * capacity // devices),
        reduced=-(-capacity // devices),
    )


def message_bytes(
    mode: str,
    size: int,
    capacity: int,
    devices: int,
    wire: codecs.Codec = codecs.DEFAULT,
) -> int:
    """Bytes of the sparse message one device sends each other device in ``mode``.

    ``"sparse"``: its payload; ``"sparse_allreduce"``: its slots for one owner
    and, as an owner, its reduced payload, in the wire format ``wire``.
    """
    if mode == "sparse":
        return wire.at(capacity, size).bytes(capacity, size)
    sizes = plan(size, capacity, devices)
    return sum(
        wire.at(slots, sizes.region).bytes(slots, sizes.region)
        for slots in (sizes.route, sizes.reduced)
    )


def received_bytes(
    mode: str,
    size: int,
    capacity: int,
    devices: int,
    shared: bool = False,
    wire: codecs.Codec = codecs.DEFAULT,
) -> float:
    """Bytes one device receives to average the messages in ``mode``.

    Args:
      mode: ``"dense"``, ``"sparse"`` or ``"sparse_allreduce"``.
      size: entries of the dense vector (``n``).
      capacity: payload slots per device (``k``).
      devices: devices along the axis (``P``).
      shared: whether every device's payload has the same indices (then only
        the values are summed, in any mode).
      wire: the wire format of a sparse message's values and indices.

    Returns:
      The bytes (0 on one device).
    """
    p = devices
    if mode == "dense":
        return 2 * (p - 1) / p * VALUE_BYTES * size
    if shared:
        return 2 * (p - 1) / p * VALUE_BYTES * capacity
    return (p - 1) * message_bytes(mode, size, capacity, p, wire)


def rounds(mode: str, devices: int, shared: bool = False) -> int:
    """The messages one device waits for in turn in ``mode``, each paying the link's latency.

    An all-gather is one phase of ``P - 1`` of them; an all-reduce (a reduce-scatter,
    then an all-gather) two. See the module table.
    """
    phases = 1 if mode == "sparse" and not shared else 2
    return phases * (devices - 1)


def seconds(
    mode: str,
    size: int,
    capacity: int,
    devices: int,
    link: Link = DEFAULT_LINK,
    shared: bool = False,
    wire: codecs.Codec = codecs.DEFAULT,
) -> float:
    """Modelled time of one aggregation in ``mode``: latency plus transfer."""
    received = received_bytes(mode, size, capacity, devices, shared, wire)
    return rounds(mode, devices, shared) * link.latency + received / link.bandwidth


def hierarchical_seconds(
    mode: str,
    size: int,
    capacity: int,
    nodes: int,
    local: int,
    outer: Link = DEFAULT_LINK,
    inner: Link = NODE_LINK,
    wire: codecs.Codec = codecs.DEFAULT,
    sharded: bool = False,
) -> float:
    """Modelled time of a dense all-reduce over ``local`` devices, then ``mode`` over ``nodes``.

    Every device of a node compresses the node's mean and takes part in the
    outer collective with its own link (one per device, as in a GPU server
    with one network card per GPU). ``sharded`` (``inner_shards``): a
    reduce-scatter and an all-gather over the node (a ring all-reduce's
    bytes) instead, and each device compresses and sends its slice of the
    node's mean: ``ceil(size / local)`` entries, ``ceil(capacity / local)`` slots.
    It prices a step of sharded parameters (``inner_shards="params"``) too:
    the backward pass's reduce-scatter, and the forward pass's all-gather of
    the parameters in place of the update's.
    """
    slice_size, slots = size, capacity
    if sharded:
        slice_size, slots = -(-size // local), -(-capacity // local)
    outer_seconds = seconds(mode, slice_size, slots, nodes, outer, False, wire)
    return seconds("dense", size, size, local, inner) + outer_seconds


def choose(
    size: int,
    capacity: int,
    devices: int,
    link: Link = DEFAULT_LINK,
    shared: bool = False,
    wire: codecs.Codec = codecs.DEFAULT,
) -> str:
    """The mode :func:`seconds` finds cheapest; ties (one device: all free) go to ``"sparse"``.

    The sparse all-reduce needs at least one entry per device.
    """
    modes = ["sparse", "dense"] + (["sparse_allreduce"] if devices <= size and not shared else [])
    return min(
        modes,
        key=lambda mode: seconds(mode, size, capacity, devices, link, shared, wire),
    )


MODES = ("dense", "sparse", "sparse_allreduce")


def _checked_link(name: str, link) -> Link:
    if not isinstance(link, Link):
        raise TypeError(f"{name} must be a sidco_jax.costs.Link, got {link!r}")
    return check_link(link)


def _checked_wire(name: str, wire) -> codecs.Codec:
    if not isinstance(wire, codecs.Codec):
        raise TypeError(
            f"{name} must be a sidco_jax.costs.Codec, e.g. Codec(values='int8', "
            f"indices='chunked'), got {wire!r}"
        )
    codecs.check(*wire)
    return wire


# How each argument of the public functions is checked: they are called to plan a job,
# with values a person typed; the library's own calls pass values checked at construction.
_CHECKS: dict[str, Callable] = {
    "mode": lambda name, v: check_choice(name, v, MODES) or v,
    "wire": _checked_wire,
    "shared": check_bool,
    "sharded": check_bool,
    **{k: _checked_link for k in ("link", "outer", "inner")},
    **{k: lambda name, v: check_integer(name, v, 1, None) for k in ("size", "capacity")},
    **{k: lambda name, v: check_integer(name, v, 1, None) for k in ("devices", "nodes", "local")},
}


def validated(function: Callable) -> Callable:
    """``function`` with every argument checked first, by name (:data:`_CHECKS`)."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def checked(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = {k: _CHECKS[k](k, v) for k, v in bound.arguments.items()}
        return function(**arguments)

    return checked
