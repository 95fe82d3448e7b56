"""Adapting SIDCo's stage count to keep the achieved density on target.

The best stage count depends on the data, and under error feedback the law of
what is thresholded drifts step by step. Every ``period`` steps the controller
looks at the mean of ``achieved / target`` over the window:

* ``"paper"`` (the reference code): above ``1 + band`` one stage fewer, below
  ``1 - band`` one stage more.
* ``"directional"``: the same moves, but the direction flips whenever a
  move (also one blocked at a bound) did not lower the error
  ``|log(achieved / target)|`` of the next window, because more stages lower
  the count on some data and raise it on other. With the count-targeting
  later stages of :func:`sidco_jax.threshold`, more stages move the density
  towards the target from either side, so the paper's fixed direction can
  get stuck at one stage (for example a heavy-tailed gradient that one stage
  over-selects: the paper asks for fewer stages, which is impossible).

* ``"fill"``: the paper's stage moves, plus two corrections of the threshold
  so that the fixed payload fills and the overflow stays in the residual.
  Within each step, :func:`bracket` moves the fitted threshold to the
  highest one near it that still selects the capacity (two counting passes;
  SIDCo's selection first tries the last step's threshold, and fits and brackets
  only where it no longer passes 1 to ``FILL_WIDE`` x the capacity).
  Across steps, :func:`fill` keeps a device-agreed log-space factor on the
  fitted threshold that re-centres the bracket when a step could not fill
  the payload, or selected far more than it holds.

Stages stay in ``[1, max_stages]``. All arithmetic is on device, with no
Python branching on values, so a changing stage count never recompiles. The
statistic should be averaged over devices before it gets here, so that every
device takes the same decision.
"""

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sidco_jax._src.ops import passes

# The fill correction. Within a step (:func:`bracket`): BRACKET thresholds from
# eta / BRACKET_SPAN to eta x BRACKET_SPAN, then as many between the chosen one
# and the next; a few more counts in one pass cost little (docs/design.md).
BRACKET = 9
BRACKET_SPAN = 2.0
# Across steps (:func:`fill`): the factor stays while the selection fills the
# payload without passing FILL_OVER x its capacity. An aim inside that band
# would fight the bracket, which always selects at least the capacity where it
# can. Gain per step on the log of the miss, and the clip of that log.
FILL_OVER = 4.0
# Slots of the wide selection whose largest entries fill the payload: the first
# entries in index order would leave the later leaves waiting in the residual.
FILL_WIDE = 4
FILL_GAIN = 0.05
FILL_STEP = 0.5
FILL_LIMIT = 4.0  # |log factor| <= 4 (x/÷ 55): beyond that the stage count has to move


class AdaptationState(NamedTuple):
    """State of the stage-count adaptation (``adaptation=`` of :func:`sidco_jax.compress`).

    Attributes:
      window: sum of ``achieved / target`` over the current window.
      steps: steps in the current window.
      error: ``|log(mean achieved / target)|`` of the previous window.
      moved: whether the previous window asked for a move (even a blocked one).
      sense: +1 or -1: multiplies the paper's move (flipped by ``"directional"``).
    """

    window: jax.Array
    steps: jax.Array
    error: jax.Array
    moved: jax.Array
    sense: jax.Array


def init() -> AdaptationState:
    return AdaptationState(
        window=jnp.zeros((), jnp.float32),
        steps=jnp.zeros((), jnp.int32),
        error=jnp.full((), jnp.finfo(jnp.float32).max, jnp.float32),  # no window yet
        moved=jnp.zeros((), bool),
        sense=jnp.ones((), jnp.int32),
    )


def adapt(
    stages: jax.Array,
    control: AdaptationState,
    achieved_over_target: jax.Array,
    *,
    adaptation: str,
    period: int,
    band: float,
    max_stages: int,
) -> tuple[jax.Array, AdaptationState]:
    """Records one step and, at the end of a window, moves the stage count.

    Args:
      stages: current int32 stage count.
      control: controller state.
      achieved_over_target: this step's sent density over the target (already
        averaged over devices where there are several).
      adaptation: ``"paper"``, ``"directional"`` or ``"fill"`` (moves the stages as
        ``"paper"`` does; its factor is :func:`fill`'s).
      period: steps per window (the paper's ``Q = 5``).
      band: tolerance around 1 (the paper's 0.2).
      max_stages: upper clamp of the stage count.

    Returns:
      The new stage count and controller state.
    """
    window = control.window + achieved_over_target
    steps = control.steps + 1
    decide = steps >= period
    mean = window / steps.astype(jnp.float32)
    error = jnp.abs(jnp.log(jnp.maximum(mean, 1e-6)))
    sense = control.sense
    if adaptation == "directional":
        # The last move made things worse: reverse what "more stages" means here.
        sense = jnp.where(decide & control.moved & (error >= control.error), -sense, sense)
    move = jnp.where(mean > 1.0 + band, -1, jnp.where(mean < 1.0 - band, 1, 0)) * sense
    new_stages = jnp.clip(stages + jnp.where(decide, move, 0), 1, max_stages)
    new = AdaptationState(
        window=jnp.where(decide, 0.0, window),
        steps=jnp.where(decide, 0, steps),
        error=jnp.where(decide, error, control.error),
        moved=jnp.where(decide, move != 0, control.moved),
        sense=sense,
    )
    return new_stages.astype(jnp.int32), new


