"""Small statistics shared by the router, the planner and the benchmarks."""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The nearest-rank q-th percentile (q in [0, 100]) of `values`; None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Histogram:
    """Cumulative observations in fixed buckets, as Prometheus keeps them: `counts[i]` is
    how many were <= `bounds[i]` and above the bound before (the last, past every bound)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)
