"""Types for type checkers: the option literals, the loop's options, a rule's parts.

The tuples of allowed values (``sidco_jax.ADAPTATIONS``, ...) are these
literals' arguments, as ``typing.get_args`` gives them.
"""

from sidco_jax._src.base import Adaptation, AxisName, Communication, Estimator, Granularity
from sidco_jax._src.loop.layout import Layout
from sidco_jax._src.loop.rule import ObserveFn, RuleInitFn, SelectFn
from sidco_jax._src.loop.sparsifier import LoopOptions
from sidco_jax._src.ops.codecs import IndexCodec, ValueCodec

__all__ = [
    "Adaptation",
    "AxisName",
    "Communication",
    "Estimator",
    "Granularity",
    "IndexCodec",
    "Layout",
    "LoopOptions",
    "ObserveFn",
    "RuleInitFn",
    "SelectFn",
    "ValueCodec",
]
