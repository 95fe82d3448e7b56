"""Every compressor by name: one table for the examples, benchmarks, tests and users.

Names are as in the docs: ``sidco-e``, ``sidco-p``, ``sidco-gp`` (SIDCo with
the exponential, generalized Pareto and gamma estimators), ``topk``,
``approxk``, ``dgc``, ``gaussiank``, ``redsync``, ``randomk`` and ``dense``.
Adding a compressor is a :class:`~sidco_jax.Rule` run by
:func:`~sidco_jax.sparsifier` in a factory, plus one line here.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any, Unpack

import optax

from sidco_jax._src import baselines
from sidco_jax._src.base import check_choice, check_ratio, static
from sidco_jax._src.options import LoopOptions, takes_loop_options
from sidco_jax._src.sidco import compress

Factory = Callable[..., optax.GradientTransformationExtraArgs]


@takes_loop_options
def _dense(ratio: float, **options: Unpack[LoopOptions]) -> optax.GradientTransformationExtraArgs:
    # Checked like the others', though it sends everything; injecting it would change nothing.
    check_ratio(static("ratio", ratio, "is ignored by 'dense', which sends every entry"))
    return baselines.dense(**options)


FACTORIES: dict[str, Factory] = {
    "sidco-e": functools.partial(compress, estimator="exponential"),
    "sidco-p": functools.partial(compress, estimator="gpareto"),
    "sidco-gp": functools.partial(compress, estimator="gamma"),
    "topk": baselines.topk,
    "approxk": baselines.approxk,
    "dgc": baselines.dgc,
    "gaussiank": baselines.gaussiank,
    "redsync": baselines.redsync,
    "randomk": baselines.randomk,
    "dense": _dense,
}
COMPRESSORS: tuple[str, ...] = tuple(FACTORIES)


def _options(factory: Factory) -> tuple[str, ...]:
    """The keyword options of ``factory``, less those its name already sets."""
    bound = factory.keywords if isinstance(factory, functools.partial) else {}
    return tuple(
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in bound
    )


OPTIONS: dict[str, tuple[str, ...]] = {name: _options(f) for name, f in FACTORIES.items()}


def compressor(name: str, ratio: float, **options: Any) -> optax.GradientTransformationExtraArgs:
    """The compressor called ``name`` at target density ``ratio``.

    Args:
      name: one of :data:`~sidco_jax.COMPRESSORS`.
      ratio: target density in (0, 1] (ignored by ``"dense"``).
      **options: keyword options of that compressor's factory, e.g.
        ``axis_name="data"``.

    Returns:
      The optax transformation.

    Raises:
      ValueError: for an unknown name, listing the known ones (and as the
        factory does for a bad value).
      TypeError: for an option that compressor does not take, listing those
        it takes (and as the factory does for a wrong type).

    Examples:
      >>> import sidco_jax as sidco
      >>> tx = sidco.compressor("sidco-p", 0.01, axis_name="data")
      >>> sidco.COMPRESSORS[:3]
      ('sidco-e', 'sidco-p', 'sidco-gp')
    """
    check_choice("compressor", name, COMPRESSORS)
    unknown = sorted(set(options) - set(OPTIONS[name]))
    if unknown:
        raise TypeError(
            f"compressor {name!r} got unknown options {unknown}; allowed: {OPTIONS[name]}"
        )
    return FACTORIES[name](ratio, **options)
