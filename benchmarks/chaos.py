"""Chaos: online-poisson through `pdserve up` (2 prefill + 2 decode workers) while a random
worker is SIGKILLed, or SIGSTOPped (hung) and SIGKILLed 10 s later, every 20-40 s. The
controller replaces dead and hung workers; the router resumes broken streams elsewhere.

Every request asks for its token ids, greedy (even rows) or sampled with a seed (odd rows).
The reference for each is the engine run offline on the same model and dtype: sampling is a
function of (seed, position, logits) and the engine is batch-invariant
(tests/integration/test_batch_invariance.py), so that is what an undisturbed service gives.
Reports requests completed / failed, requests whose tokens differ from the reference
(missing, extra or different tokens), migrations, whether every worker's KV blocks are all
free at the end, TTFT/TPOT p99 under chaos. Target: 0 failed, 0 differences, 0 leaked blocks.

    .venv/bin/python benchmarks/chaos.py [--duration 600] [--time-scale 2] [--out benchmarks/results/chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.prefix_reuse import WORKLOADS, local_ray, workload_rows  # noqa: E402
from benchmarks.report import panels, repo_relative, sse_events, write  # noqa: E402
from pdserve.engine.stats import percentile  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SETTINGS = {"prefill.replicas": 2, "decode.replicas": 2, "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5,
            "env": {"OMP_NUM_THREADS": "1"}}


def sampling(index: int) -> dict:
    """Greedy for even rows, seeded sampling for odd ones."""
    return {"temperature": 0.0} if index % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + index}


def references(rows: list[dict]) -> list[list[int]]:
    """Each row's tokens from the engine offline (same model, default dtype)."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(MODEL)
    params = [SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, **sampling(i)) for i, r in enumerate(rows)]
    return [out.outputs[0].token_ids for out in llm.generate([r["prompt_token_ids"] for r in rows], params)]


async def request(session, url: str, index: int, row: dict) -> dict:
    body = {"model": MODEL, "prompt": row["prompt_token_ids"], "max_tokens": row["max_tokens"], "ignore_eos": True,
            "stream": True, "return_token_ids": True, **sampling(index)}
    sent, first, ids, finishes, errors = time.perf_counter(), None, [], [], []
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return {"row": index, "error": f"HTTP {response.status}: {(await response.text())[:200]}"}
            async for event in sse_events(response):
                if "error" in event:
                    errors.append(event["error"]["message"])
                    continue
                choice = event["choices"][0]
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    ids.extend(choice["token_ids"])
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
    except Exception as exc:  # noqa: BLE001 - a cut stream is a failure to report
        errors.append(f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    result = {"row": index, "ids": ids, "sent_s": sent, "ttft_s": first - sent if first else None,
              "tpot_s": (end - first) / (len(ids) - 1) if first and len(ids) > 1 else None}
    if errors or finishes != ["length"]:
        result["error"] = errors[0] if errors else f"finish reasons {finishes}"
    return result


async def drive(url: str, rows: list[dict], duration_s: float, time_scale: float) -> list[dict]:
    """Replay the rows' arrivals (stretched by `time_scale`), looping, for `duration_s`."""
    import aiohttp

    period = rows[-1]["arrival_s"] * time_scale + 1.0
    start, tasks = time.perf_counter(), []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        loop_index = 0
        while True:
            for index, row in enumerate(rows):
                at = loop_index * period + row["arrival_s"] * time_scale
                if at > duration_s:
                    return list(await asyncio.gather(*tasks))
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(request(session, url, index, row)))
            loop_index += 1


class Chaos(threading.Thread):
    """Every 20-40 s: SIGKILL a random ready worker, or SIGSTOP it and SIGKILL it 10 s later.
    Only in a pool with at least two ready workers (the other keeps serving)."""

    def __init__(self, controller, seed: int) -> None:
        super().__init__(daemon=True)
        self.controller, self.rng, self.stop_event, self.events = controller, random.Random(seed), threading.Event(), []

    def run(self) -> None:
        import ray

        started = time.perf_counter()
        while not self.stop_event.wait(self.rng.uniform(20, 40)):
            pools = ray.get(self.controller.status.remote())["pools"]
            ready = [(role, w) for role, pool in pools.items() for w in pool["workers"] if w["state"] == "ready"]
            candidates = [(role, w) for role, w in ready if sum(r == role for r, _ in ready) >= 2 and w["pid"]]
            if not candidates:
                continue
            role, worker = self.rng.choice(candidates)
            how = self.rng.choice(["SIGKILL", "SIGSTOP"])
            self.events.append({"at_s": round(time.perf_counter() - started, 1), "role": role,
                                "worker": worker["worker_id"], "signal": how})
            print(f"chaos: {how} {role} worker {worker['worker_id']} (pid {worker['pid']})", flush=True)
            try:
                os.kill(worker["pid"], getattr(signal, how))
                if how == "SIGSTOP":
                    threading.Timer(10.0, _kill_quietly, (worker["pid"],)).start()
            except ProcessLookupError:
                pass


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def migrations(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {name.split('"')[1]: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines())
            if name.startswith("pdserve_migrations_total{")}


