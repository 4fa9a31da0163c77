"""SwiGLU's gate/up product on the CPU kernels, side by side in one run: the product on
plain panels followed by `silu_mul` (what the engine ran before), and `gated_linear` on the
gated panels (`panel_silu_mul`: fused for up to 64 rows, product then `silu_mul` beyond), on
SmolLM2-135M's shape (3072x576: 1536 gate and 1536 up features) over 30 layers' own random
weights, so that they stream from memory as a real model's do.

For each dtype and row count: the median over `--repeats` rounds (the two methods
interleaved) of one pass over the 30 layers, their ratio, and whether they gave the same
bits. JSON (+ PNG).

    .venv/bin/python benchmarks/gated_linear.py [--rows 1,16,64,65,256,512,2048]

Writes benchmarks/results/gated_linear.json.
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

GATE_UP = (3072, 576)  # SmolLM2-135M's gate and up projections stacked
LAYERS = 30


def methods(dtype: torch.dtype) -> dict:
    """Per method, its 30 packed weights and its product (x, weight) -> silu(gate) * up."""
    from pdserve.engine.model.fused import silu_mul
    from pdserve.engine.model.linear import PanelWeight, gated_linear, linear, pack, pack_gated

    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(*GATE_UP, generator=gen) * 0.05).to(dtype) for _ in range(LAYERS)]
    plain, gated = [pack(w) for w in weights], [pack_gated(w) for w in weights]
    if not all(isinstance(w, PanelWeight) and w.gated for w in gated):
        raise SystemExit(f"{dtype} weights are not PanelWeights here (no AVX-512 / avx512_bf16, AMX, or no kernels)")
    return {"product then silu_mul": (plain, lambda x, w: silu_mul(linear(x, w))), "gated": (gated, gated_linear)}


def one_pass(product, weights, x) -> float:
    start = time.perf_counter()
    for weight in weights:
        product(x, weight)
    return time.perf_counter() - start


def measure(dtype: torch.dtype, rows: int, repeats: int) -> dict:
    compared = methods(dtype)
    x = torch.randn(rows, GATE_UP[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
    outputs = [product(x, weights[0]) for weights, product in compared.values()]
    times: dict[str, list[float]] = {name: [] for name in compared}
    for _ in range(repeats):
        for name, (weights, product) in compared.items():
            one_pass(product, weights, x)  # warm: the first pass after the other method's
            times[name].append(one_pass(product, weights, x))
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"ms_per_30_layers": medians, "gated_over_unfused": medians["gated"] / medians["product then silu_mul"],
            "same_bits": all(torch.equal(outputs[0], out) for out in outputs[1:]),
            "runs_ms": {name: [1000 * s for s in t] for name, t in times.items()}}


def plot(result: dict, path: Path) -> None:
    with panels(path, len(result["dtypes"])) as axes:
        for ax, (dtype, by_rows) in zip(axes, result["dtypes"].items(), strict=True):
            rows = [int(r) for r in by_rows]
            ax.plot(rows, [by_rows[str(r)]["gated_over_unfused"] for r in rows], marker="o")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set(title=f"{dtype}: gated / product then silu_mul", xlabel="rows", ylabel="time ratio")


def main() -> None:
    parser = argparse.ArgumentParser(description="gated gate/up product vs product then silu_mul (CPU kernels)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,16,64,65,256,512,2048")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gated_linear.json")
    args = parser.parse_args()
    result = {"setup": {"cores": os.cpu_count(), "threads": torch.get_num_threads(), "layers": LAYERS,
                        "shape": GATE_UP, "repeats": args.repeats, "load_average": os.getloadavg()},
              "dtypes": {}}
    for name in args.dtypes.split(","):
        result["dtypes"][name] = {rows: measure(getattr(torch, name), int(rows), args.repeats)
                                  for rows in args.rows.split(",")}
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
