"""What batch invariance costs a bf16 linear layer on a CPU with AMX: one oneDNN product
of M rows against the same rows in products of at most 32 (what engine.model.linear runs
there, see its docstring), on SmolLM2-135M's projection shapes, one thread. Writes
benchmarks/results/linear_rows.json: milliseconds per product, median of repeats, and the
ratio.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import write  # noqa: E402

SHAPES = ((576, 576), (1536, 576), (576, 1536))  # SmolLM2-135M: attention out, MLP up/gate, MLP down
ROWS = (64, 256, 512, 2048)


def median_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    import torch

    from pdserve.engine.model.linear import AMX_INVARIANT_ROWS, cpu_has_amx, pack, packed_product

    torch.set_num_threads(1)
    rows = []
    for out_features, in_features in SHAPES:
        weight = pack(torch.randn(out_features, in_features).to(torch.bfloat16))
        for count in ROWS:
            x = torch.randn(count, in_features).to(torch.bfloat16)
            one = median_ms(lambda: packed_product(x, weight, None))  # noqa: B023
            blocks = median_ms(lambda: torch.cat([packed_product(b, weight, None)  # noqa: B023
                                                  for b in x.split(AMX_INVARIANT_ROWS)]))  # noqa: B023
            rows.append({"weight": [out_features, in_features], "rows": count, "one_product_ms": one,
                         f"blocks_of_{AMX_INVARIANT_ROWS}_ms": blocks, "ratio": blocks / one})
            print(f"{out_features}x{in_features}, {count} rows: one product {one:.3f} ms, "
                  f"blocks {blocks:.3f} ms ({blocks / one:.2f}x)", flush=True)
    ratios = [r["ratio"] for r in rows]
    write({"cpu_has_amx": cpu_has_amx(), "threads": 1, "rows": rows,
           "ratio": {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}},
          ROOT / "benchmarks" / "results" / "linear_rows.json")


if __name__ == "__main__":
    main()
