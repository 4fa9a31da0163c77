"""The engine's own speed on this machine right now, in a few seconds.

A persistent engine process, pinned like a worker (taskset, threads), times on request the
profile's kinds of step at a few fixed shapes: a 128-token prompt's prefill, and decode
steps of 1 and of 8 requests at 16 context tokens. benchmarks/planner_validation.py takes
one just before every replay, with no service up, and scales each round's calibrated profile
by the speed it reads against the speed read before that round's calibration replay.

Why: on this shared host the engine's speed moved 2x within minutes (in one validation a
run's decode steps took 0.38-1.65x what its round's calibration, 2-20 minutes earlier, said),
while a point's attainment at a tight TPOT moves 1-4 pp per 1% of step time. A profile is a
measurement of the host at one moment; a planner on such a host must read the host's speed
when it plans, as an operator re-profiles before sizing pools. The engine stays loaded
between probes (one load, not one per replay) and idles on a blocking read between them.

Run as a script it is that process: `python benchmarks/engine_probe.py --model DIR` reads a
line per probe on stdin and answers each with a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFILL_REPEATS = 6  # timed steps per shape (median): decode steps vary more (+-10% over 8 steps)
DECODE_REPEATS = 24
PREFILL_TOKENS = 128  # (a probe takes ~10 s on one core of this host; 256 tokens and 128 context made it 15 s)
DECODE_CONTEXT = 16
KV_CACHE_BYTES = 64 << 20  # enough for the probe's few hundred tokens; leaves the RAM to the workers


class EngineProbe:
    """An engine process pinned to `cores` with `threads` threads; `start()` then `result()`
    reads {"prefill_s": seconds of the 128-token prefill step, "decode_s": seconds of the batch-1
    and batch-8 decode steps together}, medians over PREFILL_REPEATS and DECODE_REPEATS
    steps. Close it (or use `with`)."""

    def __init__(self, model: str, cores: str, threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.process = subprocess.Popen(
            ["taskset", "-c", cores, sys.executable, str(Path(__file__).resolve()), "--model", model,
             "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self._read()  # "ready" once the model is loaded and warmed up

    def start(self) -> None:
        """Ask for a measurement without waiting for it (`result()` collects it), so that
        probes on different cores run at once, as the workers they stand for do."""
        self.process.stdin.write("probe\n")
        self.process.stdin.flush()

    def result(self) -> dict:
        return self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"engine probe exited (code {self.process.poll()}); its stderr says why")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def __enter__(self) -> EngineProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def measure(engine) -> dict:
    from cluster.planner.profiler import time_decode_step, time_prefill_step

    return {"prefill_s": time_prefill_step(engine, [PREFILL_TOKENS], PREFILL_REPEATS),
            "decode_s": sum(time_decode_step(engine, batch, DECODE_CONTEXT, DECODE_REPEATS) for batch in (1, 8))}


def main() -> None:
    parser = argparse.ArgumentParser(description="an engine speed probe process (see the module docstring)")
    parser.add_argument("--model", required=True, help="model directory or name")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=KV_CACHE_BYTES, max_model_len=256,
                                    enable_prefix_caching=False))
    measure(engine)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(measure(engine)), flush=True)


if __name__ == "__main__":
    main()
