"""Every compressor by name: one table for the examples, benchmarks, tests and users.

Names are as in the docs: ``sidco-e``, ``sidco-p``, ``sidco-gp`` (SIDCo with
the exponential, generalized Pareto and gamma estimators), ``topk``,
``approxk``, ``dgc``, ``gaussiank``, ``redsync``, ``randomk`` and ``dense``.
Adding a compressor is a :class:`~sidco_jax.Rule` run by
:func:`~sidco_jax.sparsifier` in a factory, plus one line in :data:`REGISTRY`
with its :class:`Traits`: tests, docs checks and benchmarks pick compressors by
their traits, so they cover it.
"""

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Unpack

import optax

from sidco_jax._src.base import check_choice, check_ratio, static
from sidco_jax._src.loop.sparsifier import LoopOptions
from sidco_jax._src.rules import baselines
from sidco_jax._src.rules.sidco import compress

Factory = Callable[..., optax.GradientTransformationExtraArgs]


def _dense(ratio: float, **options: Unpack[LoopOptions]) -> optax.GradientTransformationExtraArgs:
    # Checked like the others', though it sends everything; injecting it would change nothing.
    check_ratio(static("ratio", ratio, "is ignored by 'dense', which sends every entry"))
    return baselines.dense(**options)


_dense.__signature__ = inspect.signature(baselines.dense).replace(
    parameters=[
        inspect.Parameter("ratio", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *inspect.signature(baselines.dense).parameters.values(),
    ]
)


class Traits(NamedTuple):
    """What a compressor is, for code that picks compressors by kind rather than by name.

    Attributes:
      kind: its kind of selection rule: ``"fit"`` (SIDCo's estimated threshold),
        ``"top-k"``, ``"sample"`` (a threshold from a random sample), ``"search"``
        (a threshold searched for by counting), ``"correction"`` (a closed-form
        threshold, corrected by counting), ``"random"`` or ``"none"`` (every entry).
      indices: how the receivers learn which entries were sent: ``"sent"`` (the
        payload carries them, so the wire formats and the ``communication`` modes
        apply), ``"shared"`` (every device draws the same ones: only values travel)
        or ``"none"`` (every entry is sent).
      random: whether its selection draws from the state's random key.
      options: the keyword options its factory takes.
    """

    kind: str
    indices: str = "sent"
    random: bool = False
    options: tuple[str, ...] = ()


class _Entry(NamedTuple):
    factory: Factory
    traits: Traits


def _entry(factory: Factory, kind: str, **traits) -> _Entry:
    return _Entry(factory, Traits(kind, **traits, options=_options(factory)))


def _options(factory: Factory) -> tuple[str, ...]:
    """The keyword options of ``factory``, less those its name already sets."""
    bound = factory.keywords if isinstance(factory, functools.partial) else {}
    return tuple(
        p.name
        for p in inspect.signature(factory).parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.name not in bound
    )


# The one place a compressor is added: its factory and its traits.
REGISTRY: dict[str, _Entry] = {
    "sidco-e": _entry(functools.partial(compress, estimator="exponential"), "fit"),
    "sidco-p": _entry(functools.partial(compress, estimator="gpareto"), "fit"),
    "sidco-gp": _entry(functools.partial(compress, estimator="gamma"), "fit"),
    "topk": _entry(baselines.topk, "top-k"),
    "approxk": _entry(baselines.approxk, "top-k"),
    "dgc": _entry(baselines.dgc, "sample", random=True),
    "gaussiank": _entry(baselines.gaussiank, "correction"),
    "redsync": _entry(baselines.redsync, "search"),
    "randomk": _entry(baselines.randomk, "random", indices="shared", random=True),
    "dense": _entry(_dense, "none", indices="none"),
}
COMPRESSORS: tuple[str, ...] = tuple(REGISTRY)


def traits(name: str) -> Traits:
    """The :class:`Traits` of the compressor called ``name``.

    Args:
      name: one of :data:`~sidco_jax.COMPRESSORS`.

    Returns:
      Its traits.

    Raises:
      ValueError: for an unknown name, listing the known ones.

    Examples:
      >>> import sidco_jax as sidco
      >>> [n for n in sidco.COMPRESSORS if sidco.traits(n).indices == "shared"]
      ['randomk']
      >>> sidco.traits("dgc").kind, sidco.traits("dgc").random
      ('sample', True)
    """
    check_choice("compressor", name, tuple(REGISTRY))
    return REGISTRY[name].traits


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
    allowed = traits(name).options
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"compressor {name!r} got unknown options {unknown}; allowed: {allowed}")
    return REGISTRY[name].factory(ratio, **options)
