"""The options every compressor shares, defined once: :func:`sparsifier`'s keywords.

Each factory (:func:`~sidco_jax.compress`, :func:`~sidco_jax.topk`, ...,
:func:`~sidco_jax.dense`) takes its own options and ``**options``, typed by
:class:`LoopOptions`; :func:`takes_loop_options` lists them in its signature.
"""

import functools
import inspect
from typing import TypedDict

from sidco_jax._src import codecs, costs, memo
from sidco_jax._src.base import AxisName, Communication, Granularity
from sidco_jax._src.layout import Layout
from sidco_jax._src.loop import sparsifier


class LoopOptions(TypedDict, total=False):
    """The options every compressor takes: the keywords of :func:`sparsifier`.

    Defined once, here; each factory (:func:`~sidco_jax.compress`,
    :func:`~sidco_jax.topk`, ..., :func:`~sidco_jax.dense`) adds its own
    options to these. Their meaning and defaults are :func:`sparsifier`'s.
    """

    granularity: Granularity
    error_feedback: bool
    seed: int
    axis_name: AxisName | None
    communication: Communication
    inner_axis: AxisName | None
    inner_shards: int | None
    link: costs.Link | None
    warmup_steps: int
    layout: Layout
    bucket_bytes: int | None
    values: codecs.ValueCodec
    indices: codecs.IndexCodec


LOOP_OPTIONS: tuple[str, ...] = tuple(LoopOptions.__annotations__)


def takes_loop_options(factory):
    """Decorates ``factory(ratio, *, own options, **options)`` to take the loop's options.

    Its signature lists the loop's options after its own, as keyword-only
    parameters with :func:`sparsifier`'s defaults: ``inspect.signature``,
    ``optax.inject_hyperparams`` and the registry see every option. An option
    the factory does not take is refused with the list of those it does. A
    call with the arguments of a recent one returns the same transformation.
    """
    loop = [p for p in inspect.signature(sparsifier).parameters.values() if p.name in LOOP_OPTIONS]
    signature = inspect.signature(factory)
    own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    signature = signature.replace(parameters=[*own, *loop])
    allowed = tuple(p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY)
    build = memo.memoized(factory)

    @functools.wraps(factory)
    def with_options(*args, **options):
        unknown = sorted(set(options) - set(signature.parameters))
        if unknown:
            raise TypeError(f"{factory.__name__} got unknown options {unknown}; allowed: {allowed}")
        return build(*args, **options)

    with_options.__signature__ = signature
    return with_options
