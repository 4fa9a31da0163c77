"""Linear layers on the CPU (bf16, or fp32 with `--dtype float32`), side by side in one run:
oneDNN's product on its packed weight (`torch.ops.mkldnn`, what engine.model.linear ran
before) and the engine's kernel on a PanelWeight (csrc/panel_linear.cpp), over one forward's
products of SmolLM2-135M's shapes
(30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, then the LM head
49152x576), every layer its own random weights, so that they stream from memory as a real
model's do (~270 MB in bf16; one layer's would sit in the L3 cache).

For each row count: the median of `--repeats` forwards per method, interleaved, the weight
bandwidth that time implies, the FLOP rate, and whether the two gave the same bits.
JSON (+ PNG).

    .venv/bin/python benchmarks/linear_bf16.py [--rows 1,2,4,8,16,32,64,128,512,2048] [--dtype float32]
        [--layers 30] [--no-lm-head]

Writes benchmarks/results/linear_bf16.json (fp32: linear_float32.json).
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

from benchmarks.report import panels, write  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one decoder layer
HEAD_SHAPE = (49152, 576)


def model_weights(layers: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                  lm_head: bool = True) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = LAYER_SHAPES * layers + ([HEAD_SHAPE] if lm_head else [])
    return [(torch.randn(*shape, generator=gen) * 0.05).to(dtype) for shape in shapes]


def methods(weights: list[torch.Tensor]) -> dict:
    """Per method, the weights packed for it and its product."""
    from pdserve.engine.model.linear import PanelWeight, linear, pack

    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    panel = [pack(w) for w in weights]
    if not all(isinstance(p, PanelWeight) for p in panel):
        raise SystemExit(f"{weights[0].dtype} weights are not PanelWeights here (no AVX-512 / avx512_bf16, AMX, "
                         "or no kernels)")

    def mkldnn(x, w):
        rows = x if x.shape[0] > 1 else x.expand(2, -1).contiguous()  # its 1-row path rounds otherwise
        return torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [], "")[: x.shape[0]]

    return {"onednn": (onednn, mkldnn), "kernel": (panel, linear)}


def forward(weights: list[tuple], product, inputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Every product of one forward: `weights` (packed weight, input features)."""
    return [product(inputs[in_features], w) for w, in_features in weights]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,512,2048")
    parser.add_argument("--layers", type=int, default=30,
                        help="decoder layers, each its own weights (1: one layer's weights, which stay in the "
                             "cache from forward to forward, against 30 streamed from memory)")
    parser.add_argument("--no-lm-head", action="store_true",
                        help="leave the LM head out (a prefill runs it on its last row only)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--out", type=Path, default=None,
                        help="default benchmarks/results/linear_bf16.json (fp32: linear_float32.json)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    out = args.out or ROOT / "benchmarks" / "results" / ("linear_bf16.json" if args.dtype == "bfloat16"
                                                           else "linear_float32.json")
    weights = model_weights(args.layers, dtype=dtype, lm_head=not args.no_lm_head)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    compared = {name: ([(p, w.shape[1]) for p, w in zip(packed, weights, strict=True)], product)
                for name, (packed, product) in methods(weights).items()}
    result = {"setup": {"dtype": args.dtype, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                        "load_average": os.getloadavg(),
                        "layers": args.layers, "lm_head": not args.no_lm_head, "weight_bytes": weight_bytes,
                        "repeats": args.repeats}, "runs": {}}
    for rows in (int(n) for n in args.rows.split(",")):
        gen = torch.Generator().manual_seed(rows)
        inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (576, 1536)}
        outputs = {name: forward(w, product, inputs) for name, (w, product) in compared.items()}  # also warms up
        same = all(torch.equal(a, b) for a, b in zip(outputs["onednn"], outputs["kernel"], strict=True)) if rows > 1 \
            else None  # oneDNN's 1-row figure is its 2-row product's
        times: dict[str, list[float]] = {name: [] for name in compared}
        for _ in range(args.repeats):
            for name, (w, product) in compared.items():  # interleaved
                start = time.perf_counter()
                forward(w, product, inputs)
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(values) for name, values in times.items()}
        result["runs"][str(rows)] = {
            "seconds": medians, "speedup": medians["onednn"] / medians["kernel"], "same_bits": same,
            "weight_gb_s": {n: weight_bytes / s / 1e9 for n, s in medians.items()},
            "gflop_s": {n: rows * flops_per_row / s / 1e9 for n, s in medians.items()}}
        print(rows, {n: round(s * 1e3, 2) for n, s in medians.items()}, "ms",
              f"speedup {medians['onednn'] / medians['kernel']:.2f}", "same bits" if same else "", flush=True)
    write(result, out, plot)


def plot(result: dict, path: Path) -> None:
    runs = result["runs"]
    rows = [int(r) for r in runs]
    with panels(path, 2, width=6) as (ax1, ax2):
        for name in ("onednn", "kernel"):
            ax1.plot(rows, [runs[str(r)]["seconds"][name] * 1e3 for r in rows], marker="o", label=name)
            ax2.plot(rows, [runs[str(r)]["weight_gb_s"][name] for r in rows], marker="o", label=name)
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("rows")
            ax.legend()
        ax1.set_yscale("log")
        ax1.set_ylabel("ms per forward's products")
        ax1.set_title(f"SmolLM2-135M's {result['setup'].get('dtype', 'bfloat16')} products")
        ax2.set_ylabel("weight GB/s")


if __name__ == "__main__":
    main()
