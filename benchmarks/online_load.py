"""Online serving benchmark: replay a timed trace against the router and measure TTFT,
TPOT, throughput and goodput under SLOs; and the router's own overhead (p50 added latency
of a request through the router vs straight to the decode worker's gRPC), in one run.

Starts pdserve (Ray, controller, 1 prefill + 1 decode worker, router) itself unless
--url is given. Writes benchmarks/results/online_load.json and .png.

    python benchmarks/online_load.py --rate-scale 1.0 --max-requests 80
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import panels, repo_relative, write  # noqa: E402
from pdserve.engine.stats import percentile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_TRACE = ROOT.parent / "shared" / "workloads" / "online-poisson.jsonl"


async def one_request(session, url: str, model: str, request: dict, start: float) -> dict:
    await asyncio.sleep(max(0.0, request["at"] - (time.perf_counter() - start)))
    body = {"model": model, "prompt": request["prompt_token_ids"], "max_tokens": request["max_tokens"],
            "ignore_eos": True, "stream": True, "temperature": 0}
    sent = time.perf_counter()
    first = None
    tokens = 0
    error = None
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                error = f"HTTP {response.status}"
            else:
                async for raw in response.content:
                    line = raw.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        break
                    if first is None:
                        first = time.perf_counter()
                    if event["choices"][0]["finish_reason"]:
                        tokens = request["max_tokens"]
    except aiohttp.ClientError as exc:
        error = repr(exc)
    end = time.perf_counter()
    ttft = first - sent if first else None
    tpot = (end - first) / (tokens - 1) if first and tokens > 1 else None
    return {"id": request["id"], "ttft_s": ttft, "tpot_s": tpot, "e2e_s": end - sent, "tokens": tokens,
            "error": error}


async def replay(url: str, model: str, requests: list[dict]) -> tuple[list[dict], float]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(session, url, model, r, start) for r in requests))
        return results, time.perf_counter() - start


def summarize(results: list[dict], wall_s: float, ttft_slo: float, tpot_slo: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    good = [r for r in ok if r["ttft_s"] is not None and r["ttft_s"] <= ttft_slo
            and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo)]
    return {
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": wall_s,
        "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
        "tpot_s": {f"p{q}": percentile(tpot, q) for q in (50, 90, 99)},
        "throughput_tokens_per_s": sum(r["tokens"] for r in ok) / wall_s,
        "throughput_requests_per_s": len(ok) / wall_s,
        "goodput_requests_per_s": len(good) / wall_s,
        "slo_attainment": len(good) / len(results) if results else None,
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
    }


async def router_overhead(url: str, model: str, decode_address: str, prefill_addresses: list[str],
                          repeats: int) -> dict:
    """p50 latency of a 1-token request through the router vs straight to the decode worker."""
    from pdserve.testkit.workers import collect, decode_stub, generate_request

    prompt = list(range(100, 132))
    via_router, direct = [], []
    channel, stub = decode_stub(decode_address)
    async with aiohttp.ClientSession() as session, channel:
        for i in range(repeats + 5):
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.read()
            router_s = time.perf_counter() - start
            start = time.perf_counter()
            await collect(stub, generate_request(f"overhead-{i}", prompt, 1, prefill_addresses))
            direct_s = time.perf_counter() - start
            if i >= 5:  # warm-up done
                via_router.append(router_s)
                direct.append(direct_s)
    router_p50, direct_p50 = statistics.median(via_router), statistics.median(direct)
    paired = statistics.median(r - d for r, d in zip(via_router, direct, strict=True))
    return {"router_p50_ms": 1000 * router_p50, "direct_grpc_p50_ms": 1000 * direct_p50,
            "added_p50_ms": 1000 * (router_p50 - direct_p50), "added_paired_median_ms": 1000 * paired,
            "repeats": repeats}


def plot(result: dict, path: Path) -> None:
    results = result["per_request"]
    with panels(path, 2, width=5.0) as [ax1, ax2]:
        for key, ax, slo in (("ttft_s", ax1, result["summary"]["slo"]["ttft_s"]),
                             ("tpot_s", ax2, result["summary"]["slo"]["tpot_s"])):
            values = sorted(r[key] for r in results if r[key] is not None)
            ax.plot(values, [i / max(1, len(values)) for i in range(1, len(values) + 1)])
            ax.axvline(slo, color="red", linestyle="--", label="SLO")
            ax.set_xlabel(f"{key} (s)")
            ax.set_ylabel("fraction of requests")
            ax.legend()
        ax1.figure.suptitle(f"online-poisson x{result['rate_scale']} ({result['summary']['requests']} requests)")


def start_service(model: str, port: int, **settings):
    import ray

    from pdserve.cluster.config import load_config
    from pdserve.cluster.controller import create_controller
    from pdserve.cluster.ray_cluster import init_private_cluster

    if not ray.is_initialized():
        init_private_cluster(4)
    config = load_config(None, {"model": model, "router.port": port, **settings})
    controller = create_controller(config)
    url = ray.get(controller.start.remote())
    return controller, url


def stop_service(controller) -> None:
    import ray

    ray.get(controller.shutdown.remote())
    ray.kill(controller)


def measure_overhead(port: int, repeats: int) -> dict:
    """Router overhead on a tiny random model, so model time does not drown it."""
    import tempfile

    import ray

    from pdserve.engine.model_source import resolve_model
    from pdserve.testkit.models import build_tiny_model
    from pdserve.testkit.workers import CLUSTER_TOKEN

    tiny = build_tiny_model(Path(tempfile.mkdtemp()), "llama", resolve_model("SmolLM2-135M-Instruct"))
    # the token testkit's direct stub carries (the workers refuse calls without the deployment's)
    controller, url = start_service(str(tiny), port, cluster_token=CLUSTER_TOKEN)
    try:
        status = ray.get(controller.status.remote())
        decode = status["pools"]["decode"]["workers"][0]["address"]
        prefill = [w["address"] for w in status["pools"]["prefill"]["workers"]]
        return asyncio.run(router_overhead(url, str(tiny), decode, prefill, repeats)) | {"model": "tiny random"}
    finally:
        stop_service(controller)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate x this (2: twice as fast)")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--url", default=None, help="an already running router (skips start-up)")
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--tpot-slo", type=float, default=0.15)
    parser.add_argument("--overhead-repeats", type=int, default=200, help="0 skips the router-overhead part")
    parser.add_argument("--out", type=Path, default=RESULTS / "online_load.json")
    args = parser.parse_args()

    requests = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    requests = requests[: args.max_requests] if args.max_requests else requests
    base = requests[0]["arrival_s"]
    for r in requests:
        r["at"] = (r["arrival_s"] - base) / args.rate_scale
    controller = None
    url, model = args.url, args.model
    if url is None:
        controller, url = start_service(args.model, args.port)
    try:
        results, wall = asyncio.run(replay(url, model, requests))
        result = {"trace": repo_relative(args.trace), "rate_scale": args.rate_scale,
                  "summary": summarize(results, wall, args.ttft_slo, args.tpot_slo), "per_request": results}
    finally:
        if controller is not None:
            stop_service(controller)
    if args.url is None and args.overhead_repeats:
        result["router_overhead"] = measure_overhead(args.port, args.overhead_repeats)
    import ray

    ray.shutdown()
    write(result, args.out, plot)
    print(json.dumps({k: v for k, v in result.items() if k != "per_request"}, indent=2))


if __name__ == "__main__":
    main()
