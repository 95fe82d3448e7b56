"""SIDCo's compressor: the statistical threshold as a selection rule, and ``compress``.

The rule fits a sparsity-inducing distribution to the magnitudes of what is to
be sent (:mod:`thresholds`), packs the entries above the threshold into a
fixed-capacity payload (:mod:`payload`), and keeps its own state: the stage
count of the threshold and the controller that adapts it (:mod:`control`).
Error feedback, aggregation and metrics are the shared loop's (:mod:`loop`).
"""

import functools
from typing import NamedTuple, Unpack

import jax
import jax.numpy as jnp
import optax

from sidco_jax._src.base import (
    ADAPTATIONS,
    SLOT_BYTES,
    Adaptation,
    CompressMetrics,
    Estimator,
    check_capacity_factor,
    check_choice,
    check_estimator,
    check_integer,
    check_number,
    check_ratio,
    static,
)
from sidco_jax._src.loop.options import takes_loop_options
from sidco_jax._src.loop.rule import Rule, Selection
from sidco_jax._src.loop.sparsifier import LoopOptions, build
from sidco_jax._src.ops import payload as payload_lib
from sidco_jax._src.rules import control as control_lib
from sidco_jax._src.stats import thresholds

STARTING_STAGES = (
    "is where an adaptation starts, read by init only, so an injected value would change "
    "nothing (adaptation=None makes the count follow it)"
)


class SidcoState(NamedTuple):
    """State of SIDCo's selection rule.

    Attributes:
      stages: int32 stage count of the threshold (traced: changing it never
        recompiles).
      control: the stage controller's state (``optax.EmptyState()`` without
        adaptation).
      scale: float32 log of the factor on the threshold (0 unless
        ``adaptation="fill"``, which moves it every step; traced).
      previous: float32 threshold of the last step, agreed across devices
        (their mean), which ``adaptation="fill"`` tries first; 0 before the
        first step, for the other adaptations and per leaf.
    """

    stages: jax.Array
    control: control_lib.AdaptationState | optax.EmptyState
    scale: jax.Array
    previous: jax.Array


class _Options(NamedTuple):
    """SIDCo's options, checked by :func:`compress`."""

    ratio: float
    estimator: Estimator
    stages: int
    adaptation: Adaptation | None
    first_ratio: float
    capacity_factor: float
    period: int
    band: float
    carry: bool


def rule(
    ratio: float,
    *,
    estimator: Estimator,
    stages: int,
    adaptation: Adaptation | None,
    first_ratio: float,
    capacity_factor: float,
    period: int,
    band: float,
    carry: bool = True,
) -> Rule:
    """SIDCo's :class:`~sidco_jax.Rule` (options as in :func:`compress`, already checked).

    ``carry``: whether ``"fill"`` tries the last step's threshold first (one
    threshold over the whole model; per leaf there are several).
    """
    o = _Options(
        ratio, estimator, stages, adaptation, first_ratio, capacity_factor, period, band, carry
    )
    return Rule(
        functools.partial(_init, o), functools.partial(_select, o), functools.partial(_observe, o)
    )


def _init(o: _Options, params) -> SidcoState:
    del params
    control = control_lib.init() if o.adaptation is not None else optax.EmptyState()
    scale, previous = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)  # two buffers
    return SidcoState(jnp.asarray(o.stages, jnp.int32), control, scale, previous)


def _current(o: _Options, state: SidcoState) -> jax.Array:
    # Fixed, the count is the factory's: an injected stages takes effect.
    return state.stages if o.adaptation is not None else jnp.asarray(o.stages, jnp.int32)


def _select(o: _Options, vectors, abs_sums, state: SidcoState, key) -> Selection:
    del key
    n = sum(v.shape[0] for v in vectors)
    cap = payload_lib.slots_for(n, o.ratio, o.capacity_factor)

    def fitted():
        total = jnp.sum(abs_sums)
        stages = _current(o, state)
        eta = thresholds.from_abs_sum(vectors, total, o.ratio, o.estimator, stages, o.first_ratio)
        return eta * jnp.exp(state.scale)

    if o.adaptation != "fill":
        payload, eta = payload_lib.select_or_top(vectors, fitted(), cap, jnp.sum(abs_sums))
        return Selection(payload, eta, cap * SLOT_BYTES, filled=True)
    previous = state.previous if o.carry else None
    payload, eta = _fill(vectors, jnp.sum(abs_sums), fitted, previous, cap)
    return Selection(payload, eta, cap * SLOT_BYTES, filled=True)


def _observe(o: _Options, state: SidcoState, figures: CompressMetrics) -> SidcoState:
    if o.adaptation is None:
        return state._replace(stages=_current(o, state))
    achieved = jnp.where(figures.nonfinite, 1.0, figures.density / figures.target_density)
    new_stages, control = control_lib.adapt(
        state.stages,
        state.control,
        achieved,
        adaptation=o.adaptation,
        period=o.period,
        band=o.band,
        max_stages=thresholds.stage_limit(o.ratio),
    )
    scale, previous = state.scale, state.previous
    if o.adaptation == "fill":
        if o.carry:
            previous = jnp.where(figures.nonfinite, previous, figures.threshold)
        # The figures are agreed across devices, so the factor is too.
        # Capacity in entries is capacity_factor x target (less its ceil).
        selected = figures.selected_density / (o.capacity_factor * figures.target_density)
        scale = control_lib.fill(state.scale, selected, figures.nonfinite)
    return SidcoState(new_stages, control, scale, previous)


