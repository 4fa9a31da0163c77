"""Routing policies, found by name (`--routing`). A policy picks the decode worker that owns
a request and orders the prefill workers it may use (first choice, then the retry) for
what that decode worker lacks."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.router.registry import WorkerView


@dataclass
class RouteRequest:
    """What a policy may know of a request."""

    num_tokens: int  # prompt length
    session: str | None = None  # the client's `user` field, if any
    matched: dict[str, int] = field(default_factory=dict)  # worker id -> leading prompt tokens it has cached
    tier_matched: dict[str, int] = field(default_factory=dict)  # worker id -> the prompt tokens after those
    # that its node's second KV tier holds (it would load them rather than compute them)

    def cached_on(self, view: WorkerView, tier_weight: float = 1) -> float:
        """The prompt tokens `view`'s worker is expected to reuse: those in its KV cache plus
        `tier_weight` x those after them in its node's KV tier (1, the default: count them alike;
        an int then)."""
        return self.matched.get(view.worker_id, 0) + tier_weight * self.tier_matched.get(view.worker_id, 0)


@dataclass(frozen=True)
class CacheAwareWeights:
    """The cache-aware policy's exchange rates, in prompt tokens (one token to prefill costs 1).

    `request_tokens`: what one open request on a decode worker costs the next one there
    (its share of every decode step); the default makes a hot prefix of 1024 cached tokens
    worth 4 more open requests before a request goes elsewhere. `kv_tokens`: what a worker
    whose KV cache is full costs (scaled by the fraction in use). `tier_hit`: what a prompt
    token found in the worker's node's second KV tier is worth, one in its own KV cache being
    worth 1 and a miss 0 (a tier hit is loaded, not computed, but loading costs time and the
    worker may recompute instead; Dynamo weighs one 0.75 too)."""

    request_tokens: int = field(default=256, metadata={
        "help": "cache-aware: prompt tokens one open request on a decode worker is worth"})
    kv_tokens: int = field(default=512, metadata={"help": "cache-aware: prompt tokens a full KV cache is worth"})
    tier_hit: float = field(default=0.75, metadata={
        "help": "cache-aware: what a prompt token in the worker's node's KV tier is worth, 0..1 (1: one in "
                "its own KV cache, 0: a miss)"})

    def __post_init__(self) -> None:
        if self.request_tokens < 0 or self.kv_tokens < 0:
            raise ValueError(f"cache-aware weights must be >= 0: {self}")
        if not 0 <= self.tier_hit <= 1:
            raise ValueError(f"cache-aware tier_hit must be within 0..1: {self}")


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def pick_decode(self, workers: list[WorkerView], request: RouteRequest) -> WorkerView:
        """One of `workers` (never empty)."""

    @abstractmethod
    def order_prefill(self, workers: list[WorkerView], request: RouteRequest,
                      decode: WorkerView) -> list[WorkerView]:
        """`workers` in the order to try them, for a request owned by `decode`."""


def decode_busy(view: WorkerView) -> int:
    """Requests on a decode worker: this router's open ones (counted as it opens and closes
    them) plus the others' (router replicas', direct clients') by the worker's last report."""
    return view.open_requests + view.others_busy


def kv_free_fraction(view: WorkerView) -> float:
    s = view.stats
    return s.num_free_blocks / max(1, s.num_total_blocks) if s else 1.0


class LeastLoaded(RoutingPolicy):
    """Decode: fewest requests, then most free KV blocks. Prefill: fewest queued prompt
    tokens (the worker's report plus what this router sent since)."""

    name = "least-loaded"

    def pick_decode(self, workers, request):
        return min(workers, key=lambda v: (decode_busy(v), -kv_free_fraction(v), v.tiebreak, v.worker_id))

    def order_prefill(self, workers, request, decode):
        return sorted(workers, key=lambda v: (v.queued_prefill_tokens, v.tiebreak, v.worker_id))


class RoundRobin(RoutingPolicy):
    name = "round-robin"

    def __init__(self) -> None:
        self._decode = itertools.count()
        self._prefill = itertools.count()

    def pick_decode(self, workers, request):
        ordered = sorted(workers, key=lambda v: v.worker_id)
        return ordered[next(self._decode) % len(ordered)]

    def order_prefill(self, workers, request, decode):
        ordered = sorted(workers, key=lambda v: v.worker_id)
        start = next(self._prefill) % len(ordered) if ordered else 0
        return ordered[start:] + ordered[:start]


class CacheAware(RoutingPolicy):
    """Decode: the lowest cost in prompt tokens, where

        cost = uncached prompt tokens + its queued prompt tokens
               + request_tokens x open requests + kv_tokens x KV fraction in use

    where a prompt token in the worker's node's KV tier counts `tier_hit` cached (weights),
    so the worker holding a conversation's KV wins until it is busier than the reuse is
    worth, and a hot prefix spreads once its worker is loaded. A request naming a session
    (`user`) counts its whole prompt as cached on the decode worker that served that session
    last. Ties go to the least loaded. Prefill: fewest prompt tokens its own cache lacks plus
    queued ones (its node's tier weighed likewise)."""

    name = "cache-aware"
    max_sessions = 100_000

    def __init__(self, weights: CacheAwareWeights | None = None) -> None:
        self.weights = weights or CacheAwareWeights()
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> decode worker id

    def decode_cost(self, view: WorkerView, request: RouteRequest) -> float:
        """The cost above of `request` on decode worker `view`, in prompt tokens."""
        return self._decode_key(view, request, self._sessions.get(request.session))[0]

    def _decode_key(self, view: WorkerView, request: RouteRequest, sticky: str | None) -> tuple:
        """(cost, open requests, -free KV fraction, tie-break, id): what `pick_decode` minimises, with
        each load term computed once. `sticky`: the decode worker that served the request's
        session last (None: no session, or none remembered)."""
        busy, free = decode_busy(view), kv_free_fraction(view)
        cached = request.cached_on(view, self.weights.tier_hit)
        if sticky is not None and sticky == view.worker_id:
            cached = max(cached, request.num_tokens - 1)
        queued = view.stats.queued_prefill_tokens if view.stats else 0
        cost = (request.num_tokens - cached + queued + self.weights.request_tokens * busy
                + self.weights.kv_tokens * (1 - free))
        return cost, busy, -free, view.tiebreak, view.worker_id

    def pick_decode(self, workers, request):
        sticky = self._sessions.get(request.session) if request.session is not None else None
        best = min(workers, key=lambda v: self._decode_key(v, request, sticky))
        if request.session is not None:
            self._sessions[request.session] = best.worker_id
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return best

    def order_prefill(self, workers, request, decode):
        # A prefill worker computes every prompt token its own cache lacks (the decode
        # worker's cached blocks spare the shipping, not the computing: later tokens attend
        # to them), so its cost is what it lacks plus its queue.
        tier_hit = self.weights.tier_hit
        return sorted(workers, key=lambda v: (request.num_tokens - request.cached_on(v, tier_hit)
                                              + v.queued_prefill_tokens, v.tiebreak, v.worker_id))


POLICIES = {cls.name: cls for cls in (CacheAware, LeastLoaded, RoundRobin)}
DEFAULT_POLICY = CacheAware.name


def make_policy(name: str, weights: CacheAwareWeights | None = None) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(POLICIES)}")
    return CacheAware(weights) if name == CacheAware.name else POLICIES[name]()
