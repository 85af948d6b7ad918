"""Unreadable blocks per year: a birth-death chain on the failed shards of one stripe.

A stripe of n shards (k data + m = n - k parity; replication is k = 1) sits on n
distinct nodes. Each shard fails at rate λ (its node's failures plus its disk's)
and a failed shard is restored after a mean time 1/μ (detection plus rebuild),
independently of the others. The number of failed shards j is then a birth-death
chain on 0..n: j -> j+1 at (n - j) λ, j -> j-1 at j μ. The block is unreadable
while j > m.

* :meth:`StripeChain.stationary` solves π Q = 0 for the full chain by detailed
  balance, π_{j+1} = π_j (n - j) λ / ((j + 1) μ), in logarithms (a linear solve
  leaves 10⁻¹⁶ of absolute noise, and π_m of 8 + 4 is 10⁻¹⁸); with independent
  shards it is Binomial(n, λ/(λ+μ)), which the tests hold it to.
* :meth:`StripeChain.loss_rate`: unreadability events per stripe per unit time,
  the flux π_m (n - m) λ across m -> m + 1. Per year this is the expected
  fraction of blocks that become unreadable per year (for rare events). By
  insensitivity it holds for any repair-time distribution with that mean (the
  Monte Carlo check repairs in a fixed time).
* :meth:`StripeChain.loss_probability`: the chance that a block written whole
  becomes unreadable within its lifetime t: the mass in the absorbing state m + 1
  of the chain cut there, from :func:`transition` (uniformization on a short step,
  then squaring: only non-negative terms, so 10⁻²⁰ keeps its digits where a Taylor
  series' cancellations would leave 10⁻¹⁶ of noise).
* :meth:`StripeChain.mean_time_to_loss`: MTTDL from all shards whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError

__all__ = ["StripeChain", "expm", "transition"]

FloatArray = npt.NDArray[np.float64]


def expm(a: FloatArray) -> FloatArray:
    """The matrix exponential by scaling and squaring with a degree-18 Taylor series
    (the chains here have at most a few dozen states)."""
    a = np.asarray(a, np.float64)
    norm = float(np.abs(a).sum(axis=1).max()) if a.size else 0.0
    squarings = max(0, math.ceil(math.log2(norm)) + 1) if norm > 0.5 else 0
    scaled = a / (2.0**squarings)
    out = np.eye(len(a))
    term = np.eye(len(a))
    for i in range(1, 19):
        term = term @ scaled / i
        out = out + term
    for _ in range(squarings):
        out = out @ out
    return out


def transition(q: FloatArray, t: float) -> FloatArray:
    """exp(Q t) for a generator Q (rows sum to 0, off-diagonal >= 0), with every entry
    to full relative precision: on a step h = t / 2^s with Λh <= 1 (Λ the largest exit
    rate), exp(Q h) = Σ_j Poisson(j; Λh) P^j with P = I + Q/Λ stochastic; then s
    squarings. Every term is non-negative."""
    q = np.asarray(q, np.float64)
    rate = float(-np.diag(q).min()) if q.size else 0.0
    if rate <= 0 or t == 0:
        return np.eye(len(q))
    squarings = max(0, math.ceil(math.log2(rate * t)))
    h = t / 2.0**squarings
    step = np.eye(len(q)) + q / rate
    x = rate * h
    weight = math.exp(-x)
    power = np.eye(len(q))
    out = weight * power
    for j in range(1, 40):
        power = power @ step
        weight *= x / j
        out = out + weight * power
    for _ in range(squarings):
        out = out @ out
    return np.asarray(out, np.float64)


@dataclass(frozen=True, slots=True, kw_only=True)
class StripeChain:
    """The chain of one stripe: ``n`` shards, readable with any ``k``; each shard fails
    at ``failure_rate`` and is restored at ``repair_rate`` (same time unit)."""

    n: int
    k: int
    failure_rate: float
    repair_rate: float

    def __post_init__(self) -> None:
        if not 1 <= self.k <= self.n:
            raise ArgumentError(f"need 1 <= k <= n, got k={self.k} n={self.n}")
        if not self.failure_rate > 0 or not self.repair_rate > 0:
            raise ArgumentError("failure and repair rates must be > 0")

    @property
    def m(self) -> int:
        """Shards a stripe may lose and stay readable."""
        return self.n - self.k

    def generator(self) -> FloatArray:
        """Q of the full chain on 0..n failed shards."""
        n, lam, mu = self.n, self.failure_rate, self.repair_rate
        q = np.zeros((n + 1, n + 1))
        for j in range(n + 1):
            if j < n:
                q[j, j + 1] = (n - j) * lam
            if j > 0:
                q[j, j - 1] = j * mu
            q[j, j] = -q[j].sum()
        return q

    def stationary(self) -> FloatArray:
        """π with π Q = 0 and Σ π = 1."""
        q = self.generator()
        log_pi = np.zeros(self.n + 1)
        for j in range(self.n):
            log_pi[j + 1] = log_pi[j] + math.log(q[j, j + 1]) - math.log(q[j + 1, j])
        pi = np.exp(log_pi - log_pi.max())
        return np.asarray(pi / pi.sum(), np.float64)

    def loss_rate(self) -> float:
        """Stripes becoming unreadable per stripe per unit time (flux m -> m + 1)."""
        return float(self.stationary()[self.m] * (self.n - self.m) * self.failure_rate)

    def _transient(self) -> FloatArray:
        """Q restricted to the readable states 0..m (leaving to m + 1 is absorption)."""
        return self.generator()[: self.m + 1, : self.m + 1]

    def loss_probability(self, t: float) -> float:
        """P(a stripe written whole becomes unreadable within ``t``)."""
        if t < 0:
            raise ArgumentError(f"lifetime must be >= 0, got {t}")
        m = self.m
        q = np.zeros((m + 2, m + 2))
        q[: m + 1, : m + 1] = self._transient()
        q[m, m + 1] = (self.n - m) * self.failure_rate
        return float(min(1.0, max(0.0, transition(q, t)[0, m + 1])))

    def mean_time_to_loss(self) -> float:
        """Expected time from all shards whole to unreadable (MTTDL)."""
        t = np.linalg.solve(-self._transient(), np.ones(self.m + 1))
        return float(t[0])
