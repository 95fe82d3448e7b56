"""How a compressor's factory takes the loop's options: checked once, handed on checked.

Each factory (:func:`~sidco_jax.compress`, :func:`~sidco_jax.topk`, ...,
:func:`~sidco_jax.dense`) is written as ``factory(ratio, *, own options,
**options)`` and decorated with :func:`takes_loop_options`. The decorator
checks ``ratio`` and the loop's options (:func:`~sidco_jax._src.loop.sparsifier.configure`,
the one place they are checked) and calls the factory with them checked; the
factory checks its own options and hands the rest to
:func:`~sidco_jax._src.loop.sparsifier.build`, which trusts them.
"""

import functools
import inspect

from sidco_jax._src.loop import memo
from sidco_jax._src.loop.sparsifier import LOOP_OPTIONS, configure, sparsifier


def takes_loop_options(factory=None, /, **defaults):
    """Decorates ``factory(ratio, *, own options, **options)`` to take the loop's options.

    The decorated factory's signature lists the loop's options after its own,
    as keyword-only parameters with :func:`sparsifier`'s defaults (or
    ``defaults``, e.g. ``error_feedback=False``): ``inspect.signature``,
    ``optax.inject_hyperparams`` and the registry see every option. A call
    checks ``ratio`` and the loop's options once, and calls ``factory`` with
    ``ratio`` a Python float and every loop option checked; a factory without
    ``ratio`` sends every entry (ratio 1). An option the factory does not take
    is refused with the list of those it does. A call with the arguments of a
    recent one returns the same transformation.
    """
    if factory is None:
        return functools.partial(takes_loop_options, **defaults)
    own = inspect.signature(factory)
    loop = [
        p.replace(default=defaults.get(p.name, p.default))
        for p in inspect.signature(sparsifier).parameters.values()
        if p.name in LOOP_OPTIONS
    ]
    mine = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    signature = own.replace(parameters=[*mine, *loop])
    allowed = tuple(p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY)

    def checked(*args, **options):
        arguments = signature.bind(*args, **options)
        arguments.apply_defaults()
        arguments = dict(arguments.arguments)
        ratio, options = configure(
            arguments.pop("ratio", 1.0), **{k: arguments.pop(k) for k in LOOP_OPTIONS}
        )
        if "ratio" in own.parameters:
            arguments["ratio"] = ratio
        return factory(**arguments, **options)

    build = memo.memoized(checked)

    @functools.wraps(factory)
    def with_options(*args, **options):
        unknown = sorted(set(options) - set(signature.parameters))
        if unknown:
            raise TypeError(f"{factory.__name__} got unknown options {unknown}; allowed: {allowed}")
        return build(*args, **options)

    with_options.__signature__ = signature
    return with_options
