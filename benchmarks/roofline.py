"""This machine's ceilings, measured: memory bandwidth and matmul peak per dtype, and what
one decode step or one prefill token must move and compute for a given model; run as a
script, the attainable floor of each step shape and the fraction of it the engine reaches.

A decode step reads every weight once and every cached K/V it attends to; its memory
roofline is those bytes over the bandwidth. Its compute floor is its matmul FLOPs over the
dtype's matmul peak. A step can be no faster than the larger of the two.

The attainable floor of a step (`step_floor`), part by part: the linear layers (with the LM
head) at the larger of their products at the matmul peak and their weight reads at the
bandwidth (the reads stream under the products); attention at the larger of its products
(QK^T and PV) at the same peak and its KV reads at the bandwidth. The two parts run one after
the other (a layer's attention needs its q; its output feeds the next product), so the floor
is their sum. Elementwise work (norms, RoPE, SwiGLU, the KV writes) is counted as time
spent, with no floor of its own.

    .venv/bin/python benchmarks/roofline.py [--dtypes bfloat16,float32] [--prefill 512,2048,8000]
        [--decode-batches 1,16,64] [--context 300]

runs each step shape on the offline engine (the embedded SmolLM2-135M, prefix caching off,
chunks of `--chunk` tokens), times where its model time goes, and writes
benchmarks/results/roofline.json (+ .png): per shape and dtype the floor of each part, the
measured time of each (and, outside the model, the sampler's per decode step), and the
fractions; the CPU's flags say which kernels ran (AVX-512, avx512_bf16, AMX tiles for bf16
where amx_bf16 is listed, or the AVX2 build), unless `isa_limits` records a narrower build.
An AVX2 CPU's engine, measured on this one:

    PDSERVE_CPU_KERNEL_MARCH=haswell ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        .venv/bin/python benchmarks/roofline.py --dtypes float32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict:
    """Bytes/s of a large read (a sum over `gib` GiB) and of a large copy (read + write)."""
    n = int(gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32)
    read = n * 4 / _best_seconds(lambda: src.sum(), repeats)
    dst = torch.empty_like(src[: n // 2])
    copy = 2 * (n // 2) * 4 / _best_seconds(lambda: dst.copy_(src[: n // 2]), repeats)
    return {"read_gb_s": read / 1e9, "copy_gb_s": copy / 1e9, "bandwidth_gb_s": max(read, copy) / 1e9}


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (best of `repeats`): the faster of torch.mm
    and the engine's own product on a packed weight (engine.model.linear), since either
    library may be the slow one on a given CPU (MKL's fp32 ran at 40% of oneDNN's on an
    AMD EPYC)."""
    from pdserve.engine.model.linear import linear, pack

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    packed = pack(b)
    best = min(_best_seconds(lambda: torch.mm(a, b), repeats), _best_seconds(lambda: linear(a, packed), repeats))
    return 2 * n**3 / best


def weight_bytes(model) -> int:
    """Bytes a forward reads of weights: every layer's matrices and norms, the final norm and
    the LM head (the embedding lookup touches a few rows only)."""
    from pdserve.engine.model.linear import PanelWeight

    tensors = [model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor | PanelWeight)]
    return sum(t.numel() * t.element_size() for t in tensors)


def matmul_params(model, with_lm_head: bool) -> int:
    """Weights that take part in matmuls per token (the LM head only where logits are made)."""
    count = sum(t.numel() for layer in model.layers for name, t in vars(layer).items()
                if name.endswith("_weight"))
    return count + (model.lm_head.numel() if with_lm_head else 0)


def kv_bytes_per_token(model) -> int:
    """Bytes of one token's K and V over all layers."""
    s = model.shape
    element = torch.empty((), dtype=model.dtype).element_size()
    return s.num_layers * 2 * s.num_kv_heads * s.head_dim * element


def attention_flops(model, query_tokens: int, mean_context: float) -> float:
    """QK^T and PV: 4 FLOPs per (query, key, head, dim)."""
    s = model.shape
    return 4.0 * query_tokens * mean_context * s.num_heads * s.head_dim * s.num_layers


def decode_step_bounds(model, batch: int, mean_context: float, bandwidth: float, peak: float) -> dict:
    """The memory roofline and the compute floor (ms) of one decode step, and its floor
    without overlap: the products at the matmul peak plus the KV read at the bandwidth, one
    after the other. A layer's attention needs its q, and its next product needs the
    attention's output, so a step overlaps the two only by fetching a layer's KV ahead while
    earlier products run; an engine that does not (this one does not) is no faster than
    that floor."""
    kv = batch * mean_context * kv_bytes_per_token(model)
    moved = weight_bytes(model) + kv
    products = 2.0 * matmul_params(model, with_lm_head=True) * batch
    flops = products + attention_flops(model, batch, mean_context)
    return {"bytes": moved, "flops": flops, "memory_roofline_ms": 1000 * moved / bandwidth,
            "compute_floor_ms": 1000 * flops / peak,
            "no_overlap_floor_ms": 1000 * (products / peak + kv / bandwidth)}


