"""The stripe chain against closed forms, and the Monte Carlo run against the chain."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcache.errors import ArgumentError
from kvcache.sim import FailureModel, Layout, StripeChain, expm, sample_keys, simulate_failures
from kvcache.sim.balance import holders_of
from kvcache.sim.markov import transition
from kvcache.sim.topology import synthetic_map


def test_expm_matches_the_eigen_decomposition() -> None:
    rng = np.random.default_rng(1)
    a = rng.normal(size=(6, 6))
    a = a + a.T  # symmetric: exp by eigenvalues
    w, v = np.linalg.eigh(a)
    assert np.allclose(expm(a), (v * np.exp(w)) @ v.T, rtol=1e-9, atol=1e-9)
    assert np.allclose(expm(np.zeros((3, 3))), np.eye(3))


@pytest.mark.parametrize(("n", "k"), [(12, 10), (12, 8), (3, 1), (5, 3)])
def test_stationary_is_binomial_and_loss_rate_its_flux(n: int, k: int) -> None:
    lam, mu = 0.01, 0.7
    chain = StripeChain(n=n, k=k, failure_rate=lam, repair_rate=mu)
    p = lam / (lam + mu)
    binom = np.array([math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(n + 1)])
    assert np.allclose(chain.stationary(), binom, rtol=1e-8, atol=0.0)
    assert np.allclose(chain.stationary() @ chain.generator(), 0.0, atol=1e-12)
    m = n - k
    assert chain.loss_rate() == pytest.approx(binom[m] * (n - m) * lam, rel=1e-8)


def test_mirror_mttdl_closed_form() -> None:
    # Two copies, either one readable: MTTDL = (3 lambda + mu) / (2 lambda^2).
    lam, mu = 0.02, 3.0
    chain = StripeChain(n=2, k=1, failure_rate=lam, repair_rate=mu)
    assert chain.mean_time_to_loss() == pytest.approx((3 * lam + mu) / (2 * lam**2), rel=1e-10)


def test_transition_agrees_with_expm_on_a_moderate_chain() -> None:
    chain = StripeChain(n=5, k=3, failure_rate=0.2, repair_rate=1.5)
    q = chain.generator()
    for t in (0.1, 1.0, 7.0):
        assert np.allclose(transition(q, t), expm(q * t), rtol=1e-9, atol=1e-12)
        assert np.allclose(transition(q, t).sum(axis=1), 1.0)


def test_single_copy_loss_probability_is_exponential() -> None:
    chain = StripeChain(n=1, k=1, failure_rate=0.3, repair_rate=1.0)
    for t in (0.0, 0.5, 4.0, 40.0):
        assert chain.loss_probability(t) == pytest.approx(1 - math.exp(-0.3 * t), rel=1e-9)


def test_rare_loss_probability_keeps_its_digits() -> None:
    chain = StripeChain(n=12, k=8, failure_rate=1e-5, repair_rate=1.0)
    p = chain.loss_probability(72.0)
    # Rare: the stationary flux times the lifetime, less the first repair time or so that
    # a whole stripe takes to reach its steady state (the two are computed apart).
    assert chain.loss_rate() * 60.0 < p < chain.loss_rate() * 72.0
    assert chain.loss_rate() == pytest.approx(math.comb(12, 4) * 1e-5**4 * 8e-5, rel=1e-3)


def test_bad_chains_are_refused() -> None:
    with pytest.raises(ArgumentError):
        StripeChain(n=3, k=4, failure_rate=1.0, repair_rate=1.0)
    with pytest.raises(ArgumentError):
        StripeChain(n=3, k=1, failure_rate=0.0, repair_rate=1.0)


@pytest.mark.parametrize(("n", "k"), [(12, 10), (3, 1)])
def test_monte_carlo_agrees_with_the_chain_when_accelerated(n: int, k: int) -> None:
    rng = np.random.default_rng([21, n, k])
    layout = Layout(nodes=40)
    rows = holders_of(synthetic_map(layout), sample_keys(800, rng), width=n)
    model = FailureModel(
        node_rate=1 / 100, node_repair=10.0, disk_rate=1 / 400, disk_repair=2.0, disks_per_node=4
    )
    chain = StripeChain(
        n=n, k=k, failure_rate=model.shard_rate, repair_rate=model.shard_repair_rate
    )
    mc = simulate_failures(rows, 40, k=k, model=model, horizon=3000.0, rng=rng)
    assert mc.events > 100
    ratio = mc.loss_rate / chain.loss_rate()
    assert 0.5 < ratio < 2.0  # the bound
    assert abs(ratio - 1) < 4 * mc.rel_error + 0.05


def test_monte_carlo_sees_nothing_without_enough_failures() -> None:
    rows = np.array([[0, 1, 2]] * 5)
    model = FailureModel(node_rate=1e-9, node_repair=1.0)
    mc = simulate_failures(rows, 3, k=1, model=model, horizon=100.0, rng=np.random.default_rng(0))
    assert mc.events == 0 and mc.loss_rate == 0.0
    with pytest.raises(ArgumentError):
        simulate_failures(rows, 3, k=1, model=model, horizon=5.0, rng=np.random.default_rng(0))
