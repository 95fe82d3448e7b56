"""Types and argument checks shared by every stage of the pipeline.

Nothing here computes: every family of ``sidco_jax/_src`` imports its option
types, its validators and the states it exchanges from this one place, so no
stage imports a later one just to check an argument. What a rule is to the loop
is in ``loop/rule.py``.
"""

import math
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

Adaptation = Literal["paper", "directional", "fill"]
Estimator = Literal["exponential", "gpareto", "gamma"]
Granularity = Literal["model", "leaf"]
Communication = Literal["auto", "sparse", "dense", "sparse_allreduce"]
AxisName = str | tuple[str, ...]  # a mesh axis name or a tuple of them

ADAPTATIONS: tuple[str, ...] = get_args(Adaptation)
COMMUNICATIONS: tuple[str, ...] = get_args(Communication)
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
GRANULARITIES: tuple[str, ...] = get_args(Granularity)

INT32_MAX = 2**31 - 1
MAX_SIZE = INT32_MAX  # int32 indices, with ``size`` itself as the padding index
VALUE_BYTES = 4  # float32 on the wire
INDEX_BYTES = 4  # int32
SLOT_BYTES = VALUE_BYTES + INDEX_BYTES


class CompressMetrics(NamedTuple):
    """Figures of the last step (see :func:`sidco_jax.metrics`).

    Attributes:
      target_density: the ``ratio`` asked for.
      density: fraction of the entries sent.
      selected_density: fraction of the entries above the threshold, before
        the capacity cut.
      threshold: magnitude threshold (one per leaf with ``granularity="leaf"``).
      overflow: entries above the threshold that did not fit and stayed in the
        residual.
      bytes: bytes of one message (fixed-capacity values + int32 indices).
      nonfinite: whether the step met a non-finite gradient and sent nothing.
      dropped: non-finite residual entries set to zero this step (over all
        devices): what a NaN or an infinity in the state cost.
    """

    target_density: jax.Array
    density: jax.Array
    selected_density: jax.Array
    threshold: jax.Array
    overflow: jax.Array
    bytes: jax.Array
    nonfinite: jax.Array
    dropped: jax.Array


class CompressState(NamedTuple):
    """State of every compressor built by :func:`sidco_jax.sparsifier`.

    Attributes:
      residual: this device's float32 error-feedback residual: in the tree
        layout a tree like the parameters (each floating-point leaf's shape,
        at least 1-D; a zero-size vector for other leaves), in the bucketed
        layout a ``Buckets`` of flat vectors; None without error feedback. Per
        device: under ``jax.shard_map`` its partition spec is
        ``P(axis_name)`` (see :func:`sidco_jax.parallel.state_specs`).
      count: int32 number of steps taken, saturating at ``2**31 - 1``
        (:func:`next_count`).
      last: :class:`CompressMetrics` of the last step.
      rule: the selection rule's own state (``optax.EmptyState()`` if none).
    """

    residual: jax.Array
    count: jax.Array
    last: CompressMetrics
    rule: Any


def next_count(count: jax.Array) -> jax.Array:
    """``count + 1`` for an int32 step count, saturating at ``2**31 - 1``.

    Wrapped to ``-2**31``, the count would start a warm-up over again; held
    at its largest value, it stays past every warm-up (``warmup_steps`` is at
    most ``2**31 - 1``). The random key of a step, folded from the count,
    repeats from then on.
    """
    return count + (count < INT32_MAX).astype(count.dtype)


def cond_on_device(pred, true_fn, false_fn):
    """``lax.cond(pred, true_fn, false_fn, None)`` for a ``pred`` that may differ across devices.

    Under ``shard_map`` both branches must give outputs that vary across the
    same devices; ``where(pred, x, x)`` is ``x``, typed to vary as ``pred``
    does (a replicated or constant output of one branch would not).
    """

    def varying(fn):
        return lambda _: jax.tree.map(lambda x: jnp.where(pred, x, x), fn())

    return jax.lax.cond(pred, varying(true_fn), varying(false_fn), None)


