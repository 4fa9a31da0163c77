"""The benchmark clients users bring, run unchanged against `pdserve up`.

guidellm (synthetic prompts, streaming, over /v1/chat/completions and /v1/completions: it
sends `stream_options.continuous_usage_stats`, `max_completion_tokens`, `stop: null`,
`ignore_eos`) and aiperf (synthetic streaming chat and completions). Each client runs in its
own virtualenv (they pin their own versions of libraries pdserve also uses), from a
directory other than the repository; each run's successful and failed request counts and
its median TTFT and output throughput go to benchmarks/results/client_compat.json.

    python -m venv /tmp/guidellm && /tmp/guidellm/bin/pip install guidellm==0.8.1
    python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf==0.13.0
    .venv/bin/python benchmarks/client_compat.py --guidellm /tmp/guidellm/bin/guidellm \\
        --aiperf /tmp/aiperf/bin/aiperf

Without `--url` the script starts `pdserve up` (default config) and stops it afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")


def run_guidellm(exe: str, url: str, model: str, tokenizer: Path, endpoint: str, requests: int, workdir: Path) -> dict:
    out = workdir / f"guidellm-{endpoint.strip('/').replace('/', '-')}.json"
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={url},model={model},request_format={endpoint}",
           "--profile", "kind=concurrent,streams=4", "--constraint", f"kind=max_requests,count={requests}",
           "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result = {"client": "guidellm", "endpoint": endpoint, "exit_code": proc.returncode,
              "wall_s": time.monotonic() - started}
    if proc.returncode != 0 or not out.exists():
        result["error_tail"] = (proc.stdout + proc.stderr)[-2000:]
        return result
    bench = json.loads(out.read_text())["benchmarks"][0]
    state, metrics = bench["scheduler_state"], bench["metrics"]
    result.update(successful=state["successful_requests"], errored=state["errored_requests"],
                  ttft_ms_median=metrics["time_to_first_token_ms"]["successful"]["median"],
                  output_tokens_per_s=metrics["output_tokens_per_second"]["successful"]["mean"])
    return result


def run_aiperf(exe: str, url: str, model: str, tokenizer: Path, endpoint: str, requests: int, workdir: Path) -> dict:
    kind = "chat" if endpoint == "/v1/chat/completions" else "completions"
    artifacts = workdir / f"aiperf-{kind}"
    # per-chunk usage (stream_options.continuous_usage_stats) is a chat-only option in aiperf
    usage = ["--per-chunk-usage", "--use-server-token-count"] if kind == "chat" else []
    cmd = [exe, "profile", "--model", model, "--url", url, "--endpoint-type", kind, "--streaming", *usage,
           "--request-count", str(requests), "--concurrency", "4",
           "--prompt-input-tokens-mean", "128", "--prompt-output-tokens-mean", "32", "--extra-inputs",
           "ignore_eos:true", "--tokenizer", str(tokenizer), "--artifact-dir", str(artifacts), "--ui-type", "none"]
    started = time.monotonic()
    # aiperf reads a local tokenizer directory only outside HF's offline mode
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=900, env=env)
    result = {"client": "aiperf", "endpoint": endpoint, "exit_code": proc.returncode,
              "wall_s": time.monotonic() - started}
    exported = sorted(artifacts.rglob("profile_export_aiperf.json"))
    if proc.returncode != 0 or not exported:
        result["error_tail"] = (proc.stdout + proc.stderr)[-2000:]
        return result
    data = json.loads(exported[-1].read_text())
    result.update(successful=int(data.get("request_count", {}).get("avg", 0)),
                  errored=sum(int(e.get("count", 1)) for e in data.get("error_summary") or []),
                  ttft_ms_median=data.get("time_to_first_token", {}).get("p50"),
                  output_tokens_per_s=data.get("output_token_throughput", {}).get("avg"))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--guidellm", help="the guidellm executable (its own venv)")
    parser.add_argument("--aiperf", help="the aiperf executable (its own venv)")
    parser.add_argument("--url", help="a running pdserve router (default: start `pdserve up` and stop it after)")
    parser.add_argument("--requests", type=int, default=16, help="requests per client and endpoint")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/client_compat.json"))
    args = parser.parse_args()
    if not (args.guidellm or args.aiperf):
        parser.error("give --guidellm and/or --aiperf")

    from pdserve.engine.config import DEFAULT_MODEL
    from pdserve.engine.model_source import resolve_model

    tokenizer = resolve_model(DEFAULT_MODEL)
    pdserve = str(Path(sys.executable).with_name("pdserve"))
    url = args.url
    if url is None:
        subprocess.run([pdserve, "up", "--detach"], check=True, cwd=tempfile.gettempdir())
        url = "http://127.0.0.1:8000"
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for endpoint in ENDPOINTS:
                for name, runner in (("guidellm", run_guidellm), ("aiperf", run_aiperf)):
                    exe = getattr(args, name)
                    if exe:
                        result = runner(exe, url, DEFAULT_MODEL, tokenizer, endpoint, args.requests, Path(tmp))
                        print(json.dumps({k: v for k, v in result.items() if k != "error_tail"}), flush=True)
                        if "error_tail" in result:
                            print(result["error_tail"], file=sys.stderr)
                        results.append(result)
    finally:
        if args.url is None:
            subprocess.run([pdserve, "down"], cwd=tempfile.gettempdir())
    ok = all(r["exit_code"] == 0 and r.get("errored") == 0 and r.get("successful") == args.requests
             for r in results)
    Path(args.out).write_text(json.dumps({"requests_per_run": args.requests, "all_succeeded": ok,
                                          "runs": results}, indent=1) + "\n")
    print(f"{'every request of every run succeeded' if ok else 'FAILED'}; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