def leaked_blocks(controller, timeout_s: float = 60.0) -> dict[str, int]:
    """Per worker, KV blocks not free once the service is idle (waits for it to settle)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        pools = ray.get(controller.status.remote())["pools"]
        leaked = {w["worker_id"]: w["stats"]["num_total_blocks"] - w["stats"]["num_free_blocks"]
                  for pool in pools.values() for w in pool["workers"] if w.get("stats")}
        if not any(leaked.values()) or time.monotonic() > deadline:
            return leaked
        time.sleep(1.0)


def compare(results: list[dict], refs: list[list[int]]) -> dict:
    failed = [r for r in results if "error" in r]
    differing = [r for r in results if "error" not in r and r["ids"] != refs[r["row"]]]
    missing = sum(max(0, len(refs[r["row"]]) - len(r["ids"])) for r in differing)
    extra = sum(max(0, len(r["ids"]) - len(refs[r["row"]])) for r in differing)
    changed = sum(sum(a != b for a, b in zip(r["ids"], refs[r["row"]], strict=False)) for r in differing)
    ok = [r for r in results if "error" not in r]
    return {"requests": len(results), "completed": len(ok), "failed": len(failed),
            "first_errors": [r["error"] for r in failed[:5]],
            "differing_requests": len(differing), "tokens_missing": missing, "tokens_extra": extra,
            "tokens_changed": changed,
            "ttft_s": {q: percentile([r["ttft_s"] for r in ok], q) for q in (50, 99)},
            "tpot_s": {q: percentile([r["tpot_s"] for r in ok if r["tpot_s"] is not None], q) for q in (50, 99)}}


def plot(result: dict, path: Path) -> None:
    timeline = result["timeline"]
    with panels(path, 1, width=9) as (ax,):
        ok = [(t, ttft) for t, ttft, failed in timeline if not failed and ttft is not None]
        ax.scatter([t for t, _ in ok], [v for _, v in ok], s=6, label="TTFT of a completed request")
        ax.scatter([t for t, _, failed in timeline if failed], [0] * sum(f for *_, f in timeline), marker="x",
                   color="red", label="failed request")
        for event in result["chaos"]:
            ax.axvline(event["at_s"], color="grey" if event["signal"] == "SIGKILL" else "orange", lw=0.8)
        ax.set_xlabel("seconds into the run (grey: SIGKILL, orange: SIGSTOP)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"chaos: {result['summary']['failed']} failed, {result['summary']['differing_requests']} "
                     f"differing, migrations {sum(result['migrations'].values()):.0f}")
        ax.legend()


def load_under_chaos(description: str, port: int, out: Path):
    """The chaos benchmarks' command line and load: (args, workload rows, offline references
    of the rows the run will send)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load under chaos (default 600)")
    parser.add_argument("--time-scale", type=float, default=2.0,
                        help="stretch the workload's arrivals by this factor (default 2: ~0.5 req/s)")
    parser.add_argument("--seed", type=int, default=0, help="the chaos schedule's seed")
    parser.add_argument("--port", type=int, default=port)
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    rows = workload_rows("online-poisson", 10_000)
    used = [r for r in rows if r["arrival_s"] * args.time_scale <= args.duration]
    print(f"reference outputs for {len(used)} requests, offline ...", flush=True)
    return args, rows, references(used)


def main() -> None:
    args, rows, refs = load_under_chaos(__doc__.split("\n")[0], 8131, ROOT / "benchmarks/results/chaos.json")

    import ray

    from pdserve.cluster.config import load_config
    from pdserve.cluster.controller import create_controller

    with local_ray(num_cpus=2):
        controller = create_controller(load_config(None, {"router.port": args.port, **SETTINGS}))
        try:
            url = ray.get(controller.start.remote())
            chaos = Chaos(controller, args.seed)
            chaos.start()
            started = time.perf_counter()
            results = asyncio.run(drive(url, rows, args.duration, args.time_scale))
            chaos.stop_event.set()
            chaos.join()
            wall = time.perf_counter() - started
            time.sleep(15)  # the last SIGSTOPped worker is killed and replaced
            leaked = leaked_blocks(controller)
            migrated = migrations(url)
            events = ray.get(controller.status.remote())["events"]
        finally:
            ray.get(controller.shutdown.remote())
            ray.kill(controller)
    summary = compare(results, refs)
    result = {"workload": repo_relative(WORKLOADS / "online-poisson.jsonl"), "duration_s": args.duration,
              "wall_s": wall, "time_scale": args.time_scale, "seed": args.seed, "summary": summary,
              "migrations": migrated, "leaked_blocks": leaked, "chaos": chaos.events,
              "controller_events": [e for e in events if e["event"] in ("died", "ready", "replaced")],
              "targets_met": summary["failed"] == 0 and summary["differing_requests"] == 0
              and not any(leaked.values()),
              "timeline": [(round(r["sent_s"] - started, 2), r.get("ttft_s"), "error" in r) for r in results]}
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
