"""Factories that return the transformation they built before for equal arguments.

``optax.inject_hyperparams`` calls its factory on every update. Called
eagerly, a new transformation each time would compile its update each time
(:mod:`eager`): :func:`memoized` hands back the one built for equal
arguments, and passes the hyperparameters it injects as concrete arrays to
one compiled update as arguments, whatever their values.
"""

import collections
import functools

import jax
import numpy as np
import optax

from sidco_jax._src.base import StaticOptionError
from sidco_jax._src.loop import eager

BUILT = 64  # transformations kept per factory for calls with equal arguments


def _hashable(value):
    """``value`` as a hashable key, or None where it is traced or unhashable.

    A concrete 0-d array keys by its dtype and value, as
    ``optax.inject_hyperparams`` passes hyperparameters; the type is part of
    every key, inside tuples too, so ``True`` and ``1`` (one refused, one not)
    never share one.
    """
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        value = np.asarray(value)
        return ("array", value.dtype.str, value.item()) if value.ndim == 0 else None
    if isinstance(value, tuple):  # a Link, an axis tuple: typed inside too
        inner = tuple(_hashable(v) for v in value)
        return None if None in inner else (type(value), inner)
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value), value)


def _injected(value) -> bool:
    """Whether ``value`` is a concrete 0-d JAX array: how ``optax.inject_hyperparams``
    passes a hyperparameter to the factory on an eager update."""
    return (
        isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and not value.ndim
    )


class _Shared:
    """One compiled update for every value of a factory's injected options.

    An eager loop under ``optax.inject_hyperparams`` with a schedule calls the
    factory with a new value on every step: a transformation per value would
    compile its update per value. Here the injected values are arguments of
    one ``jax.jit``, as under a jitted step. An option found static on the way
    (``capacity_factor`` outside ``static_args``) is keyed by its value from
    then on; any other failure falls back to the transformation built for
    each value, which says what is wrong, if anything.
    """

    def __init__(self, factory, args, options, static: set):
        def update(injected, updates, state, params, extra):
            tx = optax.with_extra_args_support(factory(*args, **options, **injected))
            return tx.update(updates, state, params, **extra)

        self.jitted, self.traceable, self.static = jax.jit(update), True, static

    def transformation(self, concrete, injected, again):
        """The transformation for these values; ``again()`` builds it anew (see above)."""

        def update(updates, state, params=None, **extra):
            if self.traceable and eager.is_eager(updates, state, params, extra):
                try:
                    return self.jitted(injected, updates, state, params, extra)
                except StaticOptionError as error:
                    self.static.add(error.name)  # keyed by its value from now on
                    return again().update(updates, state, params, **extra)
                except (TypeError, ValueError):
                    self.traceable = False
            return concrete.update(updates, state, params, **extra)

        return optax.GradientTransformationExtraArgs(concrete.init, update)


def memoized(factory):
    """``factory`` returning the transformation it built before for equal arguments.

    ``optax.inject_hyperparams`` calls the factory on every update; the same
    transformation each time keeps its compiled update (:mod:`eager`) from
    being compiled again, and the options it injects as concrete arrays are
    arguments of one compiled update (:class:`_Shared`), whatever their values.
    """
    built, shared, wrapped = (collections.OrderedDict() for _ in range(3))
    static = set()  # injected options found static, keyed by value since

    def remembered(cache, key, make):
        if key not in cache:
            cache[key] = make()
            if len(cache) > BUILT:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return cache[key]

    @functools.wraps(factory)
    def cached(*args, **options):
        names = sorted(options)
        keys = dict(zip(names, (_hashable(options[k]) for k in names), strict=True))
        positional = tuple(_hashable(v) for v in args)
        if None in positional or None in keys.values():
            return factory(*args, **options)
        key = (positional, tuple(keys.items()))
        concrete = remembered(built, key, lambda: factory(*args, **options))
        injected = {k: options[k] for k in names if _injected(options[k]) and k not in static}
        if not injected:
            return concrete
        fixed = {k: v for k, v in options.items() if k not in injected}
        key = (positional, tuple((k, keys[k]) for k in names if k in fixed))
        key += tuple((k, v.dtype.str, v.weak_type) for k, v in injected.items())
        entry = remembered(shared, key, lambda: _Shared(factory, args, fixed, static))
        return remembered(
            wrapped,
            (positional, tuple(keys.items()), tuple(sorted(static))),
            lambda: entry.transformation(concrete, injected, lambda: cached(*args, **options)),
        )

    return cached
