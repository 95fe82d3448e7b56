"""What a selection rule is to the loop: its functions, and the :class:`Selection` it returns.

A compressor is a :class:`Rule` (what to send) run inside the loop of
:func:`sidco_jax.sparsifier` (error feedback, aggregation, the non-finite gate,
metrics). A rule owns its state, as an optax transformation does:
``optax.EmptyState()`` when it has none.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import optax

from sidco_jax._src.base import CompressMetrics
from sidco_jax._src.ops.payload import Payload


class Selection(NamedTuple):
    """What a rule chose to send from one group of float32 vectors.

    Attributes:
      payload: the entries to send, indexed over the concatenation of the
        group's vectors; None sends every entry (no compression).
      threshold: the magnitude threshold used (0 where the rule has none).
      bytes: static size of the message in bytes.
      shared: whether the indices are the same on every device (then only the
        values need to travel).
      filled: whether the rule fills a starved payload itself (otherwise the
        loop does: :func:`~sidco_jax._src.loop.selection.fill_if_starved`).
    """

    payload: Payload | None
    threshold: jax.Array
    bytes: int
    shared: bool = False
    filled: bool = False


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