def zeros_as(struct: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``struct``'s shape and dtype, varying across the devices it varies across.

    Under ``shard_map`` a ``lax.cond`` branch made of constants must match the
    other branch's outputs, which vary where they hold each device's own
    entries (the shards of sharded parameters, say).
    """
    zeros = jnp.zeros(struct.shape, struct.dtype)
    axes = getattr(getattr(struct, "manual_axis_type", None), "varying", ())
    return jax.lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def platform_of(tree) -> str:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) the arrays of ``tree`` are for.

    Not simply ``jax.default_backend()``: a program may be built for other
    devices than the host's default ones (a TPU program compiled on a CPU host
    from a ``jax.experimental.topologies`` mesh, with libtpu and no TPU; arrays
    placed on a GPU by a process whose default is the CPU). So, in order: the
    devices of the first leaf that names them through its sharding (a
    concrete array, a ``jax.ShapeDtypeStruct`` with a sharding, or a tracer
    whose type carries a mesh: an input of ``jax.shard_map``, or a sharded
    input of ``jax.jit``); the abstract mesh in context (``jax.shard_map``,
    ``jax.set_mesh``); and only then the default backend.
    """
    for leaf in jax.tree.leaves(tree):
        platform = _leaf_platform(leaf)
        if platform is not None:
            return platform
    device = jax.sharding.get_abstract_mesh().abstract_device
    return jax.default_backend() if device is None else device.platform


def _leaf_platform(leaf) -> str | None:
    """The platform ``leaf``'s sharding names, or None (no sharding, or a mesh without devices)."""
    if isinstance(leaf, jax.core.Tracer):
        sharding = getattr(jax.typeof(leaf), "sharding", None)
    else:
        sharding = getattr(leaf, "sharding", None)  # arrays and shape structs
    if sharding is None:
        return None
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):  # a tracer's type, or an abstract struct
        device = mesh.abstract_device
        return None if device is None else device.platform
    return next(iter(sharding.device_set)).platform


def k_of(n: int, ratio: float) -> int:
    """``max(floor(n * ratio), 1)``: the entries a target density asks for."""
    return max(math.floor(n * ratio), 1)


def is_float(leaf) -> bool:
    """Whether a gradient leaf takes part in compression (floating-point dtype)."""
    return jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)


class StaticOptionError(ValueError):
    """An option that cannot vary was traced; ``name`` names it."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def static(name: str, value, why: str = "sets the payload shape and must be static"):
    """Returns ``value``, or raises a clear error if an option that cannot vary is traced.

    ``why`` says what the option does that a traced value could not: by
    default, set a shape.

    Raises:
      StaticOptionError: a ``ValueError`` naming the option, where it is traced.
    """
    if isinstance(value, jax.core.Tracer):
        listed = tuple(dict.fromkeys(("ratio", "capacity_factor", name)))
        raise StaticOptionError(
            name,
            f"{name} {why}; with optax.inject_hyperparams list it in static_args, "
            f"e.g. static_args={listed}",
        )
    return value


def _shown(bound) -> str | None:
    """A bound as the error shows it: ``2**31 - 1`` for 2147483647, ``0.5`` for 0.5."""
    if isinstance(bound, int) and bound > 2**16 and (bound + 1) & bound == 0:
        return f"2**{bound.bit_length()} - 1"
    return bound if bound is None or isinstance(bound, int) else f"{bound:g}"


def _bounds(low, high, open_low: bool, open_high: bool) -> str:
    """The allowed range in words: ``"in (0, 1]"``, ``">= 1"``, ``"<= 9"`` or ``""`` (any)."""
    low, high = _shown(low), _shown(high)
    if low is not None and high is not None:
        return f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        return f"{'>' if open_low else '>='} {low}"
    if high is not None:
        return f"{'<' if open_high else '<='} {high}"
    return ""


def check_scalar(name: str, value, allowed: str = "a real number", integer: bool = False) -> None:
    """Raises ``TypeError`` unless ``value`` is a real (``integer``: integer) scalar.

    A scalar is a Python number or a 0-d NumPy or JAX array, concrete or
    traced; never a bool. Only the type is read: no device transfer.
    ``allowed`` describes the accepted values in the error.
    """
    if isinstance(value, jax.core.Tracer):
        shape, dtype, shown = value.shape, value.dtype, f"a traced {value.dtype}{list(value.shape)}"
    elif isinstance(value, int | float) and not isinstance(value, bool):
        shape, dtype, shown = (), np.dtype(type(value)), repr(value)
    else:
        is_array = isinstance(value, np.ndarray | np.generic | jax.Array)
        shape, dtype = (np.shape(value), value.dtype) if is_array else (None, None)
        shown = f"{value!r} ({type(value).__name__})"
    if shape != () or not (
        jnp.issubdtype(dtype, jnp.integer) or (not integer and jnp.issubdtype(dtype, jnp.floating))
    ):
        raise TypeError(f"{name} must be {allowed}, got {shown}")


def check_number(
    name: str,
    value,
    low: float | None = None,
    high: float | None = None,
    *,
    open_low: bool = False,
    open_high: bool = False,
    integer: bool = False,
    context: str = "",
):
    """``value`` as a finite Python ``float`` (``int`` if ``integer``) in its range.

    A traced value's type is checked (:func:`check_scalar`) and the tracer
    returned: its range can only be checked on device.

    Raises:
      TypeError: unless ``value`` is a real (integer) scalar: not a string,
        bool, list, None, complex, an array with axes, or a float where an
        integer is needed.
      ValueError: for a concrete value outside ``[low, high]`` (open ends as
        given) or not finite.
    """
    kind = "an integer" if integer else "a real number"
    bounds = _bounds(low, high, open_low, open_high)
    check_scalar(name, value, " ".join(filter(None, [kind, bounds])) + context, integer)
    if isinstance(value, jax.core.Tracer):
        return value
    try:
        number = int(value) if integer else float(value)
    except OverflowError:  # a Python int beyond the float range
        number = math.inf
    if not (
        (low is None or (number > low if open_low else number >= low))
        and (high is None or (number < high if open_high else number <= high))
        and math.isfinite(number)
    ):
        if integer:
            allowed = f"{kind} {bounds}"
        elif high is None and not math.isfinite(number):  # no bound that excludes it
            allowed = " and ".join(filter(None, ["finite", bounds]))
        else:
            allowed = bounds
        raise ValueError(f"{name} must be {allowed}{context}, got {number!r}")
    return number


def check_integer(
    name: str, value, low: int | None = None, high: int | None = INT32_MAX, context: str = ""
):
    """``value`` as a Python ``int`` in ``[low, high]``, or a traced integer unchanged.

    ``high`` defaults to ``2**31 - 1``: counts, periods and sizes meet int32
    arrays on device (a step count, a shape), where a larger one would fail
    at the first update with JAX's ``OverflowError`` naming no argument.
    ``high=None`` leaves the value unbounded (one that never reaches a device).

    Raises:
      TypeError: unless ``value`` is an integer scalar (never a bool).
      ValueError: for a concrete value outside ``[low, high]``.
    """
    return check_number(name, value, low, high, integer=True, context=context)


def check_ratio(ratio, name: str = "ratio"):
    """``ratio`` as a Python ``float`` in (0, 1], or a traced real scalar unchanged.

    Raises:
      TypeError: unless ``ratio`` is a real scalar (never a bool).
      ValueError: for a concrete value outside (0, 1] (NaN included).
    """
    return check_number(name, ratio, 0.0, 1.0, open_low=True)


def check_capacity_factor(capacity_factor) -> float:
    """``capacity_factor`` as a Python ``float``: finite, ``>= 1`` and static.

    Raises:
      TypeError: unless it is a real scalar (never a bool).
      ValueError: if it is traced, below 1 or not finite.
    """
    return check_number("capacity_factor", static("capacity_factor", capacity_factor), 1.0)


def check_bool(name: str, value) -> bool:
    """``value`` as a Python ``bool``; raises ``TypeError`` unless it is one (or ``np.bool_``)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")
    return bool(value)


