"""Decode attention on the CPU against this machine's read bandwidth: a decode step's
attention over all 30 layers of SmolLM2-135M's shapes (9 query heads, 3 KV heads, head size
64, blocks of 16 tokens), each layer with a KV cache of its own, so that the step reads its
KV from memory as the engine's does (442 MB at batch 64 and 300 tokens of context in bf16).

Per dtype and batch, interleaved, median of `--repeats`:
- `contiguous`: each sequence's blocks one after another in the cache;
- `scattered`: the blocks at random places (a cache that has served a while);
- `uneven`: contexts from context/8 to 15 context/8 (the same mean), shortest first, each
  sequence's blocks one after another: a batch whose long contexts sit together, as a decode
  batch in arrival order may hold them (how the kernel shares sequences out among threads);
- `in_cache`: every sequence on the same blocks (one layer's KV stays in L2: the kernel's
  arithmetic alone);
- `read`: the same caches read by torch (the max of their 16-bit words), two threads: the
  bandwidth a plain read gets beside the kernel.
The kernel's GB/s is the KV it attends to over its time.

    .venv/bin/python benchmarks/decode_attention.py [--batches 16,64] [--context 300] [--dtypes bfloat16,float32]

Writes benchmarks/results/decode_attention.json (+ .png). Compare revisions with
`benchmarks/ab.py --ref REV -- decode_attention.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import grouped_bars, panels, write  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
LAYOUTS = ("contiguous", "scattered", "uneven", "in_cache")


def make(batch: int, context: int, dtype: torch.dtype, layout: str, seed: int = 0):
    """Per layer a (K, V) cache, and the block table and context lengths of the batch."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "uneven":
        lens = torch.linspace(context / 8, 15 * context / 8, batch).round().long()
        counts = (lens + BLOCK - 1) // BLOCK
        table = torch.zeros(batch, int(counts.max()), dtype=torch.long)
        for b, first in enumerate((counts.cumsum(0) - counts).tolist()):
            table[b, :counts[b]] = torch.arange(first, first + int(counts[b]))
        caches = [tuple(torch.randn(int(counts.sum()), BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                        for _ in range(2)) for _ in range(LAYERS)]
        return caches, table, lens, torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    blocks = -(-context // BLOCK)
    total = blocks if layout == "in_cache" else batch * blocks
    caches = [tuple(torch.randn(total, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
              for _ in range(LAYERS)]
    if layout == "in_cache":
        table = torch.arange(blocks).expand(batch, blocks)
    elif layout == "scattered":
        table = torch.randperm(total, generator=gen).view(batch, blocks)
    else:
        table = torch.arange(total).view(batch, blocks)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
    return caches, table.contiguous(), torch.full((batch,), context, dtype=torch.long), q


def main() -> None:
    from pdserve.engine.model.kernels import cpu_kernels

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "decode_attention.json")
    args = parser.parse_args()
    kernels = cpu_kernels()
    result = {"setup": {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
                        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK,
                                  "layers": LAYERS}, "context": args.context}, "runs": {}}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for batch in (int(b) for b in args.batches.split(",")):
            cases = {layout: make(batch, args.context, dtype, layout) for layout in LAYOUTS}
            kv_bytes = LAYERS * 2 * batch * args.context * KV_HEADS * HEAD_DIM * cases["contiguous"][3].element_size()

            def attend(caches, table, lens, q):
                for k, v in caches:
                    kernels.paged_decode_attention(q, k, v, table, lens, 0.125)

            def read(caches, *_):  # the max of each cache's 16-bit words: no float arithmetic
                for k, v in caches:
                    k.view(torch.int16).max()
                    v.view(torch.int16).max()

            runs = {**{layout: (attend, cases[layout]) for layout in LAYOUTS}, "read": (read, cases["contiguous"])}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for fn, case in runs.values():
                fn(*case)  # warm-up
            for _ in range(args.repeats):
                for name, (fn, case) in runs.items():  # interleaved
                    start = time.perf_counter()
                    fn(*case)
                    times[name].append(time.perf_counter() - start)
            ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
            result["runs"][f"{dtype_name}/{batch}"] = {
                "kv_mb": kv_bytes / 1e6, "ms": ms, "gb_s": {name: kv_bytes / t / 1e6 for name, t in ms.items()}}
            print(dtype_name, batch, {n: round(t, 2) for n, t in ms.items()}, flush=True)
            del cases
    write(result, args.out, plot)


def plot(result: dict, path: Path) -> None:
    with panels(path, 1, width=8) as (ax,):
        grouped_bars(ax, {key: run["gb_s"] for key, run in result["runs"].items()})
        ax.set_ylabel("GB/s of KV attended (all 30 layers)")

if __name__ == "__main__":
    main()
