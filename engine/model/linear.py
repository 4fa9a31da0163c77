"""Linear layers, with weights pre-packed on the CPU: into panels for the engine's own kernel
where the CPU has AVX-512 (avx512_bf16 for bf16), otherwise for oneDNN.

With AVX-512: `panel_linear` (csrc/panel_linear.cpp) on a `PanelWeight`, in bf16 and fp32;
SwiGLU's gate and up projections as one gated PanelWeight whose product `gated_linear` ends
in silu(gate) * up while each panel's outputs sit in L1 (`panel_silu_mul`, the bits of the
product followed by `silu_mul`).
It gives oneDNN's bits (the same summation order, which it documents) at every row count,
so a worker that cannot build the kernels computes what one that can does, and it streams
the weights faster at decode's few rows (benchmarks/linear_bf16.py compares the two).
On a CPU with AMX (an Intel Xeon with amx_bf16), bf16 panels whose inputs are a multiple of
32 run on AMX tiles instead (csrc/panel_amx.h), 16 or 32 rows at a time, at every row count:
a row's bits still never depend on the rows beside it, but they are the tiles' own, not
oneDNN's (nor vdpbf16ps'), so there a worker without the kernels (oneDNN, below) differs from
one with them in the last bits.
Through oneDNN: `F.linear` on bf16 CPU tensors reorders the weight into oneDNN's blocked
layout on every call; packing it once at load (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor's CPU backend does) makes the small-batch products of decode steps 1.4-2.2x
faster (measured at 1-64 rows on SmolLM2's shapes) with bit-identical results. fp32
`F.linear` goes to MKL, which on an AMD EPYC (Zen 5, measured) runs a 2048^3 product at 165
GFLOP/s where oneDNN's packed kernel runs 416, and SmolLM2's decode-step shapes 2.5-4x
faster at 64 rows. The results differ from MKL's in the last bits (a different summation
order): fp32 stays token-identical to Hugging Face in the parity tests, not bit-identical.
A row's bits must not depend on how many rows share the product (batch invariance): MKL's
differ below 8 rows, oneDNN's only at 1 row, which `linear` avoids.
With AMX and no kernels, oneDNN's bf16 products take other kernels past 32 rows, and these
differ from the small-row one, and among themselves by row count (33 vs 40 rows, 64 vs 512),
in the last bits of real activations; there `linear` runs a bf16 product of more rows as
products of at most 32 (AMX_INVARIANT_ROWS), which costs 1.5-3.2x the linear time at 64-2048
rows (benchmarks/results/linear_rows.json) and keeps a row's bits the same at any row count.
Elsewhere (CUDA, fp16, a torch build without the op) weights stay plain tensors and
`linear` is `F.linear`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.model.fused import silu_mul
from pdserve.engine.model.kernels import cpu_kernels

logger = logging.getLogger(__name__)

AMX_INVARIANT_ROWS = 32  # the most rows oneDNN's bf16 product runs on its one small-row kernel with AMX


def cpu_has_amx() -> bool:
    """Whether this CPU reports AMX for bf16 (Linux /proc/cpuinfo; False where unreadable)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in cpuinfo)
    except OSError:
        return False


_HAS_AMX = cpu_has_amx()  # oneDNN's bf16 rows then need chunking (where weights are not panels)


