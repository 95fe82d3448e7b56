"""sidco_jax: SIDCo statistical gradient compression for JAX.

The public API is flat; everything under ``sidco_jax._src`` is private.
"""

from sidco_jax._src.baselines import dense, dgc, gaussiank, randomk, redsync, topk
from sidco_jax._src.checkpoint import ResidualWarning, restore, save
from sidco_jax._src.collectives import MODES
from sidco_jax._src.control import RULES, StageControl
from sidco_jax._src.fits import (
    ExponentialFit,
    GammaFit,
    GParetoFit,
    exponential_from_sums,
    exponential_isf,
    fit_exponential,
    fit_gamma,
    fit_gpareto,
    gamma_from_sums,
    gamma_isf,
    gpareto_from_sums,
    gpareto_isf,
)
from sidco_jax._src.hlo import Collective, collectives
from sidco_jax._src.metrics import metrics
from sidco_jax._src.payload import MAX_SIZE, Payload, capacity, densify, sparsify
from sidco_jax._src.sharding import is_residual, shard_init, state_shardings, state_specs
from sidco_jax._src.special import gammainccinv, gammaincinv
from sidco_jax._src.thresholds import ESTIMATORS, max_stages, threshold
from sidco_jax._src.transform import (
    GRANULARITIES,
    CompressMetrics,
    CompressState,
    Selection,
    compress,
    sparsifier,
)

__version__ = "0.1.0"

__all__ = [
    "ESTIMATORS",
    "GRANULARITIES",
    "MAX_SIZE",
    "MODES",
    "RULES",
    "Collective",
    "CompressMetrics",
    "CompressState",
    "ExponentialFit",
    "GParetoFit",
    "GammaFit",
    "Payload",
    "ResidualWarning",
    "Selection",
    "StageControl",
    "capacity",
    "collectives",
    "compress",
    "dense",
    "densify",
    "dgc",
    "exponential_from_sums",
    "exponential_isf",
    "fit_exponential",
    "fit_gamma",
    "fit_gpareto",
    "gamma_from_sums",
    "gamma_isf",
    "gammainccinv",
    "gammaincinv",
    "gaussiank",
    "gpareto_from_sums",
    "gpareto_isf",
    "is_residual",
    "max_stages",
    "metrics",
    "randomk",
    "redsync",
    "restore",
    "save",
    "shard_init",
    "sparsifier",
    "sparsify",
    "state_shardings",
    "state_specs",
    "threshold",
    "topk",
]
