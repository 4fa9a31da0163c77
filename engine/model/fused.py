"""The token-wise ops of a decoder layer: the C++ kernels on the CPU, torch elsewhere.

Each function here is the reference: its torch body is what the CPU kernel of the same name
(csrc/fused_ops.cpp) computes, row by row, in one pass instead of one torch op per step (a
decode step at batch 64 ran ~7 of these ops per norm, 5 per RoPE). The torch body runs on
CUDA and on a CPU where the kernels cannot be built (or `PDSERVE_DISABLE_CPU_KERNEL=1`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.model.kernels import cpu_kernels


def _kernels(x: torch.Tensor):
    return cpu_kernels() if x.device.type == "cpu" else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as the reference implementation does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding `delta` (if given), and its RMSNorm.

    On the CPU kernel path `hidden` is updated in place and returned."""
    kernels = _kernels(hidden)
    if kernels is not None and hidden.is_contiguous():
        return hidden, kernels.add_rms_norm(hidden, None if delta is None else delta.contiguous(), weight, eps)
    if delta is not None:
        hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` of `[rows, 2I]` gate and up projections side by side."""
    kernels = _kernels(gate_up)
    if kernels is not None and gate_up.is_contiguous():
        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         num_q_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of the q and k heads of `qkv` (`[tokens, q_heads + 2 kv_heads, D]`: the
    fused projection's output as heads) at `positions`, with the tables `cos`/`sin`
    (`[max_len, D]`); returns q and k, and v (`qkv`'s last kv heads, as they are)."""
    kernels = _kernels(qkv)
    if kernels is not None and qkv.stride(2) == 1 and qkv.stride(1) == qkv.shape[2]:
        return kernels.rope(qkv, positions, cos, sin, num_q_heads, num_kv_heads)
    heads = num_q_heads + num_kv_heads
    qk, v = qkv[:, :heads], qkv[:, heads:]
    c, s = cos[positions][:, None], sin[positions][:, None]
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    out = qk * c + rotated * s
    return out[:, :num_q_heads], out[:, num_q_heads:], v
