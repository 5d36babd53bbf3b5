"""Lloyd-Max (MSE-optimal scalar) codebooks for the standard normal distribution."""

from __future__ import annotations

import math
from functools import cache
from itertools import pairwise


def _pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) if math.isfinite(x) else 0.0


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


@cache
def lloyd_max_normal(bits: int, iterations: int = 2000) -> tuple[tuple[float, ...], float]:
    """-> (centroids ascending, MSE) of the 2**bits-level quantizer for N(0, 1)."""
    levels = 1 << bits
    centroids = [-3 + 6 * (i + 0.5) / levels for i in range(levels)]
    for _ in range(iterations):
        edges = [-math.inf] + [(a + b) / 2 for a, b in pairwise(centroids)] + [math.inf]
        # E[x | a < x < b] = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a))
        centroids = [(_pdf(a) - _pdf(b)) / (_cdf(b) - _cdf(a)) for a, b in pairwise(edges)]
    edges = [-math.inf] + [(a + b) / 2 for a, b in pairwise(centroids)] + [math.inf]
    mse = 0.0
    for c, (a, b) in zip(centroids, pairwise(edges), strict=True):
        # integral over (a, b) of (x - c)^2 pdf(x) dx, from the closed forms of x^k pdf(x)
        p = _cdf(b) - _cdf(a)
        m1 = _pdf(a) - _pdf(b)
        m2 = p + (a * _pdf(a) if math.isfinite(a) else 0.0) - (b * _pdf(b) if math.isfinite(b) else 0.0)
        mse += m2 - 2 * c * m1 + c * c * p
    return tuple(centroids), mse
