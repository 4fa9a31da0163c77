"""Workloads for the simulator: a timed trace (shared/workloads/*.jsonl format) or Poisson
arrivals with lengths drawn from a trace's empirical distribution."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.block_hash import prefix_hashes


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    cached_len: int = 0  # leading prompt tokens found in a prefix cache (not computed, not shipped)

    @property
    def uncached_len(self) -> int:
        return self.prompt_len - self.cached_len


def with_hit_rate(requests: list[SimRequest], hit_rate: float, block_size: int = 16) -> list[SimRequest]:
    """The same requests with `hit_rate` of each prompt found cached (whole blocks, never the
    last token): what a measured prefix-cache hit rate means for the planner."""
    if not 0 <= hit_rate <= 1:
        raise ValueError(f"hit rate must be in [0, 1], got {hit_rate}")
    return [SimRequest(r.arrival_s, r.prompt_len, r.output_len,
                       min(int(hit_rate * r.prompt_len) // block_size * block_size,
                           (r.prompt_len - 1) // block_size * block_size)) for r in requests]


def load_trace(path: str | Path, block_size: int = 16) -> list[SimRequest]:
    """Read a JSONL trace (arrival_s, prompt_token_ids or prompt_len, max_tokens); ValueError
    naming the line and field on anything malformed. Where prompts are given as token ids,
    each request's `cached_len` is what a prefix cache holding every earlier prompt would
    supply (whole `block_size` blocks): the trace's own reuse, measured."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ValueError(f"trace {path} not found") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival = float(row["arrival_s"])
            ids = row.get("prompt_token_ids")
            prompt = len(ids) if ids is not None else int(row["prompt_len"])
            output = int(row["max_tokens"])
            if ids is not None:
                prefix_hashes(ids, block_size, b"")  # token ids must be integers
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace {path} line {number}: {type(exc).__name__}: {exc} "
                             f"(need arrival_s, prompt_token_ids or prompt_len, max_tokens)") from None
        if arrival < 0 or prompt < 1 or output < 1:
            raise ValueError(f"trace {path} line {number}: arrival_s >= 0, prompt and max_tokens >= 1 required")
        rows.append((arrival, prompt, output, ids))
    if not rows:
        raise ValueError(f"trace {path} has no requests")
    seen: set[bytes] = set()
    return [SimRequest(arrival, prompt, output, _cached_then_add(ids, seen, block_size) if ids else 0)
            for arrival, prompt, output, ids in sorted(rows, key=lambda r: r[0])]


def _cached_then_add(ids: list[int], seen: set[bytes], block_size: int) -> int:
    """Leading tokens of `ids` (short of the last) whose blocks are in `seen`; then add its own."""
    hashes = prefix_hashes(ids, block_size, b"")
    hit = 0
    for digest in hashes[: (len(ids) - 1) // block_size]:
        if digest not in seen:
            break
        hit += block_size
    seen.update(hashes)
    return hit


def hit_rate(requests: list[SimRequest]) -> float:
    """Cached prompt tokens / prompt tokens."""
    total = sum(r.prompt_len for r in requests)
    return sum(r.cached_len for r in requests) / total if total else 0.0


def trace_rate(requests: list[SimRequest]) -> float:
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else float("inf")


def rescale(requests: list[SimRequest], rate: float) -> list[SimRequest]:
    """The same requests with arrival times scaled to an average rate of `rate` per second."""
    factor = trace_rate(requests) / rate
    start = requests[0].arrival_s
    return [SimRequest((r.arrival_s - start) * factor, r.prompt_len, r.output_len, r.cached_len) for r in requests]


def poisson(rate: float, count: int, lengths: list[tuple[int, ...]], seed: int = 0) -> list[SimRequest]:
    """`count` Poisson arrivals at `rate`/s, lengths drawn from `lengths`: (prompt, output)
    or (prompt, output, cached) tuples."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, *rng.choice(lengths)))
    return out