def prefill_flops_per_token(model, mean_context: float) -> float:
    return 2.0 * matmul_params(model, with_lm_head=False) + attention_flops(model, 1, mean_context)


def step_floor(model, *, products_flops: float, attention_flops: float, weight_reads: float, kv_reads: float,
               bandwidth: float, peak: float) -> dict:
    """The attainable floor (ms) of a step and of its two parts (see the module docstring)."""
    linear = max(products_flops / peak, weight_reads / bandwidth)
    attention = max(attention_flops / peak, kv_reads / bandwidth)
    return {"linear_ms": 1000 * linear, "attention_ms": 1000 * attention, "step_ms": 1000 * (linear + attention),
            "linear_bound_by": "compute" if products_flops / peak >= weight_reads / bandwidth else "memory",
            "attention_bound_by": "compute" if attention_flops / peak >= kv_reads / bandwidth else "memory"}


def prefill_floor(model, length: int, chunk: int, bandwidth: float, peak: float) -> dict:
    """One prompt of `length` tokens in chunks of `chunk`: every token through the linear
    layers (the LM head for the last one), each attending to its causal prefix; every chunk
    reads the weights once and, at the least, the K/V of the prefix once."""
    chunks = [min(chunk, length - start) for start in range(0, length, chunk)]
    prefix_tokens = sum(start + n for start, n in zip(range(0, length, chunk), chunks, strict=True))
    return step_floor(model, products_flops=2.0 * (matmul_params(model, False) * length + model.lm_head.numel()),
                      attention_flops=attention_flops(model, length, (length + 1) / 2),
                      weight_reads=weight_bytes(model) * len(chunks),
                      kv_reads=prefix_tokens * kv_bytes_per_token(model), bandwidth=bandwidth, peak=peak)


def decode_floor(model, batch: int, context: float, bandwidth: float, peak: float) -> dict:
    return step_floor(model, products_flops=2.0 * matmul_params(model, True) * batch,
                      attention_flops=attention_flops(model, batch, context), weight_reads=weight_bytes(model),
                      kv_reads=batch * context * kv_bytes_per_token(model), bandwidth=bandwidth, peak=peak)


class PartTimer:
    """Wall time spent in the model's attention, its linear layers (the LM head's included,
    and the gated gate/up product with its silu epilogue) and its whole forward, and in the
    sampler (outside the model), while installed (a context manager)."""

    def __init__(self, model) -> None:
        import pdserve.engine.model.llama as llama
        import pdserve.engine.model_runner as runner

        self.llama, self.runner, self.model = llama, runner, model
        self.spent = {"attention": 0.0, "linear": 0.0, "forward": 0.0, "lm_head": 0.0, "sample": 0.0}
        self.in_lm_head = False

    def _timed(self, name, fn):
        def run(*args, **kwargs):
            if name == "linear" and self.in_lm_head:  # counted as the LM head's
                return fn(*args, **kwargs)
            self.in_lm_head = name == "lm_head"
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start
                if name == "lm_head":
                    self.in_lm_head = False
        return run

    def __enter__(self):
        llama, model = self.llama, self.model
        self.saved = (llama.paged_attention, llama.linear, llama.gated_linear, model.forward)
        self.saved_sampler = self.runner.sample_with_logprobs
        self.runner.sample_with_logprobs = self._timed("sample", self.saved_sampler)
        llama.paged_attention = self._timed("attention", llama.paged_attention)
        llama.linear = self._timed("linear", llama.linear)
        llama.gated_linear = self._timed("linear", llama.gated_linear)
        model.forward = self._timed("forward", model.forward)
        model.compute_logits = self._timed("lm_head", model.compute_logits)
        return self

    def __exit__(self, *exc) -> None:
        self.llama.paged_attention, self.llama.linear, self.llama.gated_linear, self.model.forward = self.saved
        self.runner.sample_with_logprobs = self.saved_sampler
        del self.model.compute_logits  # the instance attribute shadowed the method

    def parts_ms(self, steps: int = 1) -> dict:
        s = {k: 1000 * v / steps for k, v in self.spent.items()}
        return {"attention_ms": s["attention"], "linear_ms": s["linear"] + s["lm_head"],
                "other_ms": s["forward"] - s["attention"] - s["linear"], "model_ms": s["forward"] + s["lm_head"],
                "sample_ms": s["sample"]}


def fractions(floor: dict, measured: dict) -> dict:
    return {"step": floor["step_ms"] / measured["model_ms"], "linear": floor["linear_ms"] / measured["linear_ms"],
            "attention": floor["attention_ms"] / measured["attention_ms"]}