def fill(log_scale: jax.Array, selected_over_capacity: jax.Array, skip: jax.Array) -> jax.Array:
    """One step of the fill factor: the next log-space factor on the fitted threshold.

    The bracket searches around ``eta * exp(log_scale)``. A step that selected
    fewer entries than the capacity lowers the factor, by :data:`FILL_GAIN`
    times the clipped ``log(selected / capacity)``; one that selected more
    than :data:`FILL_OVER` times the capacity raises it, by the same gain on
    ``log(selected / (FILL_OVER * capacity))``. In between, and on a skipped
    (non-finite) step, it stays. Device-agreed when its input is.

    Args:
      log_scale: float32 log of the current factor.
      selected_over_capacity: entries above the threshold over the payload's
        capacity (summed over devices where there are several).
      skip: the step is not to be learned from.

    Returns:
      The new float32 ``log_scale``, in ``[-FILL_LIMIT, FILL_LIMIT]``.
    """
    miss = jnp.log(jnp.maximum(selected_over_capacity, 1e-6))
    error = jnp.minimum(miss, 0.0) + jnp.maximum(miss - jnp.log(FILL_OVER), 0.0)
    step = FILL_GAIN * jnp.clip(error, -FILL_STEP, FILL_STEP)
    new = jnp.clip(log_scale + step, -FILL_LIMIT, FILL_LIMIT)
    return jnp.where(skip, log_scale, new).astype(jnp.float32)


def bracket(
    vectors: Sequence[jax.Array], eta: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """The highest threshold near ``eta`` that still fills the payload, in two counting passes.

    Under error feedback the residual piles many entries up at about the same
    magnitude, so the count can jump from a half to twice the capacity while
    the threshold moves by 3%: a correction learned over steps cannot follow
    that, and no threshold hits the capacity exactly. An empty slot is paid
    for and carries nothing, while an entry over the capacity merely stays in
    the residual, so each step takes the highest threshold whose count is at
    least the capacity: among :data:`BRACKET` geometrically spaced ones from
    ``eta / BRACKET_SPAN`` to ``eta * BRACKET_SPAN`` (one pass), then among as
    many between that one and the next (a second pass). Where even the lowest
    selects too few, the lowest. Local to the device, like the count.

    Args:
      vectors: the 1-D float vectors the threshold applies to.
      eta: the fitted (and factored) scalar threshold, >= 0.
      capacity: the payload's slots.

    Returns:
      The float32 threshold, within a factor ``BRACKET_SPAN`` of ``eta``, and
      the int32 count of entries above it.
    """
    eta = jnp.asarray(eta, jnp.float32)
    # 0, 1/8, ..., 1 from an iota, which fuses (a constant is copied in on a TPU).
    steps = jnp.arange(BRACKET, dtype=jnp.float32) / (BRACKET - 1)
    low, high, after = eta / BRACKET_SPAN, eta * BRACKET_SPAN, eta
    for _ in range(2):
        # From low to high (x**0 and x**1 exact); 0 stays 0.
        low, high = jnp.where(eta > 0, low, eta), jnp.where(eta > 0, high, eta)
        candidates = jnp.where(eta > 0, low * (high / low) ** steps, eta)
        counts = passes.counts_above(vectors, candidates, after)
        # Counts fall along the candidates: the last one still filling the payload (else
        # the first), and the next. Reductions, not indexing: fewer kernels on a TPU.
        fills = counts >= capacity
        low, high = (
            jnp.max(jnp.where(fills, candidates, low)),
            jnp.min(jnp.where(fills | (jnp.arange(BRACKET) == 0), low * (high / low), candidates)),
        )
        count = jnp.min(jnp.where(fills, counts, counts[0]))
        after = counts[0].astype(jnp.float32)
    return low, count
