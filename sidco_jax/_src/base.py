"""Types and argument checks shared by every stage of the pipeline.

Nothing here computes: the pipeline's modules (``thresholds``, ``payload``,
``aggregate``, ``loop``, ``sidco``, ``baselines``) import their option types,
their validators and the states they exchange from this one place, so no stage
imports a later one just to check an argument.

A compressor is a :class:`Rule` (what to send) run inside the loop of
:func:`sidco_jax.sparsifier` (error feedback, aggregation, the non-finite gate,
metrics). A rule owns its state, as an optax transformation does:
``optax.EmptyState()`` when it has none.
"""

import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple, Protocol, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax

Estimator = Literal["exponential", "gpareto", "gamma"]
Granularity = Literal["model", "leaf"]
Communication = Literal["auto", "sparse", "dense"]
AxisName = str | tuple[str, ...]  # a mesh axis name or a tuple of them

ESTIMATORS: tuple[str, ...] = get_args(Estimator)
GRANULARITIES: tuple[str, ...] = get_args(Granularity)
MODES: tuple[str, ...] = get_args(Communication)

MAX_SIZE = 2**31 - 1  # int32 indices, with ``size`` itself as the padding index
VALUE_BYTES = 4  # float32 on the wire
INDEX_BYTES = 4  # int32
SLOT_BYTES = VALUE_BYTES + INDEX_BYTES


class Payload(NamedTuple):
    """A fixed-size sparse representation of the entries above a threshold.

    Attributes:
      values: ``(capacity,)`` selected values in index order, then zeros.
      indices: ``(capacity,)`` int32 positions in the flattened input; padding
        slots hold the input size (out of range, dropped by :func:`densify`).
      count: int32 number of filled slots, ``min(selected, capacity)``.
      selected: int32 number of entries above the threshold.
    """

    values: jax.Array
    indices: jax.Array
    count: jax.Array
    selected: jax.Array

    @property
    def overflow(self) -> jax.Array:
        """Entries above the threshold that did not fit (left for the residual)."""
        return self.selected - self.count


class Selection(NamedTuple):
    """What a rule chose to send from one group of float32 vectors.

    Attributes:
      payload: the entries to send, indexed over the concatenation of the
        group's vectors; None sends every entry (no compression).
      threshold: the magnitude threshold used (0 where the rule has none).
      bytes: static size of the message in bytes.
      shared: whether the indices are the same on every device (then only the
        values need to travel).
    """

    payload: Payload | None
    threshold: jax.Array
    bytes: int
    shared: bool = False


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
      nonfinite: whether the step met a non-finite value and sent nothing.
    """

    target_density: jax.Array
    density: jax.Array
    selected_density: jax.Array
    threshold: jax.Array
    overflow: jax.Array
    bytes: jax.Array
    nonfinite: jax.Array


class CompressState(NamedTuple):
    """State of every compressor built by :func:`sidco_jax.sparsifier`.

    Attributes:
      residual: this device's float32 error-feedback residual: a tree like the
        parameters (each floating-point leaf's shape, at least 1-D; a
        zero-size vector for other leaves), None without error feedback. Per
        device: under ``jax.shard_map`` its partition spec is
        ``P(axis_name)`` (see :func:`sidco_jax.state_specs`).
      count: int32 number of steps taken.
      last: :class:`CompressMetrics` of the last step.
      rule: the selection rule's own state (``optax.EmptyState()`` if none).
    """

    residual: jax.Array
    count: jax.Array
    last: CompressMetrics
    rule: Any


class RuleInitFn(Protocol):
    """Initial state of a rule for the given parameters."""

    def __call__(self, params: optax.Params) -> Any: ...


class SelectFn(Protocol):
    """Chooses what to send from ``vectors``, 1-D float32 arrays.

    ``abs_sums`` holds ``sum(|v|)`` of each vector (already computed by the
    loop, which needs it to detect non-finite steps); ``key`` is this step's
    random key, the same on every device.
    """

    def __call__(
        self, vectors: Sequence[jax.Array], abs_sums: jax.Array, state: Any, key: jax.Array
    ) -> Selection: ...


class ObserveFn(Protocol):
    """The rule's next state, from its state and the step's agreed figures."""

    def __call__(self, state: Any, figures: CompressMetrics) -> Any: ...


def no_observation(state: Any, figures: CompressMetrics) -> Any:
    """An :class:`ObserveFn` for rules whose state does not follow the figures."""
    del figures
    return state


class Rule(NamedTuple):
    """A selection rule: what :func:`sidco_jax.sparsifier` runs on each step.

    Attributes:
      init: ``init(params) -> state``.
      select: ``select(vectors, abs_sums, state, key) -> Selection``.
      observe: ``observe(state, figures) -> state``, after every step.
    """

    init: RuleInitFn
    select: SelectFn
    observe: ObserveFn = no_observation


def empty_init(params: optax.Params) -> optax.EmptyState:
    """A :class:`RuleInitFn` for rules without state."""
    del params
    return optax.EmptyState()


def k_of(n: int, ratio: float) -> int:
    """``max(floor(n * ratio), 1)``: the entries a target density asks for."""
    return max(math.floor(n * ratio), 1)


def is_float(leaf) -> bool:
    """Whether a gradient leaf takes part in compression (floating-point dtype)."""
    return jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating)


def concrete(value):
    """``value`` as a NumPy array, or None if traced (``optax.inject_hyperparams``)."""
    return None if isinstance(value, jax.core.Tracer) else np.asarray(value)


def static(name: str, value):
    """Returns ``value``, or raises a clear error if a shape-setting option is traced."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} sets the payload shape and must be static; with optax.inject_hyperparams "
            f"list it in static_args, e.g. static_args=('ratio', 'capacity_factor')"
        )
    return value


