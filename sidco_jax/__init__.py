"""sidco_jax: SIDCo statistical gradient compression for JAX.

The public API is flat; the distribution fits and quantiles live in
:mod:`sidco_jax.stats` and the communication cost model in
:mod:`sidco_jax.costs`; everything under ``sidco_jax._src`` is private.
"""

from sidco_jax import costs, stats
from sidco_jax._src.accumulate import AccumulateState, accumulate
from sidco_jax._src.base import (
    ESTIMATORS,
    GRANULARITIES,
    MAX_SIZE,
    MODES,
    CompressMetrics,
    CompressState,
    ObserveFn,
    Payload,
    Rule,
    RuleInitFn,
    SelectFn,
    Selection,
)
from sidco_jax._src.baselines import dense, dgc, gaussiank, randomk, redsync, topk
from sidco_jax._src.checkpoint import RatioWarning, ResidualWarning, restore, save
from sidco_jax._src.control import RULES, StageControl
from sidco_jax._src.costs import Link
from sidco_jax._src.hlo import Collective, hlo_collectives
from sidco_jax._src.loop import sparsifier
from sidco_jax._src.metrics import metrics
from sidco_jax._src.options import LoopOptions
from sidco_jax._src.payload import capacity, densify, sparsify
from sidco_jax._src.registry import COMPRESSORS, compressor
from sidco_jax._src.sharding import (
    data_parallel_step,
    is_residual,
    place,
    shard_init,
    state_shardings,
    state_specs,
)
from sidco_jax._src.sidco import SidcoState, compress
from sidco_jax._src.thresholds import max_stages, threshold

__version__ = "0.1.0"

__all__ = [
    "COMPRESSORS",
    "ESTIMATORS",
    "GRANULARITIES",
    "MAX_SIZE",
    "MODES",
    "RULES",
    "AccumulateState",
    "Collective",
    "CompressMetrics",
    "CompressState",
    "Link",
    "LoopOptions",
    "ObserveFn",
    "Payload",
    "RatioWarning",
    "ResidualWarning",
    "Rule",
    "RuleInitFn",
    "SelectFn",
    "Selection",
    "SidcoState",
    "StageControl",
    "accumulate",
    "capacity",
    "compress",
    "compressor",
    "costs",
    "data_parallel_step",
    "dense",
    "densify",
    "dgc",
    "gaussiank",
    "hlo_collectives",
    "is_residual",
    "max_stages",
    "metrics",
    "place",
    "randomk",
    "redsync",
    "restore",
    "save",
    "shard_init",
    "sparsifier",
    "sparsify",
    "state_shardings",
    "state_specs",
    "stats",
    "threshold",
    "topk",
]