def _fill(vectors, abs_sum, fitted, previous, cap: int):
    """``adaptation="fill"``'s payload of ``cap`` slots and its threshold.

    Whenever 1 to FILL_WIDE x the capacity pass a threshold, the largest of
    them are the exact top-capacity. Under error feedback the last step's
    threshold (``previous``; None where none is carried) often still passes
    that many: then neither the ``fitted()`` threshold nor the bracket runs.
    Otherwise the fit, and around it the highest threshold that fills the
    payload. A step that selects nothing, though there is something to send,
    takes the exact top-capacity instead.
    """
    n = sum(v.shape[0] for v in vectors)
    width = min(control_lib.FILL_WIDE * cap, n)

    def refit():
        # Threshold work, though select_or_top runs it inside its payload (profiles' phases).
        with jax.named_scope("threshold"):
            eta, _ = control_lib.bracket(vectors, fitted(), cap)
        # Carried as float32, as the threshold in hand (float64 under x64 input).
        return eta.astype(jnp.float32)

    def holds(count):
        return (previous > 0) & (count >= cap) & (count <= width)

    if previous is None:
        wide, eta = payload_lib.select_or_top(vectors, refit(), width, abs_sum, k=cap)
    else:
        wide, eta = payload_lib.select_or_top(
            vectors, previous, width, abs_sum, k=cap, refit=(holds, refit)
        )
    return payload_lib.strongest(wide, cap), eta


@takes_loop_options
def compress(
    ratio: float,
    *,
    estimator: Estimator = "exponential",
    stages: int | None = None,
    adaptation: Adaptation | None = "fill",
    first_ratio: float = 0.25,
    capacity_factor: float = 1.0,
    period: int = 5,
    band: float = 0.2,
    **options: Unpack[LoopOptions],
) -> optax.GradientTransformationExtraArgs:
    """SIDCo gradient sparsification with error feedback.

    Args:
      ratio: target density in (0, 1]: the fraction of entries sent per step.
        Static (it sets the payload capacity).
      estimator: ``"exponential"`` (SIDCo-E), ``"gpareto"`` (SIDCo-P) or
        ``"gamma"`` (SIDCo-GP).
      stages: number of threshold stages, in ``[1, max_stages(ratio)]``; by
        default ``min(3, max_stages(ratio))``. With ``adaptation=None`` the
        count on every step (it may be injected, traced); otherwise the count
        the adaptation starts from, read by ``init`` only (static).
      adaptation: how the threshold follows the achieved density:
        ``"fill"`` (default: the paper's stage moves, plus, on the steps
        where the last step's threshold no longer passes 1-4x the capacity, a
        bracket around the fitted threshold; the payload, paid for in full
        every step, then holds the largest entries), ``"paper"`` (the paper's
        rule: every ``period`` steps one stage fewer above ``1 + band`` x
        target, one more below ``1 - band``), ``"directional"`` (reverses
        after a move that did not help) or ``None`` (fixed stages). See
        docs/optax.md for how they compare under error feedback.
      first_ratio: density targeted by the first of several stages, in (0, 1].
      capacity_factor: payload slots per expected entry (>= 1); entries beyond
        the capacity stay in the residual. Static.
      period: steps per adaptation window (the paper's ``Q``), an int in
        ``[1, 2**31 - 1]``.
      band: tolerance of the adaptation around the target (the paper's 0.2),
        in (0, 1).
      **options: the loop's options (:class:`~sidco_jax.typing.LoopOptions`):
        ``granularity``, ``error_feedback``, ``axis_name``,
        ``communication``, ``inner_axis``, ``link``, ``warmup_steps``,
        ``layout`` and ``bucket_bytes``, documented at
        :func:`~sidco_jax.sparsifier`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose update is the
      sparsified gradient (same tree and dtypes as the input).

    Raises:
      TypeError: for an argument of the wrong type: a ratio, factor, count or
        band that is not a real (integer for ``stages`` and ``period``)
        scalar, bools included, or an ``error_feedback`` that is not a bool.
        Concrete NumPy and JAX scalars are accepted.
      ValueError: for a value outside its allowed range (NaN and inf
        included), an unknown name, or a traced ``ratio`` or
        ``capacity_factor`` (they set the payload shape).

    Examples:
      >>> import jax.numpy as jnp, optax, sidco_jax as sidco
      >>> tx = optax.chain(sidco.compress(0.1), optax.sgd(0.1))
      >>> params = {"w": jnp.arange(20.0) - 10.0}
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params)
      >>> int(jnp.count_nonzero(updates["w"]))
      2

    References:
      A. M. Abdelmoniem, A. Elzanaty, M.-S. Alouini and M. Canini, *An
      Efficient Statistical-based Gradient Compression Technique for
      Distributed Training Systems*, MLSys 2021 (arXiv:2101.10761).
    """
    # Concrete NumPy and JAX scalars become Python numbers here, so nothing
    # traced under jit depends on them; traced ones (optax.inject_hyperparams)
    # pass through where they may vary, and are refused where they set a shape.
    capacity_factor = check_capacity_factor(capacity_factor)
    check_estimator(estimator)
    first_ratio = check_ratio(first_ratio, "first_ratio")
    check_choice("adaptation", adaptation, ADAPTATIONS, optional=True)
    if adaptation is not None:
        stages = static("stages", stages, STARTING_STAGES)
    stages = thresholds.check_stages(
        min(3, thresholds.stage_limit(ratio)) if stages is None else stages, ratio
    )
    period = check_integer("period", period, 1)
    band = check_number("band", band, 0.0, 1.0, open_low=True, open_high=True)

    sidco_rule = rule(
        ratio,
        estimator=estimator,
        stages=stages,
        adaptation=adaptation,
        first_ratio=first_ratio,
        capacity_factor=capacity_factor,
        period=period,
        band=band,
        carry=options["granularity"] == "model",
    )
    return build(sidco_rule, ratio, **options)