@dataclass(frozen=True)
class PanelWeight:
    """A bf16 or fp32 weight `[out_features, in_features]` in the panels of the CPU kernel's
    `panel_linear` (`pack_panels`: out_features padded to a multiple of 48), or, `gated`, the
    gate and up projections stacked (`out_features` = 2 x intermediate) in `panel_silu_mul`'s
    pairs of panels (`pack_gated_panels`), for `gated_linear` only."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    gated: bool = False

    def numel(self) -> int:
        """Elements of the weight it packs (as a tensor's numel: what rooflines count)."""
        return self.out_features * self.in_features

    def element_size(self) -> int:
        return self.panels.element_size()


def _panel_kernels(weight: torch.Tensor):
    """The CPU kernels when `weight` can be a PanelWeight here (a CPU matrix in a dtype this
    build's `panel_linear` runs, bf16 with an even number of input features), else None."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
        return None
    kernels = cpu_kernels()
    dtype = str(weight.dtype).removeprefix("torch.")
    return kernels if kernels is not None and dtype in kernels.panel_linear_dtypes else None


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()) \
        or _panel_kernels(weight) is not None


def pack(weight: torch.Tensor) -> torch.Tensor | PanelWeight:
    """`weight` `[out, in]` in the layout `linear` runs fastest with here (itself if none)."""
    kernels = _panel_kernels(weight)
    if kernels is not None:
        return PanelWeight(kernels.pack_panels(weight), weight.shape[0], weight.shape[1])
    if not can_pack(weight):
        return weight
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except RuntimeError as exc:  # an op that exists but refuses this build/CPU: stay plain
        logger.warning("weight packing unavailable (%s); using plain linear layers", exc)
        return weight


def pack_gated(gate_up: torch.Tensor) -> torch.Tensor | PanelWeight:
    """SwiGLU's gate and up projections stacked (`[2 * intermediate, in]`) in the layout
    `gated_linear` runs fastest with here: a gated PanelWeight where `pack` makes panels,
    else what `pack` makes."""
    kernels = _panel_kernels(gate_up)
    if kernels is not None and gate_up.shape[0] % 2 == 0:
        return PanelWeight(kernels.pack_gated_panels(gate_up), gate_up.shape[0], gate_up.shape[1], gated=True)
    return pack(gate_up)


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor | PanelWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` of `linear(x, gate_up, bias)` (gate's outputs then up's): on a
    gated PanelWeight in one pass, with the bits of the product followed by `silu_mul`."""
    if isinstance(gate_up, PanelWeight) and gate_up.gated:
        flat = x.dim() == 2  # the model's rows: no reshape and view to pay for (a few us a call at batch 1)
        out = cpu_kernels().panel_silu_mul(x if flat else x.reshape(-1, gate_up.in_features), gate_up.panels,
                                           gate_up.out_features // 2, bias)
        return out if flat else out.view(*x.shape[:-1], gate_up.out_features // 2)
    return silu_mul(linear(x, gate_up, bias))


def linear(x: torch.Tensor, weight: torch.Tensor | PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` for a plain or packed weight.

    A PanelWeight runs the CPU kernel's `panel_linear`, whose rows never depend on each other.

    A packed product of one row is run as two (the row twice): oneDNN takes another path for
    a single row, whose results differ in the last bits from the same row among others
    (measured on an AMD EPYC with avx512_bf16 and no AMX, on SmolLM2's down projection in
    bf16 and fp32), so a request decoding alone would drift from the same request batched.
    Every row count from 2 up gives a row the same bits; with AMX, a bf16 product of more
    than AMX_INVARIANT_ROWS rows runs in blocks of that many (see the module docstring)."""
    if isinstance(weight, PanelWeight):
        assert not weight.gated, "a gated PanelWeight runs in gated_linear"
        flat = x.dim() == 2  # as in gated_linear
        out = cpu_kernels().panel_linear(x if flat else x.reshape(-1, weight.in_features), weight.panels,
                                         weight.out_features, bias)
        return out if flat else out.view(*x.shape[:-1], weight.out_features)
    if weight.layout == torch._mkldnn:
        if _HAS_AMX and x.dim() == 2 and x.shape[0] > AMX_INVARIANT_ROWS and x.dtype == torch.bfloat16:
            return torch.cat([packed_product(block, weight, bias) for block in x.split(AMX_INVARIANT_ROWS)])
        return packed_product(x, weight, bias)
    return F.linear(x, weight, bias)


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One oneDNN product with a packed weight; a single row is run as two (see linear)."""
    x = x.contiguous()
    if x.dim() == 2 and x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), weight, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
