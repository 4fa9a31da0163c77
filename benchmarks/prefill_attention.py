"""Prefill attention on the CPU, one layer of SmolLM2-135M's shapes (9 query heads, 3 KV heads,
head size 64, blocks of 16), side by side in one run: a prompt of L tokens prefilled in
chunks of `--chunk` tokens (each chunk attending to everything cached before it), by

- `per_token`: the decode kernel with every query as a sequence of its own (the engine's
  prefill path before the tiled kernel);
- `tiled/T`: paged_prefill_attention with tiles of T queries (the same bits per token);
- `sdpa`: torch's scaled_dot_product_attention on the gathered K/V (the fp32 prefill path;
  its bits depend on the chunking).

Median of `--repeats` per entry, interleaved. JSON (+ PNG).

    .venv/bin/python benchmarks/prefill_attention.py [--lengths 512,2048,8192] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import grouped_bars, panels, write  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def make(length: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (length + BLOCK - 1) // BLOCK
    shape = (num_blocks + 8, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)
    table = torch.randperm(num_blocks + 8, generator=gen)[:num_blocks].contiguous()
    q = torch.randn(length, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return q, k_cache, v_cache, table


def chunks(length: int, chunk: int):
    return [(start, min(chunk, length - start)) for start in range(0, length, chunk)]


def per_token(kernels, q, k_cache, v_cache, table, length, chunk):
    for start, n in chunks(length, chunk):
        tables = table[None].expand(n, -1).contiguous()
        lens = torch.arange(start + 1, start + n + 1)
        kernels.paged_decode_attention(q[start:start + n].contiguous(), k_cache, v_cache, tables, lens, 0.125)


def tiled(tile):
    def run(kernels, q, k_cache, v_cache, table, length, chunk):
        for start, n in chunks(length, chunk):
            kernels.paged_prefill_attention(q[start:start + n].contiguous(), k_cache, v_cache, table, start, 0.125,
                                            tile)
    return run


def sdpa(kernels, q, k_cache, v_cache, table, length, chunk):
    for start, n in chunks(length, chunk):
        ctx = start + n
        keys = k_cache[table].view(-1, KV_HEADS, HEAD_DIM)[:ctx]
        values = v_cache[table].view(-1, KV_HEADS, HEAD_DIM)[:ctx]
        mask = torch.arange(ctx)[None, :] <= torch.arange(start, ctx)[:, None]
        F.scaled_dot_product_attention(q[start:ctx].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                       values.transpose(0, 1)[None], attn_mask=mask, scale=0.125, enable_gqa=True)


def main() -> None:
    from pdserve.engine.model.kernels import cpu_kernels

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--tiles", default="4,8,16,32")
    parser.add_argument("--chunk", type=int, default=2048, help="tokens per prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-baselines", action="store_true",
                        help="time the tiled kernel only (per_token and sdpa take minutes at 8,192 tokens)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill_attention.json")
    args = parser.parse_args()
    kernels = cpu_kernels()
    methods = {f"tiled/{t}": tiled(int(t)) for t in args.tiles.split(",")}
    if not args.no_baselines:
        methods = {"per_token": per_token, **methods, "sdpa": sdpa}
    result = {"setup": {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
                        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
                        "chunk": args.chunk}, "runs": {}}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for length in (int(n) for n in args.lengths.split(",")):
            case = make(length, dtype)
            times: dict[str, list[float]] = {name: [] for name in methods}
            for _ in range(args.repeats):
                for name, fn in methods.items():  # interleaved
                    start = time.perf_counter()
                    fn(kernels, *case, length, args.chunk)
                    times[name].append(time.perf_counter() - start)
            medians = {name: statistics.median(values) for name, values in times.items()}
            result["runs"][f"{dtype_name}/{length}"] = {"seconds": medians}
            if "per_token" in medians:
                result["runs"][f"{dtype_name}/{length}"]["speedup_over_per_token"] = {
                    n: medians["per_token"] / s for n, s in medians.items()}
            print(dtype_name, length, {n: round(s, 4) for n, s in medians.items()}, flush=True)
    write(result, args.out, plot)


def plot(result: dict, path: Path) -> None:
    with panels(path, 1, width=9) as (ax,):
        if all("speedup_over_per_token" in run for run in result["runs"].values()):
            grouped_bars(ax, {key: run["speedup_over_per_token"] for key, run in result["runs"].items()}, rotation=30)
            ax.set_ylabel("x per-token kernel (one layer's prefill attention)")
        else:
            grouped_bars(ax, {key: run["seconds"] for key, run in result["runs"].items()}, rotation=30)
            ax.set_ylabel("seconds (one layer's prefill attention)")

if __name__ == "__main__":
    main()
