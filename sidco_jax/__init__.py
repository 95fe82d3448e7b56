"""sidco_jax: SIDCo statistical gradient compression for JAX.

The compressors, their states, the payload, the threshold, checkpoints and
the tuples of allowed option values sit at the top level; the families live in
sub-namespaces, as optax's do:

* :mod:`sidco_jax.parallel`: the state across devices, and a data-parallel step;
* :mod:`sidco_jax.checkpoint`: saving and restoring a state, and its warnings;
* :mod:`sidco_jax.stats`: the fits and quantiles behind the threshold;
* :mod:`sidco_jax.costs`: the communication cost model;
* :mod:`sidco_jax.hlo`: what a compiled step communicates and launches;
* :mod:`sidco_jax.typing`: types for type checkers.

Everything under ``sidco_jax._src`` is private.
"""

from sidco_jax import checkpoint, costs, hlo, parallel, stats, typing
from sidco_jax._src.analysis.metrics import metrics
from sidco_jax._src.base import (
    ADAPTATIONS,
    COMMUNICATIONS,
    ESTIMATORS,
    GRANULARITIES,
    CompressMetrics,
    CompressState,
)
from sidco_jax._src.checkpoint.saving import restore, save
from sidco_jax._src.loop.layout import LAYOUTS
from sidco_jax._src.loop.rule import Rule, Selection
from sidco_jax._src.loop.sparsifier import sparsifier
from sidco_jax._src.ops.codecs import INDEX_CODECS, VALUE_CODECS
from sidco_jax._src.ops.payload import Payload, capacity, densify, sparsify
from sidco_jax._src.rules.baselines import approxk, dense, dgc, gaussiank, randomk, redsync, topk
from sidco_jax._src.rules.control import AdaptationState
from sidco_jax._src.rules.registry import COMPRESSORS, Traits, compressor, traits
from sidco_jax._src.rules.sidco import SidcoState, compress
from sidco_jax._src.stats.thresholds import threshold
from sidco_jax._src.wrappers.accumulate import AccumulateState, accumulate
from sidco_jax._src.wrappers.outer import OuterState, diloco

__version__ = "0.1.0"

__all__ = [
    "ADAPTATIONS",
    "COMMUNICATIONS",
    "COMPRESSORS",
    "ESTIMATORS",
    "GRANULARITIES",
    "INDEX_CODECS",
    "LAYOUTS",
    "VALUE_CODECS",
    "AccumulateState",
    "AdaptationState",
    "CompressMetrics",
    "CompressState",
    "OuterState",
    "Payload",
    "Rule",
    "Selection",
    "SidcoState",
    "Traits",
    "accumulate",
    "approxk",
    "capacity",
    "checkpoint",
    "compress",
    "compressor",
    "costs",
    "dense",
    "densify",
    "dgc",
    "diloco",
    "gaussiank",
    "hlo",
    "metrics",
    "parallel",
    "randomk",
    "redsync",
    "restore",
    "save",
    "sparsifier",
    "sparsify",
    "stats",
    "threshold",
    "topk",
    "traits",
    "typing",
]
