"""The engine alone at the step shapes serving runs, against the profile's model.

`decode` (one core, one thread, against profile_1core.json): decode steps of 1-64 rows at
per-row contexts of 64-2,048 tokens (the profiler's DECODE_SHAPES), serving's shapes: its
rows carry 400-500 tokens (online) and 1,000-1,400 (chat). Beside the profile's model, the
decode model refitted on this grid (relative error) linearly and with a B^2 term: how far
the model's shape, not its coefficients, is off (measured 2026-12-04, two runs, against a
profile that then timed contexts of 64-512 only and fitted linearly by absolute error: its
model 0.87-1.22x off here; refitted, 6.4-6.9% rms linear and 2.4-2.5% with B^2, the shape
`pdserve profile` has fitted since).

`mixed` (both cores, two threads, against profile_2cores.json): a colocated engine's steps
of 64-2,040 fresh prompt tokens beside 4-8 decodes, the sizes whose serving times
planner_validation's step logs showed at 2.1-2.2x (65 ms) down to 1.3-1.4x (2.9 s) the
model: this says whether the engine alone already departs from the model there (measured
in two runs: 0.94-1.03x, so it does not).

Writes benchmarks/results/engine_shapes_<kind>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MIXED_GRID = [(8, 2040), (8, 1536), (8, 1024), (8, 512), (4, 128), (8, 64)]  # (decodes, fresh prompt tokens)


def refit_errors(rows: list[dict]) -> dict[str, float]:
    """RMS relative error of the decode model refitted on `rows` (B, C, measured_s): linear
    (d0 + d1 B + d2 C) and with a B^2 term (the profile's fit, engine.profile.fit_decode),
    each fitted to minimise relative error."""
    import numpy as np

    from pdserve.engine.profile import fit_decode, fit_nonnegative

    batch, context, seconds = (np.array([r[key] for r in rows], dtype=float) for key in ("B", "C", "measured_s"))
    linear = np.column_stack([np.ones_like(batch), batch, context]) / seconds[:, None]
    squared = np.column_stack([np.ones_like(batch), batch, context, batch * batch]) / seconds[:, None]
    fits = {"linear": (linear, fit_nonnegative(linear, np.ones(len(rows)))),
            "with_B_squared": (squared, fit_decode(list(zip(batch, context, seconds, strict=True))))}
    return {name: float(np.sqrt(np.mean((x @ np.asarray(coeffs) - 1) ** 2))) for name, (x, coeffs) in fits.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=("decode", "mixed"))
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--profile", type=Path,
                        help="default: profile_1core.json (decode), profile_2cores.json (mixed)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = 1 if args.kind == "decode" else 2
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:cores]))
    import torch

    torch.set_num_threads(cores)
    from pdserve.cluster.planner.profiler import DECODE_SHAPES, _mixed_step, time_decode_step
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_source import resolve_model
    from pdserve.engine.profile import Profile

    profile_path = args.profile or RESULTS / ("profile_1core.json" if cores == 1 else "profile_2cores.json")
    profile = Profile.load(profile_path)
    engine = LLMEngine(EngineConfig(model=str(resolve_model(args.model))))
    rows = []
    for a, b in DECODE_SHAPES if args.kind == "decode" else MIXED_GRID:
        if args.kind == "decode":
            seconds = time_decode_step(engine, a, b, args.repeats)
            t = q = 0
            batch, context = a, a * b
        else:
            shape, seconds = _mixed_step(engine, a, 170, b, args.repeats)
            t, q, batch, context = shape.prefill_tokens, shape.prefill_squared, shape.decode_batch, shape.decode_context
        model = profile.step_s(t, q, batch, context)
        rows.append({"T": t, "Q": q, "B": batch, "C": context, "measured_s": seconds, "model_s": model,
                     "measured_over_model": seconds / model})
        print(f"T {t} B {batch} C {context}: {seconds * 1000:.1f} ms, model {model * 1000:.1f} ms "
              f"({seconds / model:.3f}x)", flush=True)
    result = {"kind": args.kind, "threads": torch.get_num_threads(), "repeats": args.repeats,
              "profile": str(profile_path), "steps": rows,
              "measured_over_model": {"min": min(r["measured_over_model"] for r in rows),
                                      "max": max(r["measured_over_model"] for r in rows)}}
    if args.kind == "decode":
        result["refit_rms_relative_error"] = refit_errors(rows)
    write(result, RESULTS / f"engine_shapes_{args.kind}.json")


if __name__ == "__main__":
    main()
