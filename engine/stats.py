"""Small statistics shared by the router, the planner and the benchmarks."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field


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


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds and has done, as of one moment between steps (`LLMEngine.load`)."""

    num_waiting: int  # requests queued for a batch slot (preempted ones too)
    num_running: int  # requests in the batch
    queued_prompt_tokens: int  # tokens to compute before they decode (Scheduler.queued_prompt_tokens)
    running_tokens: int  # the running requests' tokens (the context their decodes attend to)
    num_free_blocks: int  # KV blocks an allocation may take (cached ones it may evict too)
    num_total_blocks: int
    num_cached_blocks: int  # unreferenced blocks kept for their content
    num_preemptions: int
    prefix_cache_queries: int  # prompts looked up in the prefix cache
    prefix_cache_query_tokens: int  # their tokens
    prefix_cache_hit_tokens: int  # of which found cached
    prefill_tokens_computed: int  # prompt positions computed
    decode_tokens_computed: int  # positions of generated tokens computed
    # the second KV tier (engine.kv_tier); zero and empty when it is off
    kv_tier_hit_tokens: int = 0  # prompt tokens loaded from it (not in prefix_cache_hit_tokens)
    kv_tier_decisions: dict[str, int] = field(default_factory=dict)  # engine.kv_tier.DECISIONS -> requests
    kv_tier_blocks_written: int = 0  # blocks this engine wrote through to it
    kv_tier_bytes: int = 0  # bytes its store holds, node-wide
    kv_tier_read_bandwidth: float = 0.0  # bytes/s its reads measured (KVStore.read_bandwidth; 0: not yet)
    kv_tier_store: dict[str, int] = field(default_factory=dict)  # the rest of KVStore.stats: its counters, files, ...
