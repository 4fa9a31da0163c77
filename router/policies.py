"""Routing policies, found by name (`--routing`). A policy picks the decode worker that owns
a request and orders the prefill workers it may use (first choice, then the retry)."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

from router.registry import WorkerView


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def pick_decode(self, workers: list[WorkerView]) -> WorkerView:
        """One of `workers` (never empty)."""

    @abstractmethod
    def order_prefill(self, workers: list[WorkerView]) -> list[WorkerView]:
        """`workers` in the order to try them."""


class LeastLoaded(RoutingPolicy):
    """Decode: fewest requests (this router's open ones, or the worker's own count if
    larger), then most free KV blocks. Prefill: fewest queued prompt tokens (the worker's
    report plus what this router sent since)."""

    name = "least-loaded"

    def pick_decode(self, workers):
        def load(v: WorkerView):
            s = v.stats
            busy = max(v.inflight, (s.num_running + s.num_waiting + s.num_waiting_for_kv) if s else 0)
            free = s.num_free_blocks / max(1, s.num_total_blocks) if s else 1.0
            return (busy, -free)

        return min(workers, key=load)

    def order_prefill(self, workers):
        return sorted(workers, key=lambda v: v.queued_prefill_tokens)


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._decode = itertools.count()
        self._prefill = itertools.count()

    def pick_decode(self, workers):
        ordered = sorted(workers, key=lambda v: v.worker_id)
        return ordered[next(self._decode) % len(ordered)]

    def order_prefill(self, workers):
        ordered = sorted(workers, key=lambda v: v.worker_id)
        start = next(self._prefill) % len(ordered) if ordered else 0
        return ordered[start:] + ordered[:start]


POLICIES = {cls.name: cls for cls in (LeastLoaded, RoundRobin)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
