"""Prefix reuse across the prefill/decode split: three configurations side by side in one run.

Replays `multi-turn-chat.jsonl` (each session a chat: turn k's prompt is the system prompt,
every earlier user message and the reply the service really generated, then the new user
message, sent after the user's think time) and `shared-prefix.jsonl` (documents shared by
many questions) through the real service (Ray, 1 prefill + 1 decode worker, router, HTTP):

- `off`: prefix caching off, every prompt prefilled remotely (pdserve before caching);
- `on-remote`: caching on, every prompt prefilled remotely (only what decode lacks ships);
- `on-decide`: caching on, the decode worker prefills short uncached tails itself.

Per configuration and workload: TTFT and TPOT p50/p90, prompt tokens computed (prompt
minus `usage.prompt_tokens_details.cached_tokens`), KV bytes shipped and decisions by
reason (the router's /metrics), cache hit rate. JSON and a PNG under benchmarks/results/.

    .venv/bin/python benchmarks/prefix_reuse.py [--sessions 48] [--questions 160] [--time-scale 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import panels, repo_relative, write  # noqa: E402
from pdserve.engine.stats import percentile  # noqa: E402

WORKLOADS = ROOT.parent / "shared" / "workloads"
CONFIGS = {
    "off": {"prefill.engine.enable_prefix_caching": False, "decode.engine.enable_prefix_caching": False,
            "local_prefill_max_tokens": 0},
    "on-remote": {"local_prefill_max_tokens": 0},
    "on-decide": {"local_prefill_max_tokens": 256},
}


async def completion(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: TTFT, TPOT, the generated ids, usage."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    sent, first, ids, usage = time.perf_counter(), None, [], None
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                usage = event["usage"]
            elif event["choices"][0].get("token_ids"):
                first = first or time.perf_counter()
                ids.extend(event["choices"][0]["token_ids"])
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"the stream ended without a token (usage {usage})")
    return {"ttft_s": first - sent, "tpot_s": (end - first) / (len(ids) - 1) if len(ids) > 1 else None,
            "ids": ids, "sent_at": sent, "output_tokens": len(ids), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def chat_session(session, url: str, row: dict, start: float, time_scale: float) -> list[dict]:
    """A chat client: each turn resends the history with the real replies."""
    await asyncio.sleep(max(0.0, row["start_s"] * time_scale - (time.perf_counter() - start)))
    history, results = list(row["system_prompt_ids"]), []
    for turn in row["turns"]:
        history += turn["user_ids"]
        try:
            result = await completion(session, url, history, turn["max_tokens"])
        except (RuntimeError, AssertionError, aiohttp.ClientError) as exc:
            results.append({"error": str(exc)})
            return results  # a chat whose turn failed ends there, as its user would
        history += result.pop("ids")
        results.append(result)
        await asyncio.sleep(turn.get("think_s", 0.0) * time_scale)
    return results


async def question(session, url: str, row: dict, start: float, time_scale: float) -> list[dict]:
    await asyncio.sleep(max(0.0, row["arrival_s"] * time_scale - (time.perf_counter() - start)))
    try:
        result = await completion(session, url, row["prompt_token_ids"], row["max_tokens"])
    except (RuntimeError, AssertionError, aiohttp.ClientError) as exc:
        return [{"error": str(exc)}]
    result.pop("ids")
    return [result]


async def replay(url: str, workload: str, rows: list[dict], time_scale: float) -> tuple[list[dict], float]:
    """Every row's requests (a chat's turns, or one question); each result's `sent_s` is
    when it was sent, from the start of the replay."""
    client = chat_session if workload == "multi-turn-chat" else question
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()
        nested = await asyncio.gather(*(client(session, url, row, start, time_scale) for row in rows))
        results = [r for results in nested for r in results]
        for r in results:
            if "sent_at" in r:
                r["sent_s"] = r.pop("sent_at") - start
        return results, time.perf_counter() - start


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    wanted = ("pdserve_kv_transfer_bytes_total", "pdserve_prefill_decisions_total")
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines())
            if name.startswith(wanted)}


def summarize(results: list[dict], wall_s: float, before: dict, after: dict) -> dict:
    failed = [r["error"] for r in results if "error" in r]
    results = [r for r in results if "error" not in r]
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "requests": len(results), "failed": len(failed), "first_errors": failed[:3], "wall_s": wall_s,
        "ttft_s": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90)},
        "tpot_s": {"p50": percentile(tpot, 50), "p90": percentile(tpot, 90)},
        "prompt_tokens": prompt, "prompt_tokens_computed": prompt - cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "kv_bytes_shipped": delta.get('pdserve_kv_transfer_bytes_total{pool="decode"}', 0.0),
        "prefill_decisions": {k.split("{", 1)[1].rstrip("}"): v for k, v in delta.items()
                              if k.startswith("pdserve_prefill_decisions_total") and v},
    }


def workload_rows(name: str, limit: int) -> list[dict]:
    """The first `limit` rows of ../shared/workloads/`name`.jsonl."""
    return [json.loads(line) for line in (WORKLOADS / f"{name}.jsonl").read_text().splitlines()][:limit]


@contextmanager
def local_ray(num_cpus: int):
    """A Ray instance in this process for the benchmark's services."""
    import ray

    from pdserve.cluster.ray_cluster import init_private_cluster

    init_private_cluster(num_cpus)
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def service(settings: dict):
    """A `pdserve up` of `settings` (dotted config keys) on the local Ray; yields its URL."""
    import ray

    from pdserve.cluster.config import load_config
    from pdserve.cluster.controller import create_controller

    controller = create_controller(load_config(None, settings))
    try:
        yield ray.get(controller.start.remote())
    finally:
        ray.get(controller.shutdown.remote())
        ray.kill(controller)


