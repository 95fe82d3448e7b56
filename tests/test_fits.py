import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import sidco_jax as sidco


@pytest.fixture
def mags(rng):
    return np.abs(rng.laplace(size=50_000)).astype(np.float32)


def test_exponential_fit_is_the_mle(mags):
    mask = mags < 3.0
    fit = sidco.stats.fit_exponential(jnp.asarray(mags), jnp.asarray(mask))
    _, scale = stats.expon.fit(mags[mask].astype(np.float64), floc=0)
    assert float(fit.scale) == pytest.approx(scale, rel=1e-5)


def test_gamma_fit_close_to_scipy_mle(rng):
    x = rng.gamma(0.4, 2.0, size=100_000).astype(np.float32)
    x[:1000] = 0.0  # zeros are left out of the sample
    fit = sidco.stats.fit_gamma(jnp.asarray(x))
    shape, _, scale = stats.gamma.fit(x[x > 0].astype(np.float64), floc=0)
    # The closed form approximates the MLE within ~1.5% for such shapes.
    assert float(fit.shape) == pytest.approx(shape, rel=0.015)
    assert float(fit.shape * fit.scale) == pytest.approx(shape * scale, rel=1e-4)


def test_gamma_closed_form_matches_numpy_oracle(rng):
    x = rng.gamma(2.5, size=20_000).astype(np.float64)
    s = np.log(x.mean()) - np.log(x).mean()
    k = (3 - s + np.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    fit = sidco.stats.fit_gamma(jnp.asarray(x, jnp.float32))
    assert float(fit.shape) == pytest.approx(k, rel=1e-4)
    assert float(fit.scale) == pytest.approx(x.mean() / k, rel=1e-4)


def test_gpareto_method_of_moments(rng):
    x = stats.genpareto.rvs(0.2, scale=1.5, size=200_000, random_state=rng).astype(np.float32)
    fit = sidco.stats.fit_gpareto(jnp.asarray(x))
    m, v = x.astype(np.float64).mean(), x.astype(np.float64).var(ddof=1)
    r = m * m / v
    assert float(fit.shape) == pytest.approx((1 - r) / 2, abs=1e-4)
    assert float(fit.scale) == pytest.approx(m * (1 + r) / 2, rel=1e-4)
    assert float(fit.shape) == pytest.approx(0.2, abs=0.05)  # consistent estimator


@pytest.mark.parametrize("q", [0.25, 1e-2, 1e-3, 1e-5])
def test_tail_quantiles_match_scipy(q):
    qf = jnp.float32(q)
    exp = sidco.stats.exponential_isf(sidco.stats.ExponentialFit(jnp.float32(0.7)), qf)
    assert float(exp) == pytest.approx(stats.expon.isf(q, scale=0.7), rel=1e-5)
    gam = sidco.stats.gamma_isf(sidco.stats.GammaFit(jnp.float32(0.3), jnp.float32(2.0)), qf)
    assert float(gam) == pytest.approx(stats.gamma.isf(q, 0.3, scale=2.0), rel=1e-4)
    for xi in (-0.2, 0.0, 1e-8, 0.3):
        gp = sidco.stats.gpareto_isf(sidco.stats.GParetoFit(jnp.float32(xi), jnp.float32(1.3)), qf)
        assert float(gp) == pytest.approx(stats.genpareto.isf(q, xi, scale=1.3), rel=1e-4)


def test_degenerate_samples_give_finite_parameters():
    empty = jnp.zeros(4, bool)
    x = jnp.ones(4)
    for fit in (
        sidco.stats.fit_exponential(x, empty),
        sidco.stats.fit_gamma(x, empty),
        sidco.stats.fit_gpareto(x, empty),
        sidco.stats.fit_gamma(x),
        sidco.stats.fit_gpareto(x),
        sidco.stats.fit_gamma(jnp.zeros(4)),
    ):
        assert all(np.isfinite(np.asarray(p)) for p in fit), fit
    constant = sidco.stats.fit_gpareto(x)  # zero variance: exponential limit
    assert float(constant.shape) == 0.0 and float(constant.scale) == 1.0
