"""This machine's ceilings, measured: memory bandwidth and matmul peak per dtype, and what
one decode step or one prefill token must move and compute for a given model.

A decode step reads every weight once and every cached K/V it attends to; its memory
roofline is those bytes over the bandwidth. Its compute floor is its matmul FLOPs over the
dtype's matmul peak. A step can be no faster than the larger of the two.
"""

from __future__ import annotations

import time

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
    tensors = [model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
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
