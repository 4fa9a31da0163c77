"""Where offline-mixed's time goes, per dtype: engine steps grouped by what they carry
(steps with prefill chunks; decode-only steps below 16, 16-47 and from 48 rows), each
group's total time and model-forward time, and each group's fp32 / bf16 ratio.

Runs offline-mixed once per dtype through `engine.LLM` (prefix caching off, so every
prompt is prefilled, as benchmarks/offline_throughput.py runs it) with `engine.step`
timed. It answers which steps hold the bf16 / fp32 ratio where it is: benchmarks/README.md
("Engine and precision") quotes it. Writes benchmarks/results/step_split.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.offline_throughput import DEFAULT_WORKLOAD, RESULTS, load_workload  # noqa: E402
from benchmarks.report import repo_relative, write  # noqa: E402


def kind(prefill_tokens: int, decode_rows: int) -> str:
    if prefill_tokens:
        return "prefill"
    return "decode <16" if decode_rows < 16 else "decode 16-47" if decode_rows < 48 else "decode >=48"


def split(model: str, dtype: str, requests: list[dict]) -> dict:
    """One timed pass of `requests`: per step kind, steps, seconds, forward seconds, rows."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, enable_prefix_caching=False)
    engine, forward_of = llm.engine, llm.engine.loaded.model
    llm.generate([r["prompt_token_ids"] for r in requests[:4]], SamplingParams(max_tokens=4, temperature=0))
    step, forward = engine.step, forward_of.forward
    groups: dict[str, dict] = {}
    last_forward = [0.0]

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            last_forward[0] = time.perf_counter() - start

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - start
        shape = engine.last_step_shape
        g = groups.setdefault(kind(shape.prefill_tokens, shape.decode_batch),
                              {"steps": 0, "seconds": 0.0, "forward_s": 0.0, "prefill_tokens": 0, "decode_rows": 0})
        g["steps"] += 1
        g["seconds"] += seconds
        g["forward_s"] += last_forward[0]
        g["prefill_tokens"] += shape.prefill_tokens
        g["decode_rows"] += shape.decode_batch
        return outputs

    engine.step, forward_of.forward = timed_step, timed_forward
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    try:
        llm.generate([r["prompt_token_ids"] for r in requests], params)
    finally:
        engine.step, forward_of.forward = step, forward
    return {"wall_s": time.perf_counter() - start, "groups": groups}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_split.json")
    args = parser.parse_args()
    requests = load_workload(args.workload)
    result = {"workload": repo_relative(args.workload), "dtypes": {}}
    for dtype in ("float32", "bfloat16"):
        print(f"[{dtype}] offline-mixed ...", flush=True)
        result["dtypes"][dtype] = split(args.model, dtype, requests)
    fp32, bf16 = (result["dtypes"][d]["groups"] for d in ("float32", "bfloat16"))
    result["fp32_over_bf16_seconds"] = {k: fp32[k]["seconds"] / bf16[k]["seconds"] for k in fp32 if k in bf16}
    decode = [k for k in fp32 if k.startswith("decode") and k in bf16]
    result["fp32_over_bf16_seconds"]["decode, all"] = (sum(fp32[k]["seconds"] for k in decode)
                                                       / sum(bf16[k]["seconds"] for k in decode))
    write(result, args.out)


if __name__ == "__main__":
    main()
