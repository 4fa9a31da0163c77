"""The second KV tier, off against on, side by side in one run (issue 50).

Replays ../shared/workloads/multi-turn-chat.jsonl through the real service (Ray, the real
model, the router, HTTP; each turn resends the history with the replies really generated,
after the user's think time) with the prefill worker's KV pool, and the decode workers'
pools together, sized to about a quarter of the replay's working set (its distinct prompt
tokens, estimated from the workload: shared system prompts once, each session's turns and
replies), so the pools evict most of what later turns need (`--per-worker-pools`: each
decode pool a quarter, as the first runs had it: two decode pools then hold half).
Configurations, each on a fresh service, the tier's directory fresh too:

- `1p1d-off` / `1p1d-on`: 1 prefill + 1 decode worker, the tier off / on (both workers share
  one store directory: one node);
- `1p2d-off` / `1p2d-on`: 1 prefill + 2 decode workers;
- `restart-off` / `restart-on`: 1 prefill + 2 decode workers, one decode worker SIGKILLed
  halfway through the replay (the controller replaces it; with the tier on, the
  replacement finds the node's store).

Per configuration: TTFT and TPOT p50/p90, prompt tokens computed (prompt minus
`usage.prompt_tokens_details.cached_tokens`), hits by tier (the workers' pool and tier hit
tokens), the tier's load/recompute decisions, its measured read bandwidth against the
workers' prefill speed (both in KV bytes/s). Targets: TTFT p50 >= 2x better and prompt
tokens computed -50% with the tier on. JSON + PNG.

    .venv/bin/python benchmarks/kv_tier.py [--sessions 32] [--time-scale 0.5] [--configs 1p1d-off,1p1d-on]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.prefix_reuse import local_ray, replay, scrape, service, summarize, workload_rows  # noqa: E402
from benchmarks.report import panels, write  # noqa: E402
from pdserve.testkit.workers import free_port  # noqa: E402

MAX_MODEL_LEN = 2560  # the longest chat of the workload (2,249 tokens) fits; a pool must hold one request
CONFIGS = {  # name: (decode workers, tier on, kill a decode worker halfway)
    "1p1d-off": (1, False, False), "1p1d-on": (1, True, False),
    "1p2d-off": (2, False, False), "1p2d-on": (2, True, False),
    "restart-off": (2, False, True), "restart-on": (2, True, True),
}


def kv_bytes_per_token() -> int:
    """KV bytes of one token of the default model in the dtype its workers pick here."""
    from transformers import AutoConfig

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.loader import resolve_device_dtype
    from pdserve.engine.model.llama import ModelShape
    from pdserve.engine.model_source import resolve_model

    config = EngineConfig()
    _, dtype = resolve_device_dtype(config)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(str(resolve_model(config.model))))
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def recompute_speed(rows: list[dict], bytes_per_token: int, repeats: int = 3) -> dict:
    """What loading competes with: this machine's prefill of the workload's first prompt
    (system prompt and first turn, ~1.1k tokens) on the offline engine with the workers'
    chunk budget and one core's threads (a worker's), the median of `repeats`, as tokens/s
    and as KV bytes/s (the tokens' KV bytes per second of computing them)."""
    import statistics

    import torch

    from pdserve.engine.llm import LLM
    from pdserve.engine.sampling_params import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(max_num_batched_tokens=512, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
        prompt = rows[0]["system_prompt_ids"] + rows[0]["turns"][0]["user_ids"]
        llm.generate([prompt], SamplingParams(max_tokens=1))  # warm-up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=1))
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    tokens_per_s = len(prompt) / statistics.median(seconds)
    return {"prompt_tokens": len(prompt), "tokens_per_s": tokens_per_s,
            "kv_bytes_per_s": tokens_per_s * bytes_per_token}


def working_set_tokens(rows: list[dict]) -> int:
    """Distinct prompt tokens the replay's KV covers: each system prompt once, and each
    session's user turns and replies (at most max_tokens each)."""
    systems = {row["system_id"]: len(row["system_prompt_ids"]) for row in rows}
    turns = sum(len(t["user_ids"]) + t["max_tokens"] for row in rows for t in row["turns"])
    return sum(systems.values()) + turns


def worker_stats(controller) -> list[dict]:
    import ray

    pools = ray.get(controller.status.remote(), timeout=60)["pools"]
    return [{"role": role, **(w["stats"] or {})} for role, pool in pools.items() for w in pool["workers"]]


def tier_summary(stats: list[dict], bytes_per_token: int) -> dict:
    """Hits by tier, decisions, and the tier's read bandwidth against the workers' prefill
    speed in KV bytes/s (prompt tokens a worker computed per second of its prefill steps)."""
    decisions: dict[str, int] = {}
    for s in stats:
        for reason, n in (s.get("kv_tier_decisions") or {}).items():
            decisions[reason] = decisions.get(reason, 0) + int(n)
    bandwidth = [s["kv_tier_read_bandwidth"] for s in stats if s.get("kv_tier_read_bandwidth")]
    return {"pool_hit_tokens": sum(int(s.get("prefix_cache_hit_tokens", 0)) for s in stats),
            "tier_hit_tokens": sum(int(s.get("kv_tier_hit_tokens", 0)) for s in stats),
            "decisions": decisions, "blocks_written": sum(int(s.get("kv_tier_blocks_written", 0)) for s in stats),
            "store_bytes": max((int(s.get("kv_tier_bytes", 0)) for s in stats), default=0),
            "read_bandwidth_bytes_per_s": max(bandwidth) if bandwidth else None,
            "bytes_per_token": bytes_per_token}


def kill_later(controller, after_s: float, out: dict) -> threading.Timer:
    """SIGKILL one decode worker `after_s` from now; `out` gets its id and when."""
    import ray

    def kill() -> None:
        workers = ray.get(controller.status.remote(), timeout=60)["pools"]["decode"]["workers"]
        victim = next(w for w in workers if w["state"] == "ready")
        os.kill(victim["pid"], signal.SIGKILL)
        out.update({"worker_id": victim["worker_id"], "at": time.perf_counter()})

    timer = threading.Timer(after_s, kill)
    timer.start()
    return timer


def run_config(name: str, rows: list[dict], pool_bytes: int, budget_bytes: int, time_scale: float,
               bytes_per_token: int, per_worker_pools: bool = False) -> dict:
    """One configuration on a fresh service and store: the prefill worker's pool `pool_bytes`,
    the decode workers' pools `pool_bytes` together (each, with `per_worker_pools`)."""
    from pdserve.cluster.controller import controller_handle

    decode, tier, restart = CONFIGS[name]
    decode_pool = pool_bytes if per_worker_pools else max(pool_bytes // decode, (MAX_MODEL_LEN + 64) * bytes_per_token)
    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-") as directory:
        engine = {"kv_cache_bytes": pool_bytes, "max_num_batched_tokens": 512, "max_model_len": MAX_MODEL_LEN,
                  "kv_tier": {"enabled": tier, "directory": directory, "budget_bytes": budget_bytes}}
        settings = {"router.port": free_port(), "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5,
                    "decode.replicas": decode, "prefill.engine": engine,
                    "decode.engine": {**engine, "kv_cache_bytes": decode_pool},
                    "router.max_inflight_requests": 1024}
        with service(settings) as url:
            controller = controller_handle()
            killed: dict = {}
            span = max(row["start_s"] for row in rows) * time_scale
            timer = kill_later(controller, span / 2 + 5.0, killed) if restart else None
            before = scrape(url)
            started = time.perf_counter()  # the replay's own start is a moment later
            results, wall = asyncio.run(replay(url, "multi-turn-chat", rows, time_scale))
            if timer is not None:
                timer.join()
            time.sleep(1.0)  # the workers' last reports reach the router
            out = summarize(results, wall, before, scrape(url))
            out["tier"] = tier_summary(worker_stats(controller), bytes_per_token)
            out["decode_pool_bytes"] = decode_pool
            out["per_request"] = [{k: r.get(k) for k in ("sent_s", "ttft_s", "prompt_tokens", "cached_tokens")}
                                  for r in results]
    if restart and killed:
        killed_s = killed["at"] - started
        after = [r for r in results if r.get("sent_s", -1.0) >= killed_s]
        out["killed"] = {"worker_id": killed["worker_id"], "at_s": killed_s}
        out["after_kill"] = summarize(after, wall - killed_s, {}, {}) if after else None
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    configs = list(result["configs"])
    with panels(path, 3, width=4.6) as axes:
        for ax, (label, value) in zip(axes, [
                ("TTFT p50 (s)", lambda c: c["ttft_s"]["p50"]),
                ("prompt tokens computed", lambda c: c["prompt_tokens_computed"]),
                ("tier hit tokens", lambda c: c["tier"]["tier_hit_tokens"])], strict=True):
            ax.bar(configs, [value(result["configs"][c]) or 0 for c in configs],
                   color=["tab:gray" if c.endswith("off") else "tab:green" for c in configs])
            ax.set_title(label)
            ax.tick_params(axis="x", rotation=45)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32,
                        help="multi-turn-chat sessions to replay (at 32, a quarter of the working set over two "
                             "decode pools still holds the longest chat in each)")
    parser.add_argument("--time-scale", type=float, default=0.5, help="arrival and think times x this")
    parser.add_argument("--pool-fraction", type=float, default=0.25,
                        help="the prefill worker's KV pool, and the decode workers' together, x the working set")
    parser.add_argument("--per-worker-pools", action="store_true",
                        help="every decode worker's pool the fraction (two decode pools then hold twice as much)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of every configuration, interleaved (the medians of a bimodal TTFT move "
                             "from run to run on a shared 2-core machine)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kv_tier.json")
    args = parser.parse_args()
    rows = workload_rows("multi-turn-chat", args.sessions)
    bytes_per_token = kv_bytes_per_token()
    working = working_set_tokens(rows)
    pool_bytes = max(int(working * args.pool_fraction), MAX_MODEL_LEN + 64) * bytes_per_token
    result = {"setup": {"cores": os.cpu_count(), "load_average_at_start": os.getloadavg(), "sessions": len(rows),
                        "time_scale": args.time_scale, "working_set_tokens": working,
                        "bytes_per_token": bytes_per_token, "pool_bytes": pool_bytes,
                        "pool_fraction": args.pool_fraction, "per_worker_pools": args.per_worker_pools,
                        "tier_budget_bytes": 4 * working * bytes_per_token},
              "configs": {}}
    result["recompute"] = recompute_speed(rows, bytes_per_token)
    rounds: dict[str, list[dict]] = {}
    with local_ray(2):
        for _ in range(args.repeats):
            for name in args.configs.split(","):
                rounds.setdefault(name, []).append(run_config(
                    name, rows, pool_bytes, 4 * working * bytes_per_token, args.time_scale, bytes_per_token,
                    args.per_worker_pools))
    for name, runs in rounds.items():  # the first round in full, every round's headline figures
        result["configs"][name] = {**runs[0], "rounds": [
            {"ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "prompt_tokens_computed": r["prompt_tokens_computed"],
             "wall_s": r["wall_s"], "failed": r["failed"]} for r in runs],
            "ttft_p50_median_of_rounds": statistics.median(r["ttft_s"]["p50"] for r in runs),
            "ttft_p90_median_of_rounds": statistics.median(r["ttft_s"]["p90"] for r in runs),
            "prompt_tokens_computed_median_of_rounds": statistics.median(r["prompt_tokens_computed"] for r in runs)}
    for pair in ("1p1d", "1p2d", "restart"):
        off, on = result["configs"].get(f"{pair}-off"), result["configs"].get(f"{pair}-on")
        if off and on and on["ttft_p50_median_of_rounds"]:
            result.setdefault("ratios", {})[pair] = {
                "ttft_p50_off_over_on": off["ttft_p50_median_of_rounds"] / on["ttft_p50_median_of_rounds"],
                "ttft_p50_off_over_on_by_round": [a["ttft_s"]["p50"] / b["ttft_s"]["p50"]
                                                  for a, b in zip(off["rounds"], on["rounds"], strict=True)],
                "ttft_p90_off_over_on": off["ttft_p90_median_of_rounds"] / on["ttft_p90_median_of_rounds"],
                "prompt_tokens_computed_change": on["prompt_tokens_computed_median_of_rounds"]
                / off["prompt_tokens_computed_median_of_rounds"] - 1}
    bandwidth = [c["tier"]["read_bandwidth_bytes_per_s"] for c in result["configs"].values()
                 if c["tier"]["read_bandwidth_bytes_per_s"]]
    if bandwidth:
        result["read_over_recompute"] = min(bandwidth) / result["recompute"]["kv_bytes_per_s"]
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
