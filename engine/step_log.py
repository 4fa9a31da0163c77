"""What each engine step computed and how long it took, in the terms of the planner's
latency model (engine.profile): the record that checks the model against serving.

Off unless the environment variable PDSERVE_STEP_LOG names a directory; each engine driver
then appends one JSON line per step to `<dir>/<name>-<pid>.jsonl`:
`{"t": wall start, "s": seconds, "T": prefill tokens, "Q": their attention, "K": the part of it
over KV computed before the step, "B": decode rows, "C": their context, "u": CPU seconds of the
thread that ran the step, "p": CPU seconds of the whole process during it}`
(benchmarks/planner_validation.py reads them; logs from before "K" was recorded lack it, and
from before "u"/"p" those). On an engine of one torch thread, s - p is the time the core gave
to other processes (the router, the clients, Ray, a prefill worker's spill-over) and p - u the
worker's own other threads (RPCs, token streaming, KV receives); with more threads, u misses
torch's worker threads and p counts them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

ENV = "PDSERVE_STEP_LOG"


@dataclass(frozen=True)
class StepShape:
    """A step's work as the latency model counts it: chunks of several tokens are prefill
    (T tokens, Q = sum of chunk length x context reached, K = the part of Q over the context
    before the chunk: sum of chunk length x start position, KV a cached prefix or earlier
    chunks left in the cache); one-token rows are decode (B rows attending C context tokens
    in all)."""

    prefill_tokens: int = 0
    prefill_squared: int = 0
    decode_batch: int = 0
    decode_context: int = 0
    prefill_cached: int = 0

    @classmethod
    def of(cls, chunks) -> StepShape:
        """`chunks`: the scheduler's ScheduledChunks (token_ids, start_pos)."""
        tokens = squared = batch = context = cached = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if n == 1:
                batch += 1
                context += chunk.start_pos + 1
            else:
                tokens += n
                squared += n * (chunk.start_pos + n)
                cached += n * chunk.start_pos
        return cls(tokens, squared, batch, context, cached)


class StepLog:
    """Appends step records to a JSONL file when PDSERVE_STEP_LOG is set; else does nothing."""

    def __init__(self, name: str) -> None:
        directory = os.environ.get(ENV)
        self._file = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(directory) / f"{name or 'engine'}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def record(self, started_wall: float, seconds: float, shape: StepShape, thread_cpu: float | None = None,
               process_cpu: float | None = None) -> None:
        """One step: its wall start and seconds, its shape, and where known the CPU seconds the
        stepping thread spent in it ("u") and the whole process spent during it ("p")."""
        if self._file is not None:
            row = {"t": round(started_wall, 4), "s": round(seconds, 5), "T": shape.prefill_tokens,
                   "Q": shape.prefill_squared, "K": shape.prefill_cached, "B": shape.decode_batch,
                   "C": shape.decode_context}
            if thread_cpu is not None and process_cpu is not None:
                row.update(u=round(thread_cpu, 5), p=round(process_cpu, 5))
            self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_step_logs(directory: str | Path, name: str = "") -> list[dict]:
    """Every record under `directory` whose file name starts with `name`, by start time;
    each with its engine's "name" and "pid" (from the file name)."""
    rows = []
    for path in sorted(Path(directory).glob(f"{name}*.jsonl")):
        engine, pid = path.stem.rsplit("-", 1)
        rows += [{**json.loads(line), "name": engine, "pid": int(pid)}
                 for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["t"])
