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
  over-selects: the rule asks for fewer stages, which is impossible).

* ``"fill"``: the paper's stage moves, plus a continuous correction of the
  threshold, updated every step (:func:`fill`): a log-space factor that
  steers the entries selected to a little above the payload's capacity, so
  the fixed payload fills and the overflow stays in the residual. The stage
  count moves in whole stages every ``period`` steps and cannot settle
  between them; the factor can.

Stages stay in ``[1, max_stages]``. All arithmetic is on device, with no
Python branching on values, so a changing stage count never recompiles. The
statistic should be averaged over devices before it gets here, so that every
device takes the same decision.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

RULES = ("paper", "directional", "fill")

# The fill correction (see :func:`fill`): selected entries aimed at AIM x capacity,
# so the payload fills on most steps with the overflow left in the residual.
FILL_AIM = 1.1
# Gain per step on log(selected / aimed), and the clip of that error. Under
# error feedback a threshold factor f changed the count by up to f**-12 (MLP,
# ratio 0.01): a gain of 0.2 flipped it between 0.3x and 3x capacity every
# other step. At most 0.025 per step keeps the loop gain below 1.
FILL_GAIN = 0.05
FILL_STEP = 0.5
FILL_LIMIT = 4.0  # |log factor| <= 4 (x/÷ 55): beyond that the stage count has to move


class StageControl(NamedTuple):
    """State of the stage controller.

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


def init() -> StageControl:
    return StageControl(
        window=jnp.zeros((), jnp.float32),
        steps=jnp.zeros((), jnp.int32),
        error=jnp.full((), jnp.finfo(jnp.float32).max, jnp.float32),  # no window yet
        moved=jnp.zeros((), bool),
        sense=jnp.ones((), jnp.int32),
    )


def adapt(
    stages: jax.Array,
    control: StageControl,
    achieved_over_target: jax.Array,
    *,
    rule: str,
    period: int,
    band: float,
    max_stages: int,
) -> tuple[jax.Array, StageControl]:
    """Records one step and, at the end of a window, moves the stage count.

    Args:
      stages: current int32 stage count.
      control: controller state.
      achieved_over_target: this step's sent density over the target (already
        averaged over devices where there are several).
      rule: ``"paper"``, ``"directional"`` or ``"fill"`` (moves the stages as
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
    if rule == "directional":
        # The last move made things worse: reverse what "more stages" means here.
        sense = jnp.where(decide & control.moved & (error >= control.error), -sense, sense)
    move = jnp.where(mean > 1.0 + band, -1, jnp.where(mean < 1.0 - band, 1, 0)) * sense
    new_stages = jnp.clip(stages + jnp.where(decide, move, 0), 1, max_stages)
    new = StageControl(
        window=jnp.where(decide, 0.0, window),
        steps=jnp.where(decide, 0, steps),
        error=jnp.where(decide, error, control.error),
        moved=jnp.where(decide, move != 0, control.moved),
        sense=sense,
    )
    return new_stages.astype(jnp.int32), new


def fill(log_scale: jax.Array, selected_over_capacity: jax.Array, skip: jax.Array) -> jax.Array:
    """One step of the continuous fill correction: the next log-space threshold factor.

    The threshold is ``eta * exp(log_scale)``. Too many entries selected
    raise it, too few lower it, by :data:`FILL_GAIN` times the clipped error
    ``log(selected / (FILL_AIM * capacity))``; on a skipped (non-finite) step
    it stays. Device-agreed when its input is.

    Args:
      log_scale: float32 log of the current factor.
      selected_over_capacity: entries above the threshold over the payload's
        capacity (summed over devices where there are several).
      skip: the step is not to be learned from.

    Returns:
      The new float32 ``log_scale``, in ``[-FILL_LIMIT, FILL_LIMIT]``.
    """
    error = jnp.log(jnp.maximum(selected_over_capacity, 1e-6) / FILL_AIM)
    step = FILL_GAIN * jnp.clip(error, -FILL_STEP, FILL_STEP)
    new = jnp.clip(log_scale + step, -FILL_LIMIT, FILL_LIMIT)
    return jnp.where(skip, log_scale, new).astype(jnp.float32)
