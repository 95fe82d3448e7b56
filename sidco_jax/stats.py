"""The distribution fits and quantiles behind SIDCo's thresholds.

Users rarely call these directly (:func:`sidco_jax.threshold` does, and
:func:`max_stages` bounds its stage count); they are public for analysis and
tests, as ``optax.losses`` keeps its family apart. Each law has a fit from
data (``fit_*``, optionally masked), a fit from the sums a streaming pass
produces (``*_from_sums``) and an inverse survival function (``*_isf``);
``gammaincinv``/``gammainccinv`` invert the regularised incomplete gamma
functions, which ``jax.scipy.special`` lacks.
"""

from sidco_jax._src.stats.fits import (
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
from sidco_jax._src.stats.special import gammainccinv, gammaincinv
from sidco_jax._src.stats.thresholds import max_stages

__all__ = [
    "ExponentialFit",
    "GParetoFit",
    "GammaFit",
    "exponential_from_sums",
    "exponential_isf",
    "fit_exponential",
    "fit_gamma",
    "fit_gpareto",
    "gamma_from_sums",
    "gamma_isf",
    "gammainccinv",
    "gammaincinv",
    "gpareto_from_sums",
    "gpareto_isf",
    "max_stages",
]
