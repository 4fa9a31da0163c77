"""Router start-up time and memory: `python -m pdserve.router` from launch until it answers HTTP.

Starts a bare router (its decode worker address points nowhere, so only the router's own
start-up is measured: model resolution, tokenizer, FastAPI, uvicorn), polls `/health`
until it answers (503 "starting" counts: the process is serving), then records the wall
time, the process's resident memory (VmRSS), and whether libtorch is mapped into it.

    .venv/bin/python benchmarks/router_startup.py --rounds 5 --compare-ref 45b62d0

`--compare-ref REF` also measures the tree of git revision REF (a temporary worktree), the
two trees alternating round by round so that both see the same machine state.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import write  # noqa: E402
from benchmarks.trees import importable, worktree  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def one_round(tree: Path, model: str, shim: Path, timeout_s: float = 120.0) -> dict:
    port = _free_port()
    started = time.perf_counter()
    path, prefix = importable(tree, shim)
    env = {**os.environ, "PDSERVE_LOG_LEVEL": "WARNING", "PYTHONPATH": path,
           "PDSERVE_CLUSTER_TOKEN": "router-startup-benchmark-token"}
    proc = subprocess.Popen([sys.executable, "-m", prefix + "router", "--model", model, "--port", str(port),
                             "--decode", "127.0.0.1:1"], cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        while time.perf_counter() - started < timeout_s:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except urllib.error.HTTPError:  # 503 "starting": the router is serving
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"router exited with {proc.returncode}") from None
                time.sleep(0.02)
        else:
            raise RuntimeError("router did not answer in time")
        ready_s = time.perf_counter() - started
        time.sleep(0.5)  # let lazy start-up work (tokenizer load) settle before reading memory
        return {"ready_s": ready_s, "rss_mib": _rss_mib(proc.pid), "torch_loaded": _maps_torch(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare-ref", default=None, help="also measure this git revision's tree")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_startup.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        trees = {"working tree": ROOT}
        if args.compare_ref:
            trees[args.compare_ref] = stack.enter_context(worktree(args.compare_ref, Path(tmp) / "ref"))
        rounds: dict[str, list] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for i, (name, tree) in enumerate(trees.items()):
                rounds[name].append(one_round(tree, args.model, Path(tmp) / f"shim-{i}"))
    result = {"model": args.model, "rounds": args.rounds, "trees": {
        name: {"median_ready_s": statistics.median(r["ready_s"] for r in runs),
               "median_rss_mib": statistics.median(r["rss_mib"] for r in runs),
               "torch_loaded": any(r["torch_loaded"] for r in runs), "runs": runs}
        for name, runs in rounds.items()}}
    write(result, Path(args.out))


if __name__ == "__main__":
    main()
