"""Offline throughput: pdserve's engine vs Hugging Face static batching, in one run.

Workload: shared/workloads/offline-mixed.jsonl (64 requests at t=0, ignore_eos, mixed
prompt and output lengths). HF runs them in arrival order in static batches of 8 and of
32 (left padding; every batch runs until its longest request is done, as static batching
does). pdserve runs all 64 through continuous batching.

Second measure: one decode step at batch 64 with ~300-token contexts, pdserve (the whole
engine step, and the model forward alone) vs a plain HF forward step with a DynamicCache.

Writes benchmarks/results/offline_throughput.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = ROOT.parent / "shared" / "workloads" / "offline-mixed.jsonl"
from benchmarks.report import panels, repo_relative, write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def load_workload(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_hf_static(model, requests: list[dict], batch_size: int, pad_id: int) -> dict:
    start = time.perf_counter()
    useful = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        longest = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding
            n = len(r["prompt_token_ids"])
            ids[row, longest - n :] = torch.tensor(r["prompt_token_ids"])
            mask[row, longest - n :] = 1
        new = max(r["max_tokens"] for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad_id)
        useful += sum(r["max_tokens"] for r in batch)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": useful, "output_tokens_per_s": useful / wall}


def run_pdserve(llm, requests: list[dict]) -> dict:
    from engine import SamplingParams

    prompts = [r["prompt_token_ids"] for r in requests]
    params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == sum(r["max_tokens"] for r in requests)
    return {"wall_s": wall, "output_tokens": produced, "output_tokens_per_s": produced / wall}


def decode_step_pdserve(llm, batch: int, context: int, steps: int) -> dict:
    """Median engine-step and forward-only time once `batch` requests are all decoding."""
    from engine import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps + 50, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"step-{i}", torch.randint(3, 40000, (context,), generator=gen).tolist(), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    step_times, forward_times = [], []
    runner, model = engine.runner, engine.loaded.model
    original_forward = model.forward

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        out = original_forward(*args, **kwargs)
        forward_times.append(time.perf_counter() - t)
        return out

    model.forward = timed_forward
    try:
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t)
    finally:
        model.forward = original_forward
        for i in range(batch):
            engine.abort_request(f"step-{i}")
    assert runner.kv_cache is not None
    return {"engine_step_ms_median": 1000 * statistics.median(step_times),
            "forward_ms_median": 1000 * statistics.median(forward_times)}


def decode_step_hf(model, batch: int, context: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40000, (batch, context), generator=gen)
    times = []
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            t = time.perf_counter()
            out = model(token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return {"forward_ms_median": 1000 * statistics.median(times)}


def plot(result: dict, path: Path) -> None:
    with panels(path, 2, width=5.0) as [ax1, ax2]:
        names = list(result["throughput"])
        ax1.bar(names, [result["throughput"][n]["output_tokens_per_s"] for n in names],
                color=["#2a7" if n == "pdserve" else "#999" for n in names])
        ax1.set_ylabel("output tokens/s")
        ax1.set_title("offline-mixed (64 requests)")
        step = result["decode_step"]
        labels = ["HF forward", "pdserve forward", "pdserve engine step"]
        values = [step["hf"]["forward_ms_median"], step["pdserve"]["forward_ms_median"],
                  step["pdserve"]["engine_step_ms_median"]]
        ax2.bar(labels, values, color=["#999", "#2a7", "#2a7"])
        ax2.set_ylabel("ms (median)")
        ax2.set_title(f"decode step, batch {step['batch']}, ~{step['context']}-token contexts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--step-batch", type=int, default=64)
    parser.add_argument("--step-context", type=int, default=300)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS / "offline_throughput.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.model_source import resolve_model

    requests = load_workload(args.workload)
    model_dir = resolve_model(args.model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    llm = LLM(args.model)
    result = {"workload": repo_relative(args.workload), "num_requests": len(requests),
              "torch_threads": torch.get_num_threads(), "throughput": {}}

    print("pdserve ...", flush=True)
    result["throughput"]["pdserve"] = run_pdserve(llm, requests)
    for bs in args.batch_sizes:
        print(f"HF static batch {bs} ...", flush=True)
        result["throughput"][f"hf_static_{bs}"] = run_hf_static(hf, requests, bs, pad_id)
    best_hf = max(v["output_tokens_per_s"] for k, v in result["throughput"].items() if k.startswith("hf"))
    result["throughput_ratio_vs_best_hf"] = result["throughput"]["pdserve"]["output_tokens_per_s"] / best_hf

    print("decode step ...", flush=True)
    step = {"batch": args.step_batch, "context": args.step_context,
            "pdserve": decode_step_pdserve(llm, args.step_batch, args.step_context, args.steps),
            "hf": decode_step_hf(hf, args.step_batch, args.step_context, args.steps)}
    hf_ms = step["hf"]["forward_ms_median"]
    step["forward_ratio_pdserve_over_hf"] = step["pdserve"]["forward_ms_median"] / hf_ms
    step["engine_step_ratio_pdserve_over_hf"] = step["pdserve"]["engine_step_ms_median"] / hf_ms
    result["decode_step"] = step

    write(result, args.out, plot)


if __name__ == "__main__":
    main()