SEED_MAX = 2**32 - 1  # without x64, JAX folds larger and negative seeds onto these


def check_seed(seed):
    """``seed`` as a Python ``int`` in ``[0, 2**32 - 1]``, or a traced integer unchanged.

    Raises:
      TypeError: unless ``seed`` is an integer scalar (never a bool).
      ValueError: for a concrete seed out of range.
    """
    return check_integer("seed", seed, 0, SEED_MAX)


def check_transformation(name: str, tx) -> None:
    """Raises ``TypeError`` unless ``tx`` is an optax ``GradientTransformation``."""
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (init and update), got "
            f"{type(tx).__name__}: pass e.g. optax.sgd(0.1), or sidco.compress(...) as compressor"
        )


def check_choice(name: str, value, allowed: tuple[str, ...], optional: bool = False) -> None:
    """Raises ``ValueError`` unless ``value`` is one of ``allowed`` (or None if ``optional``)."""
    if not ((optional and value is None) or (isinstance(value, str) and value in allowed)):
        raise ValueError(
            f"{name} must be {'None or ' if optional else ''}one of {allowed}, got {value!r}"
        )


def check_estimator(estimator) -> None:
    """Raises ``ValueError`` for an unknown estimator name."""
    check_choice("estimator", estimator, ESTIMATORS)


def float_vectors(x, caller: str) -> list[jax.Array]:
    """The leaves of the pytree ``x`` flattened to 1-D.

    Raises:
      TypeError: if a leaf is not a floating-point array.
    """
    leaves = [jnp.ravel(jnp.asarray(leaf)) for leaf in jax.tree.leaves(x)]
    for leaf in leaves:
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"{caller}: x must be floating-point arrays (or a pytree of them), got {leaf.dtype}"
            )
    return leaves


def axis_names(axis_name) -> tuple:
    """``axis_name`` as a tuple of names."""
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)