def measure_prefill(llm, length: int, repeats: int) -> dict:
    """The model's parts over one prompt's prefill (its time to first token, less the
    scheduler's and sampler's share), the repeat with the median model time."""
    from pdserve.engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0)
    runs = []
    for r in range(repeats):
        prompt = torch.randint(3, 40000, (length,), generator=torch.Generator().manual_seed(r)).tolist()
        with PartTimer(llm.engine.loaded.model) as timer:
            start = time.perf_counter()
            llm.generate([prompt], params)
            wall = time.perf_counter() - start
        runs.append({**timer.parts_ms(), "ttft_ms": 1000 * wall})
    return sorted(runs, key=lambda run: run["model_ms"])[len(runs) // 2]


def start_decoding(engine, batch: int, context: int, max_tokens: int, prefix: str) -> list[str]:
    """Add `batch` requests of `context` random prompt tokens (ids `prefix`-i) and step the
    engine until every one of them decodes; returns their ids (the caller aborts them)."""
    from pdserve.engine import SamplingParams

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"{prefix}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, torch.randint(3, 40000, (context,), generator=gen).tolist(), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # every request decoding from here on
    return ids


def measure_decode(llm, batch: int, context: int, steps: int) -> dict:
    """The model's parts per decode step once `batch` requests of `context` prompt tokens
    all decode (means over `steps` steps)."""
    engine = llm.engine
    ids = start_decoding(engine, batch, context, steps + 8, "floor")
    step_times = []
    try:
        with PartTimer(engine.loaded.model) as timer:
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                step_times.append(1000 * (time.perf_counter() - start))
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    return {**timer.parts_ms(steps), "engine_step_ms_median": statistics.median(step_times)}


def cpu_flags() -> list[str]:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted({f for f in flags.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma"))})


# What narrows the instruction set below the CPU's flags, to measure an older CPU's engine here:
# the kernels' -march (PDSERVE_CPU_KERNEL_MARCH=haswell: AVX2), oneDNN's and ATen's ISA.
ISA_LIMITS = ("PDSERVE_CPU_KERNEL_MARCH", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def isa_limits() -> dict[str, str]:
    return {name: os.environ[name] for name in ISA_LIMITS if os.environ.get(name)}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.report import grouped_bars, panels, write
    from pdserve.engine import LLM

    parser = argparse.ArgumentParser(description="attainable floor per step shape, and the fraction reached")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--prefill", default="512,2048,8000", help="prompt lengths (SmolLM2 holds 8,192 positions)")
    parser.add_argument("--decode-batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens of each decoding request")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch")
    parser.add_argument("--repeats", type=int, default=3, help="prefills timed per length")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "roofline.json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.prefill.split(",")]
    batches = [int(b) for b in args.decode_batches.split(",")]
    # this VM's bandwidth moves between runs (49 and 78 GB/s seen on one host): it is measured
    # before each dtype and at the end, and the floors use the highest (the strictest floor)
    bandwidths = [memory_bandwidth()["bandwidth_gb_s"]]
    result: dict = {"setup": {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "cpu_flags": cpu_flags(),
                              "isa_limits": isa_limits(),
                              "load_average": os.getloadavg(), "chunk": args.chunk, "context": args.context,
                              "matmul_peak_gflop_s": {}},
                    "shapes": {}}
    pending = []  # (shape key, floor as a function of the bandwidth, measured)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        peak = matmul_peak(dtype)
        result["setup"]["matmul_peak_gflop_s"][name] = peak / 1e9
        longest = max(max(lengths), args.context + args.steps + 8)  # a prefill, or a decoding request's end
        llm = LLM(dtype=name, max_model_len=longest + 16, max_num_batched_tokens=args.chunk,
                  max_num_seqs=max(batches), enable_prefix_caching=False)
        model = llm.engine.loaded.model
        measure_prefill(llm, 64, 1)  # warm-up
        for length in lengths:
            pending.append((f"{name}/prefill {length}",
                            partial(prefill_floor, model, length, args.chunk, peak=peak),
                            measure_prefill(llm, length, args.repeats)))
        for batch in batches:
            pending.append((f"{name}/decode {batch}",
                            partial(decode_floor, model, batch, args.context + args.steps / 2, peak=peak),
                            measure_decode(llm, batch, args.context, args.steps)))
        del llm
        bandwidths.append(memory_bandwidth()["bandwidth_gb_s"])
    result["setup"]["bandwidths_gb_s"] = bandwidths
    result["setup"]["bandwidth_gb_s"] = max(bandwidths)
    for key, floor_at, measured in pending:
        floor = floor_at(bandwidth=max(bandwidths) * 1e9)
        reached = fractions(floor, measured)
        result["shapes"][key] = {"floor": floor, "measured": measured, "fraction_of_floor": reached}
        print(key, {k: round(v, 2) for k, v in reached.items()}, flush=True)

    def plot(res: dict, path: Path) -> None:
        with panels(path, 1, width=10) as (ax,):
            grouped_bars(ax, {key: shape["fraction_of_floor"] for key, shape in res["shapes"].items()}, rotation=35,
                         fontsize=7)
            ax.axhline(0.7, color="grey", linestyle="--", linewidth=0.8)
            ax.set_ylabel("fraction of the attainable floor")

    write(result, args.out, plot)


if __name__ == "__main__":
    main()
