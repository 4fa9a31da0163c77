"""The shared state of one router process (`Router`) and the log of its finished requests
(`FinishedRequest`), which the autoscaler's observations and the dashboard read."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine import stats
from pdserve.router.cache_index import PromptKeys
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import RouteRequest, decode_busy, make_policy

if TYPE_CHECKING:
    from pdserve.router.config import RouterConfig
    from pdserve.router.registry import WorkerRegistry, WorkerView

FINISHED_LOG_SIZE = 20000  # the latest finished requests the router remembers


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One sequence (one choice of a request) that finished with "stop" or "length" after
    its first token. `end` and `arrival` are time.monotonic() seconds."""

    end: float
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float | None  # None before two tokens
    cached_tokens: int  # prompt tokens reused from a prefix cache
    arrival: float


class Router:
    """Shared state of one router process: config, tokenizer, registry, policy, metrics."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, controller: Any = None) -> None:
        """`controller`: the cluster controller's actor handle (None: a bare router)."""
        self.config, self.registry, self.controller = config, registry, controller
        self.policy = make_policy(config.routing, config.cache_aware)
        self.metrics = RouterMetrics(registry, config.ttft_slo_s, config.tpot_slo_s)
        self.tokenizer = None
        self.created = int(time.time())  # GET /v1/models
        self.inflight = 0
        self.finished: deque[FinishedRequest] = deque(maxlen=FINISHED_LOG_SIZE)

    def observations(self, window_s: float, percentile: float = 90.0) -> dict:
        """What the autoscaler needs from the last `window_s` seconds of finished requests: count,
        rate, TTFT/TPOT percentiles, prefix-cache hit rate, and the latest 500 requests' lengths
        (prompt, completion, cached tokens) with their arrival times (monotonic seconds)."""
        now = time.monotonic()
        return summarize([r for r in self.finished if now - r.end <= window_s], window_s, percentile, self.inflight)

    async def start(self) -> None:
        from pdserve.engine.model_source import resolve_model
        from pdserve.engine.tokenizer import load_tokenizer

        model_dir = await asyncio.to_thread(resolve_model, self.config.model, True)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        await self.registry.start()

    def routing_summary(self) -> dict:
        """The policy and its cache index at a glance (`pdserve status`): per worker, the
        blocks the index holds for it (reported, expected); the requests the router counts
        on each decode worker; overall, the cached prompt tokens the index predicted vs
        those the workers found."""
        index = self.registry.cache_index
        workers = {w: dict(zip(("held", "expected"), index.size(w), strict=True)) for w in index.worker_ids()}
        load = {v.worker_id: decode_busy(v) for v in self.registry.workers("decode", routable=False)}
        return {"policy": self.policy.name, "index": workers, "decode_load": load,
                "expected_cached_tokens": self.metrics.cached_tokens["expected"],
                "actual_cached_tokens": self.metrics.cached_tokens["actual"]}

    def route_request(self, prompt: PromptKeys, session: str | None) -> RouteRequest:
        """What the policy knows of a request: its length, session, and the leading prompt
        tokens each routable worker is expected to have cached, and those after them its
        node's KV tier holds."""
        ids = [v.worker_id for role in ("decode", "prefill") for v in self.registry.candidates(role)]
        matched, tiered = self.registry.cache_index.matched_by_tier(ids, prompt)
        return RouteRequest(len(prompt.token_ids), session, matched, tiered)

    def pick_decode(self, route: RouteRequest, exclude: set[str] = frozenset()) -> WorkerView:
        workers = [w for w in self.registry.candidates("decode") if w.worker_id not in exclude]
        if not workers:
            raise APIError(503, "no decode worker is available; retry later", headers={"Retry-After": "1"})
        return self.policy.pick_decode(workers, route)

    def order_prefill(self, route: RouteRequest, decode: WorkerView) -> list[WorkerView]:
        return self.policy.order_prefill(self.registry.candidates("prefill"), route, decode)


def summarize(recent: list[FinishedRequest], window_s: float, percentile: float, inflight: int) -> dict:
    """`Router.observations`' answer from the requests that finished in the window (in the
    order they ended) and the requests open now; also how the controller merges every router
    replica's samples (cluster.actors.merge_observations)."""
    ttft = [r.ttft_s for r in recent if r.ttft_s is not None]
    tpot = [r.tpot_s for r in recent if r.tpot_s is not None]
    prompt_tokens = sum(r.prompt_tokens for r in recent)
    latest = recent[-500:]
    return {"count": len(recent), "rate": len(recent) / window_s, "ttft_p": stats.percentile(ttft, percentile),
            "tpot_p": stats.percentile(tpot, percentile),
            "hit_rate": sum(r.cached_tokens for r in recent) / prompt_tokens if prompt_tokens else 0.0,
            "lengths": [(r.prompt_tokens, max(1, r.completion_tokens), r.cached_tokens) for r in latest],
            "arrivals": [r.arrival for r in latest], "inflight": inflight}
