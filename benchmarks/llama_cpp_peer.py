"""llama.cpp vs pdserve's offline engine on this machine, the same weights (issue 51).

Measures, side by side in one run:

a. offline-mixed throughput (shared/workloads/offline-mixed.jsonl: 64 requests at t=0,
   ignore_eos, greedy): llama-server with 16 slots and continuous batching, fed by
   `--clients` concurrent HTTP clients on /completion (the prompt as token ids,
   `cache_prompt: false`, `n_predict` = max_tokens), vs pdserve's `LLM.generate` (prefix
   caching off; `run_pdserve` from offline_throughput.py), bf16 GGUF vs dtype bfloat16 and
   f32 GGUF vs dtype float32. Rounds interleave the four runs (and swap which system goes
   first each round; this machine is shared); medians and the ratio pdserve/llama.cpp.
   Every llama.cpp request is checked to have produced exactly max_tokens tokens from its
   whole prompt; each server is started for its run and stopped after it, so no idle
   server sits beside a pdserve run.
b. llama.cpp alone: time to first token of one random prompt of 512 / 2048 / 8000 / 8192
   tokens (llama-server -np 1, n_predict 1; the 8000 is the length long_prompt_ttft.py
   uses for pdserve, with the same prompts), and decode speed at batch 1 / 16 / 64 from
   llama-batched-bench (300-token prompts, 32 generated tokens), plus llama-bench's
   pp512 / tg128 for reference.

The JSON records every command, the llama.cpp version and build flags, the CPU flags,
the load average before and after, and every raw timing.

Building llama.cpp (no wheel needed; PyPI's sdist of llama-cpp-python vendors its source
and the HF-to-GGUF converter), outside the repository:

    mkdir -p /tmp/llamacpp && cd /tmp/llamacpp
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .
    tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp          # llama.cpp commit 0c1e57098
    cmake -B build -G Ninja -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_COMMIT=0c1e57098
    nice -n 19 cmake --build build -j2 --target llama-server llama-batched-bench llama-bench

(LLAMA_CURL no longer exists in this version; LLAMA_USE_PREBUILT_UI would fetch the web
UI from the network.) The GGUF files, from the model directory pdserve loads (its
safetensors, already float32), in a venv of its own that sees the repo venv's torch and
transformers:

    cd /tmp/llamacpp && python3 -m venv venv
    /work/main/.venv/bin/python -c "import site; print(site.getsitepackages()[0])" \\
        > venv/lib/python3.11/site-packages/zz_repo_venv.pth
    venv/bin/pip install ./llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py sentencepiece
    M=$(cd /work/main && .venv/bin/python -c "from pdserve.engine.model_source import \\
        resolve_model; print(resolve_model('SmolLM2-135M-Instruct'))")
    for t in bf16 f32; do venv/bin/python llama_cpp_python-0.3.36/vendor/llama.cpp/\\
        convert_hf_to_gguf.py $M --outtype $t --outfile models/SmolLM2-135M-Instruct-$t.gguf; done

Run (timed: under the benchmark lock, not niced):

    flock /tmp/bench.lock .venv/bin/python benchmarks/llama_cpp_peer.py

Writes benchmarks/results/llama_cpp_peer.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.offline_throughput import DEFAULT_WORKLOAD, load_workload, run_pdserve  # noqa: E402
from benchmarks.report import panels, repo_relative, write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LLAMACPP = Path("/tmp/llamacpp")
SOURCE = LLAMACPP / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
BIN = SOURCE / "build" / "bin"
MODELS = LLAMACPP / "models"
# pdserve dtype -> which GGUF holds the same weights in the same precision
PAIRS = {"bfloat16": "bf16", "float32": "f32"}
BUILD_KEYS = ("CMAKE_BUILD_TYPE", "CMAKE_GENERATOR", "CMAKE_C_COMPILER", "CMAKE_CXX_COMPILER", "CMAKE_C_FLAGS",
              "GGML_NATIVE", "GGML_CPU_ALL_VARIANTS", "GGML_BACKEND_DL", "GGML_OPENMP", "GGML_OPENMP_ENABLED",
              "GGML_LLAMAFILE", "GGML_CPU_REPACK", "GGML_BLAS", "GGML_AVX", "GGML_AVX2", "GGML_AVX512",
              "GGML_AVX512_BF16", "GGML_AVX512_VNNI", "GGML_AMX_BF16", "GGML_AVAILABLE_BACKENDS",
              "LLAMA_BUILD_COMMIT", "LLAMA_OPENSSL", "LLAMA_USE_PREBUILT_UI", "LLAMA_BUILD_UI", "LLAMA_BUILD_TESTS")
CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 900.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:  # llama-server says why in the body
        raise RuntimeError(f"HTTP {error.code}: {error.read()[:500].decode(errors='replace')}") from None


@contextmanager
def llama_server(binary: Path, gguf: Path, extra: list[str], log_dir: Path, tag: str):
    """Start llama-server on a free local port, wait until /health answers, yield
    (base url, command); on exit stop it (terminate, then kill) whatever happened."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--no-webui", *extra]
    log = open(log_dir / f"{tag}.log", "w")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({process.returncode}): see {log.name}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up: see {log.name}")
            time.sleep(0.2)
        yield url, command
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def completion(url: str, prompt: list[int], n_predict: int) -> dict:
    return post(url + "/completion", {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                                      "temperature": 0, "cache_prompt": False})