def check_ratio(ratio, name: str = "ratio") -> None:
    """Raises ``ValueError`` unless a concrete ``ratio`` lies in (0, 1]."""
    if isinstance(ratio, jax.core.Tracer):
        return
    value = float(ratio)
    if not 0.0 < value <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be in (0, 1], got {ratio!r}")


def check_capacity_factor(capacity_factor) -> None:
    """Raises ``ValueError`` unless ``capacity_factor >= 1``."""
    if not static("capacity_factor", capacity_factor) >= 1.0:  # also rejects NaN
        raise ValueError(f"capacity_factor must be >= 1, got {capacity_factor!r}")


def check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
    """Raises ``ValueError`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_estimator(estimator) -> None:
    """Raises ``ValueError`` for an unknown estimator name."""
    check_choice("estimator", estimator, ESTIMATORS)


def check_mode(mode) -> None:
    """Raises ``ValueError`` unless ``mode`` is one of :data:`MODES`."""
    check_choice("communication", mode, MODES)


def check_integer(name: str, value, low: int, high: int | None, context: str = "") -> None:
    """Raises ``ValueError`` unless a concrete ``value`` is an integer in ``[low, high]``."""
    v = concrete(value)
    if v is not None and not (
        v.shape == ()
        and np.issubdtype(v.dtype, np.integer)
        and low <= v
        and (high is None or v <= high)
    ):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {allowed}{context}, got {value!r}")


def check_axis(axis_name, communication: str = "auto") -> None:
    """Validates ``axis_name`` and ``communication`` (raises ``ValueError``)."""
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not (names and all(isinstance(a, str) for a in names)):
        raise ValueError(
            f"axis_name must be None, a mesh axis name or a tuple of them, got {axis_name!r}"
        )
    check_mode(communication)


def check_common(ratio, capacity_factor, granularity) -> None:
    """Validates the options every sparsifier shares (raises ``ValueError``)."""
    check_ratio(static("ratio", ratio))
    check_capacity_factor(capacity_factor)
    check_choice("granularity", granularity, GRANULARITIES)
