"""How far a profile's step model is off at step shapes `pdserve profile` does not time.

The profiler times prompts that are new to the engine (one chunk from position 0) and
mixed steps of 128-1536 fresh prompt tokens. Serving also runs short chunks beside a
decode batch (a decode worker prefilling a short prompt locally) and chunks over a cached
prefix (a chat turn whose history the prefix cache holds, or a long prompt's later
chunks), whose attention reads KV already in the paged cache; the step model counts that
attention in the same `Q` (sum of n * (start + n)) as attention within a fresh prompt --
and, in profiles from before 2026-12-04, in `Q` alone: this benchmark found chunks over a
cached prefix at 1.43-1.71x such a model, and the profiler now times them too and fits
their own K term (engine.profile).

This times those shapes on the engine alone, pinned to one core with one thread (as
planner_validation profiles a 1-core worker), with the profiler's own step helpers, and
compares each with the profile's model (`Profile.step_s`): prefill-only and mixed steps,
fresh and over a cached prefix. planner_validation's step logs showed chat's mixed steps
on the decode worker 1.10-1.29x the serving-calibrated model; this says whether the
engine alone already runs them slower than the profile says. Writes
benchmarks/results/profile_coverage.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import panels, write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
def plot(result: dict, path: Path) -> None:
    rows = result["steps"]
    with panels(path, 1, width=max(6.0, 0.45 * len(rows))) as (ax,):
        xs = range(len(rows))
        colors = ["tab:orange" if r["cached"] else "tab:blue" for r in rows]
        ax.bar(list(xs), [r["measured_over_model"] for r in rows], color=colors)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(list(xs), [f"{r['tokens']}+{r['cached']}c B{r['batch']}" for r in rows],
                     rotation=70, fontsize=7)
        ax.set_ylabel("measured / profile's model")
        ax.set_title("steps the profiler does not time (orange: over a cached prefix)", fontsize=9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--profile", type=Path, default=RESULTS / "profile_1core.json",
                        help="the profile to check (taken on this host, 1 core: planner_validation writes it)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_coverage.json")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    torch.set_num_threads(1)
    from pdserve.cluster.planner.profiler import time_cached_step
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.model_source import resolve_model
    from pdserve.engine.profile import Profile

    profile = Profile.load(args.profile)
    engine = LLMEngine(EngineConfig(model=str(resolve_model(args.model))))
    grid = ([(tokens, batch, 0) for batch in (2, 5, 16) for tokens in (32, 64, 128)]
            + [(tokens, batch, cached) for batch in (2, 5) for tokens in (64, 128) for cached in (1024, 1600)]
            + [(tokens, 0, cached) for tokens in (128, 512) for cached in (0, 1024)])
    steps = []
    for tokens, batch, cached in grid:
        shape, seconds = time_cached_step(engine, tokens, batch, cached, args.repeats)
        t, q, b, c, k = (shape.prefill_tokens, shape.prefill_squared, shape.decode_batch, shape.decode_context,
                         shape.prefill_cached)
        model = profile.step_s(t, q, b, c, k)
        steps.append({"tokens": tokens, "batch": batch, "cached": cached, "T": t, "Q": q, "K": k, "B": b, "C": c,
                      "measured_s": seconds, "model_s": model, "measured_over_model": seconds / model})
        print(f"{tokens} new tokens over {cached} cached, {batch} decodes: {seconds * 1000:.1f} ms, "
              f"model {model * 1000:.1f} ms ({seconds / model:.2f}x)", flush=True)

    def ratios(select) -> list[float]:
        return [s["measured_over_model"] for s in steps if select(s)]

    summary = {name: {"min": min(r), "median": statistics.median(r), "max": max(r)}
               for name, r in (("fresh_mixed", ratios(lambda s: s["batch"] and not s["cached"])),
                               ("cached_mixed", ratios(lambda s: s["batch"] and s["cached"])),
                               ("fresh_prefill", ratios(lambda s: not s["batch"] and not s["cached"])),
                               ("cached_prefill", ratios(lambda s: not s["batch"] and s["cached"])))}
    write({"profile": str(args.profile.relative_to(ROOT)) if args.profile.is_relative_to(ROOT) else str(args.profile),
           "threads": torch.get_num_threads(), "repeats": args.repeats, "summary": summary, "steps": steps},
          args.out, plot)


if __name__ == "__main__":
    main()