def slot_context(requests: list[dict], multiple: int = 256) -> int:
    """Per-slot context: the longest prompt + max_tokens, rounded up to `multiple`."""
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    return -(-longest // multiple) * multiple


def run_llama_offline(args, gguf: Path, requests: list[dict], log_dir: Path, tag: str) -> dict:
    ctx = args.slots * slot_context(requests)
    extra = ["-np", str(args.slots), "-c", str(ctx), "--threads", str(args.threads),
             "--threads-batch", str(args.threads), "-cb", "-cram", "0"]
    with llama_server(args.llama_server, gguf, extra, log_dir, tag) as (url, command):
        for r in requests[:4]:  # first calls outside the timed run
            completion(url, r["prompt_token_ids"], 4)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            replies = list(pool.map(lambda r: completion(url, r["prompt_token_ids"], r["max_tokens"]),
                                    requests))
        wall = time.perf_counter() - start
    produced = sum(x["tokens_predicted"] for x in replies)
    short = [r["id"] for r, x in zip(requests, replies, strict=True)
             if x["tokens_predicted"] != r["max_tokens"] or x["tokens_evaluated"] != len(r["prompt_token_ids"])]
    if short:
        raise RuntimeError(f"llama.cpp did not run these requests in full: {short}")
    timings = [x.get("timings", {}) for x in replies]
    return {"wall_s": wall, "output_tokens": produced, "output_tokens_per_s": produced / wall,
            "command": command,
            "server_prompt_ms_sum": sum(t.get("prompt_ms", 0.0) for t in timings),
            "server_predicted_ms_sum": sum(t.get("predicted_ms", 0.0) for t in timings)}


def offline_mixed(args, requests: list[dict], log_dir: Path) -> dict:
    from pdserve.engine import LLM

    llms = {name: LLM(dtype=name, enable_prefix_caching=False) for name in args.dtypes}
    for llm in llms.values():  # as offline_throughput.pdserve_runs: first calls outside the timed runs
        run_pdserve(llm, [{**r, "max_tokens": 4} for r in requests[:4]])
    runs: dict = {name: {"llama.cpp": [], "pdserve": []} for name in args.dtypes}
    for rnd in range(args.rounds):
        for name in args.dtypes:
            gguf = args.gguf[name]
            order = ["llama.cpp", "pdserve"] if rnd % 2 == 0 else ["pdserve", "llama.cpp"]
            for system in order:
                print(f"[{name}] round {rnd + 1}/{args.rounds}: {system} ...", flush=True)
                if system == "pdserve":
                    run = run_pdserve(llms[name], requests)
                else:
                    run = run_llama_offline(args, gguf, requests, log_dir, f"offline-{name}-{rnd}")
                run.update(round=rnd, load_average=os.getloadavg())
                runs[name][system].append(run)
                print(f"    {run['output_tokens_per_s']:.1f} output tok/s", flush=True)
    del llms
    out = {}
    for name, systems in runs.items():
        rates = {s: [x["output_tokens_per_s"] for x in v] for s, v in systems.items()}
        per_round = [p / q for p, q in zip(rates["pdserve"], rates["llama.cpp"], strict=True)]
        out[name] = {"gguf": str(args.gguf[name]),
                     "median_output_tokens_per_s": {s: statistics.median(v) for s, v in rates.items()},
                     "pdserve_over_llama_cpp": statistics.median(rates["pdserve"])
                     / statistics.median(rates["llama.cpp"]),
                     "pdserve_over_llama_cpp_per_round": per_round,
                     "pdserve_over_llama_cpp_median_of_rounds": statistics.median(per_round),
                     "runs": systems}
    return out


def ttft(args, log_dir: Path) -> dict:
    """llama.cpp time to first token: one request at a time, n_predict 1, the prompts
    long_prompt_ttft.py gives pdserve (random.Random(r * 7919 + n)). llama-server caps a
    slot's context at the model's training context (8192 for SmolLM2), which leaves no
    room for an 8192-token prompt plus its token: the GGUF's context_length is overridden
    to the -c given (it only sets that cap here: the model uses plain RoPE, no scaling)."""
    ctx = max(args.ttft_lengths) + 256
    extra = ["-np", "1", "-c", str(ctx), "-b", "2048", "-ub", "512", "--threads", str(args.threads),
             "--threads-batch", str(args.threads), "-cram", "0",
             "--override-kv", f"llama.context_length=int:{ctx}"]
    out = {}
    for name in args.dtypes:
        with llama_server(args.llama_server, args.gguf[name], extra, log_dir, f"ttft-{name}") as (url, command):
            completion(url, [random.Random(0).randrange(100, 40000) for _ in range(64)], 1)  # warm-up
            result: dict = {"command": command, "ttft_s": {}, "all_s": {}, "server_prompt_ms": {}}
            for n in args.ttft_lengths:
                times, server = [], []
                try:
                    for r in range(args.ttft_repeats):
                        prompt = [random.Random(r * 7919 + n).randrange(100, 40000) for _ in range(n)]
                        start = time.perf_counter()
                        reply = completion(url, prompt, 1)
                        times.append(time.perf_counter() - start)
                        assert reply["tokens_evaluated"] == n, reply["tokens_evaluated"]
                        server.append(reply.get("timings", {}).get("prompt_ms"))
                except Exception as error:  # noqa: BLE001 (recorded; the other lengths still run)
                    result.setdefault("errors", {})[str(n)] = repr(error)
                    print(f"[{name}] TTFT {n}: failed: {error!r}", flush=True)
                    continue
                result["ttft_s"][str(n)] = statistics.median(times)
                result["all_s"][str(n)] = times
                result["server_prompt_ms"][str(n)] = server
                print(f"[{name}] TTFT {n}: {statistics.median(times):.3f} s", flush=True)
        out[name] = result
    return out


def run_tool(command: list[str], timeout: float) -> tuple[list[dict], str, float]:
    """Run a llama.cpp tool; its JSON lines, the rest of its output, and its wall time."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)
    wall = time.perf_counter() - start
    rows, other = [], []
    for line in done.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            other.append(line)
    return rows, "\n".join(other + done.stderr.splitlines()[-40:]), wall


def batched_bench(args) -> dict:
    out = {}
    for name in args.dtypes:
        command = [str(args.llama_server.parent / "llama-batched-bench"), "-m", str(args.gguf[name]),
                   "-c", "32768", "-b", "2048", "-ub", "512", "-npp", "300", "-ntg", "32",
                   "-npl", ",".join(map(str, args.batches)), "--threads", str(args.threads),
                   "--threads-batch", str(args.threads), "--output-format", "jsonl"]
        rows, log, wall = run_tool(command, 900)
        out[name] = {"command": command, "wall_s": wall, "rows": rows, "log_tail": log,
                     "decode_tokens_per_s": {str(r["pl"]): r["speed_tg"] for r in rows},
                     "prefill_tokens_per_s": {str(r["pl"]): r["speed_pp"] for r in rows}}
        print(f"[{name}] batched-bench decode t/s: {out[name]['decode_tokens_per_s']}", flush=True)
    return out


def llama_bench(args) -> dict:
    out = {}
    for name in args.dtypes:
        command = [str(args.llama_server.parent / "llama-bench"), "-m", str(args.gguf[name]), "-p", "512",
                   "-n", "128", "-r", "2", "-t", str(args.threads), "-o", "jsonl"]
        rows, log, wall = run_tool(command, 600)
        out[name] = {"command": command, "wall_s": wall, "rows": rows,
                     "tokens_per_s": {f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}": r["avg_ts"]
                                      for r in rows}}
        print(f"[{name}] llama-bench: {out[name]['tokens_per_s']}", flush=True)
    return out


def build_info(binary: Path) -> dict:
    """The llama.cpp version, where its source came from, and how it was built."""
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    source = binary.parent.parent.parent
    info: dict = {"llama_server": str(binary), "version": (version.stdout + version.stderr).strip()}
    sdist = source.parent.parent
    if (sdist / "PKG-INFO").exists():
        meta = (sdist / "PKG-INFO").read_text()
        info["sdist"] = " ".join(re.findall(r"^(?:Name|Version): (.+)$", meta, re.M))
    changelog = sdist / "CHANGELOG.md"
    if changelog.exists():  # the first entry names the vendored llama.cpp commit
        found = re.search(r"llama\.cpp@([0-9a-f]+)", changelog.read_text())
        info["vendored_llama_cpp_commit"] = found.group(1) if found else None
    cache = binary.parent.parent / "CMakeCache.txt"
    if cache.exists():
        entries = dict(re.findall(r"^([A-Za-z0-9_]+):[A-Z]+=(.*)$", cache.read_text(), re.M))
        info["cmake_cache"] = {k: entries[k] for k in BUILD_KEYS if k in entries}
    ninja = binary.parent.parent / "build.ninja"
    if ninja.exists():
        info["march"] = sorted(set(re.findall(r"-march=\S+", ninja.read_text())))
    return info


def pdserve_revision() -> dict:
    """The commit pdserve runs from, and what differs from it in the working tree."""
    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, timeout=60)
        return done.stdout.strip()
    return {"commit": git("rev-parse", "HEAD"),
            "changed": git("status", "--porcelain", "--untracked-files=no").splitlines()}


def cpu_info() -> dict:
    text = Path("/proc/cpuinfo").read_text()
    flags = set(re.search(r"^flags\s*:\s*(.*)$", text, re.M).group(1).split())
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    return {"model_name": model.group(1) if model else "", "cores": os.cpu_count(),
            "flags": {f: f in flags for f in CPU_FLAGS}}


def plot(result: dict, path: Path) -> None:
    dtypes = list(result["offline_mixed"])
    with panels(path, 3, width=5.0) as [ax1, ax2, ax3]:
        width = 0.35
        for i, system in enumerate(["llama.cpp", "pdserve"]):
            values = [result["offline_mixed"][n]["median_output_tokens_per_s"][system] for n in dtypes]
            bars = ax1.bar([x + (i - 0.5) * width for x in range(len(dtypes))], values, width, label=system,
                           color="#999" if system == "llama.cpp" else "#2a7")
            ax1.bar_label(bars, fmt="%.0f", fontsize=7)
        ax1.set_xticks(range(len(dtypes)), dtypes)
        ax1.set_ylabel("output tokens/s (median)")
        ax1.set_title(f"offline-mixed, {result['num_requests']} requests, {result['slots']} llama.cpp slots",
                      fontsize=9)
        ax1.legend()
        for name in dtypes:
            lengths = list(result["llama_cpp_ttft"][name]["ttft_s"])
            ax2.plot([int(n) for n in lengths], [result["llama_cpp_ttft"][name]["ttft_s"][n] for n in lengths],
                     marker="o", label=f"llama.cpp {name}")
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("prompt tokens")
        ax2.set_ylabel("TTFT (s)")
        ax2.set_title("llama.cpp time to first token (-np 1)", fontsize=9)
        ax2.legend()
        for name in dtypes:
            rates = result["llama_cpp_batched_bench"][name]["decode_tokens_per_s"]
            ax3.plot([int(b) for b in rates], list(rates.values()), marker="o", label=f"llama.cpp {name}")
        ax3.set_xscale("log", base=2)
        ax3.set_xlabel("parallel sequences")
        ax3.set_ylabel("decode tokens/s")
        ax3.set_title("llama-batched-bench, 300-token prompts, 32 tokens", fontsize=9)
        ax3.legend()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-server", type=Path, default=BIN / "llama-server",
                        help="llama-batched-bench and llama-bench are taken from the same directory")
    parser.add_argument("--gguf-bf16", type=Path, default=MODELS / "SmolLM2-135M-Instruct-bf16.gguf")
    parser.add_argument("--gguf-f32", type=Path, default=MODELS / "SmolLM2-135M-Instruct-f32.gguf")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(PAIRS))
    parser.add_argument("--num-requests", type=int, default=None, help="the first N of the workload (smoke tests)")
    parser.add_argument("--rounds", type=int, default=3, help="offline-mixed runs per system and dtype")
    parser.add_argument("--slots", type=int, default=16, help="llama-server -np")
    parser.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--ttft-lengths", type=int, nargs="+", default=[512, 2048, 8000, 8192])
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--skip", nargs="*", default=[], choices=["offline", "ttft", "batched", "bench"])
    parser.add_argument("--build-wall-s", type=float, default=None,
                        help="how long the llama.cpp build took, to record beside its flags")
    parser.add_argument("--out", type=Path, default=RESULTS / "llama_cpp_peer.json")
    args = parser.parse_args()
    args.gguf = {"bfloat16": args.gguf_bf16, "float32": args.gguf_f32}
    for path in [args.llama_server, *(args.gguf[n] for n in args.dtypes)]:
        if not path.exists():
            sys.exit(f"{path} not found: build llama.cpp and convert the model as this script's docstring says")

    import torch

    from pdserve.engine.cpu import native_bf16_flags

    requests = load_workload(args.workload)[: args.num_requests]
    result: dict = {
        "workload": repo_relative(args.workload), "num_requests": len(requests), "slots": args.slots,
        "clients": args.clients, "threads": args.threads, "torch_threads": torch.get_num_threads(),
        "llama_cpp": {**build_info(args.llama_server), "build_wall_s": args.build_wall_s},
        "cpu": cpu_info(), "native_bf16": native_bf16_flags(),
        "gguf": {n: {"path": str(args.gguf[n]), "bytes": args.gguf[n].stat().st_size} for n in args.dtypes},
        "pdserve_revision_start": pdserve_revision(), "load_average_start": os.getloadavg(),
        "notes": [
            "GGUFs converted with the vendored convert_hf_to_gguf.py from the safetensors pdserve loads "
            "(float32, themselves dequantized from the packaged Q4_1 GGUF), so both systems run the same "
            "weights; bf16 GGUF keeps norms in f32, as pdserve does.",
            "llama.cpp offline: a fresh llama-server per run, 4 short warm-up requests, then all requests "
            "from --clients threads; flash attention left at its default (auto), prompt cache off (-cram 0, "
            "cache_prompt false); pdserve: LLM(dtype, enable_prefix_caching=False), run_pdserve.",
            "llama.cpp keeps its KV cache in f16 for both GGUFs (its default, type_k/type_v in llama_bench "
            "rows); pdserve keeps it in the model dtype, so the f32 pair gives llama.cpp the lighter cache.",
            "GGML_NATIVE=ON builds ggml-cpu with -march=native (see `march`): the GGML_AVX* options only "
            "apply when it is OFF.",
        ],
    }
    with tempfile.TemporaryDirectory(prefix="llama_cpp_peer-") as tmp:
        log_dir = Path(tmp)
        sections = {"offline": ("offline_mixed", lambda: offline_mixed(args, requests, log_dir)),
                    "ttft": ("llama_cpp_ttft", lambda: ttft(args, log_dir)),
                    "batched": ("llama_cpp_batched_bench", lambda: batched_bench(args)),
                    "bench": ("llama_bench", lambda: llama_bench(args))}
        for flag, (key, measure) in sections.items():
            if flag in args.skip:
                continue
            try:  # a failed section is recorded, and the others still run
                result[key] = measure()
            except Exception:  # noqa: BLE001
                result.setdefault("errors", {})[key] = traceback.format_exc()
                print(result["errors"][key], flush=True)
        # each server's setup and its warnings/errors (its per-request timings are in the replies)
        keep = re.compile(r" [WE] |n_ctx|n_slots|flash|threadpool|system_info")
        result["server_logs"] = {p.stem: [line for line in p.read_text().splitlines() if keep.search(line)][:40]
                                 for p in sorted(log_dir.glob("*.log"))}
    result["load_average_end"] = os.getloadavg()
    result["pdserve_revision_end"] = pdserve_revision()
    ready = {"offline_mixed", "llama_cpp_ttft", "llama_cpp_batched_bench"} <= set(result)
    write(result, args.out, plot if ready else None)


if __name__ == "__main__":
    main()
