"""Every compressor by name: one table for the examples, benchmarks, tests and users.

Names are as in the docs: ``sidco-e``, ``sidco-p``, ``sidco-gp`` (SIDCo with
the exponential, generalized Pareto and gamma estimators), ``topk``, ``dgc``,
``gaussiank``, ``redsync``, ``randomk`` and ``dense``. Adding a compressor is a
:class:`~sidco_jax.Rule` run by :func:`~sidco_jax.sparsifier` in a factory,
plus one line here.
"""

import functools
from collections.abc import Callable
from typing import Any

import optax

from sidco_jax._src import baselines
from sidco_jax._src.sidco import compress

Factory = Callable[..., optax.GradientTransformationExtraArgs]


def _dense(ratio: float, **options: Any) -> optax.GradientTransformationExtraArgs:
    del ratio  # sends everything
    return baselines.dense(**options)


FACTORIES: dict[str, Factory] = {
    "sidco-e": functools.partial(compress, estimator="exponential"),
    "sidco-p": functools.partial(compress, estimator="gpareto"),
    "sidco-gp": functools.partial(compress, estimator="gamma"),
    "topk": baselines.topk,
    "dgc": baselines.dgc,
    "gaussiank": baselines.gaussiank,
    "redsync": baselines.redsync,
    "randomk": baselines.randomk,
    "dense": _dense,
}
COMPRESSORS: tuple[str, ...] = tuple(FACTORIES)


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
      ValueError: for an unknown name, listing the known ones.

    Examples:
      >>> import sidco_jax as sidco
      >>> tx = sidco.compressor("sidco-p", 0.01, axis_name="data")
      >>> sidco.COMPRESSORS[:3]
      ('sidco-e', 'sidco-p', 'sidco-gp')
    """
    if name not in FACTORIES:
        raise ValueError(f"compressor must be one of {COMPRESSORS}, got {name!r}")
    return FACTORIES[name](ratio, **options)
