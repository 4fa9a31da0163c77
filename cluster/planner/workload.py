"""Workloads for the simulator: a timed trace (shared/workloads/*.jsonl format) or Poisson
arrivals with lengths drawn from a trace's empirical distribution."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_len: int
    output_len: int


def load_trace(path: str | Path) -> list[SimRequest]:
    """Read a JSONL trace (arrival_s, prompt_token_ids or prompt_len, max_tokens); ValueError
    naming the line and field on anything malformed."""
    out = []
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
            prompt = len(row["prompt_token_ids"]) if "prompt_token_ids" in row else int(row["prompt_len"])
            output = int(row["max_tokens"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace {path} line {number}: {type(exc).__name__}: {exc} "
                             f"(need arrival_s, prompt_token_ids or prompt_len, max_tokens)") from None
        if arrival < 0 or prompt < 1 or output < 1:
            raise ValueError(f"trace {path} line {number}: arrival_s >= 0, prompt and max_tokens >= 1 required")
        out.append(SimRequest(arrival, prompt, output))
    if not out:
        raise ValueError(f"trace {path} has no requests")
    return sorted(out, key=lambda r: r.arrival_s)


def trace_rate(requests: list[SimRequest]) -> float:
    span = requests[-1].arrival_s - requests[0].arrival_s
    return (len(requests) - 1) / span if span > 0 else float("inf")


def rescale(requests: list[SimRequest], rate: float) -> list[SimRequest]:
    """The same requests with arrival times scaled to an average rate of `rate` per second."""
    factor = trace_rate(requests) / rate
    start = requests[0].arrival_s
    return [SimRequest((r.arrival_s - start) * factor, r.prompt_len, r.output_len) for r in requests]


def poisson(rate: float, count: int, lengths: list[tuple[int, int]], seed: int = 0) -> list[SimRequest]:
    """`count` Poisson arrivals at `rate`/s, (prompt, output) lengths drawn from `lengths`."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        prompt, output = rng.choice(lengths)
        out.append(SimRequest(t, prompt, output))
    return out