def run_config(name: str, overrides: dict, workloads: dict, time_scale: float, port: int) -> dict:
    settings = {"router.port": port, "prefill.num_cpus": 1, "decode.num_cpus": 1, **overrides}
    with service(settings) as url:
        out = {}
        for workload, rows in workloads.items():
            time.sleep(1.0)  # let the router's view of worker stats settle
            before = scrape(url)
            results, wall = asyncio.run(replay(url, workload, rows, time_scale))
            time.sleep(1.0)
            out[workload] = summarize(results, wall, before, scrape(url))
            print(f"{name} {workload}: {json.dumps(out[workload])}", flush=True)
        return out


def plot(result: dict, path: Path) -> None:
    configs = list(result["configs"])
    workloads = list(result["workloads"])
    with panels(path, 3, width=4.5) as axes:
        for ax, (key, label) in zip(axes, [("ttft_p50", "TTFT p50 (s)"), ("prompt_tokens_computed", "prompt tokens "
                                            "computed"), ("kv_bytes_shipped", "KV bytes shipped")], strict=True):
            width = 0.8 / len(configs)
            for i, name in enumerate(configs):
                values = [result["configs"][name][w]["ttft_s"]["p50"] if key == "ttft_p50"
                          else result["configs"][name][w][key] for w in workloads]
                ax.bar([x + i * width for x in range(len(workloads))], values, width, label=name)
            ax.set_xticks([x + width * (len(configs) - 1) / 2 for x in range(len(workloads))], workloads)
            ax.set_title(label)
        axes[0].legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=48, help="multi-turn-chat sessions to replay")
    parser.add_argument("--questions", type=int, default=160, help="shared-prefix requests to replay")
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrival and think times x this")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    parser.add_argument("--port", type=int, default=8019)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefix_reuse.json")
    args = parser.parse_args()
    workloads = {"multi-turn-chat": workload_rows("multi-turn-chat", args.sessions),
                 "shared-prefix": workload_rows("shared-prefix", args.questions)}
    with local_ray(num_cpus=4):
        configs = {name: run_config(name, CONFIGS[name], workloads, args.time_scale, args.port)
                   for name in args.configs.split(",")}
    result = {"workloads": {w: repo_relative(WORKLOADS / f"{w}.jsonl") for w in workloads},
              "sessions": args.sessions, "questions": args.questions, "time_scale": args.time_scale,
              "configs": configs}
    if "off" in configs:
        off = configs["off"]
        result["vs_off"] = {name: {w: {
            "prompt_tokens_computed_down": 1 - c[w]["prompt_tokens_computed"] / off[w]["prompt_tokens_computed"],
            "ttft_p50_speedup": off[w]["ttft_s"]["p50"] / c[w]["ttft_s"]["p50"],
            "kv_bytes_shipped_down": 1 - c[w]["kv_bytes_shipped"] / max(off[w]["kv_bytes_shipped"], 1)}
            for w in workloads} for name, c in configs.items() if name != "off"}
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
