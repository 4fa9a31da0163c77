"""One router process's relay capacity, measured alone: router alone, synthetic token source.

The end-to-end relay (benchmarks/control_plane_cluster.py `relay`) runs simulated decode
workers, whose engines take most of a small machine's cores, so it cannot show what the
router itself can relay. Here three processes, each measured on its own:

- a **token source** (one process): a gRPC server implementing the DecodeWorker service as a
  decode worker answers the router: `Info` (the sim model's: SmolLM2's tokenizer vocab and
  max_model_len, block size 16, no prefix caching), `Watch` (an update with a small load
  report every interval the router asks), `Stats`, `Abort`, and `Generate`, which streams
  one token per GenerateChunk (the first with `num_prompt_tokens`, `prefilled_by="local"` and
  `num_cached_tokens`, as decode_worker/service.py sends them; the last with finish reason
  "length" after the request's max_tokens) as fast as the stream takes them, or one every
  `interval_ms` per stream. Its tokens are real text's (this repository's README and some
  multi-byte text, encoded by the sim model's tokenizer), so detokenization costs what it
  does on real output;
- the **real router**, unmodified: `python -m pdserve.router --model SmolLM2-135M-Instruct
  --served-model-name sim --decode <source>`, its CPU the process's own;
- an **HTTP load generator** (aiohttp, one process): `concurrency` clients, each streaming
  completions back to back (`return_token_ids` and `stream_options.include_usage`); it counts
  each event's token ids with a byte scan (no JSON parse) and checks every request's count
  against its usage chunk's `completion_tokens` (mismatches are reported).

Per concurrency: tokens/s and requests/s through the router, its CPU (fraction of a core)
and tokens per router CPU-second (its capacity were it given a whole core), SSE events per
token (below 1: the router coalesced tokens because it or the client fell behind), and the
source's and the client's CPU. The three share the machine, so on few cores tokens/s is
bounded by all three; tokens per router CPU-second is the router's own figure.

    .venv/bin/python benchmarks/control_plane_relay.py --out /tmp/relay.json
    .venv/bin/python benchmarks/control_plane_relay.py --concurrency 64 256 --seconds 5 --interval-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LABEL = "router alone, synthetic token source"
TOKEN = "relay-benchmark-cluster-token-0123456789"
RELAY_TARGET = 20_000.0
_TOKEN_IDS = re.compile(rb'"token_ids":\[([0-9,]*)\]')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
_MULTIBYTE = " Hello, wörld! 你好世界 🎉🚀 naïve café — déjà vu, Ærø, Ελληνικά, русский текст, 日本語のテキスト. "


# ------------------------------------------------------------------ the token source

def _source_tokens() -> tuple[list[int], int, int]:
    """Real text's token ids (the sim model's tokenizer), its vocab size and max_model_len."""
    from pdserve.engine.config import SimConfig
    from pdserve.engine.model_source import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    model_dir = resolve_model(SimConfig().like)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = load_tokenizer(model_dir)
    text = (ROOT / "README.md").read_text()[:30000] + _MULTIBYTE * 20
    ids = tokenizer(text).input_ids
    return ids, config["vocab_size"], config["max_position_embeddings"]


def _serve_source(port, sent, interval_ms: float) -> None:
    """The token source process's body: serve on a free loopback port (written to `port`),
    counting the tokens it sends in `sent`."""
    import grpc

    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.protos import pdserve_pb2_grpc as pb_grpc
    from pdserve.rpc.channel import add_port, new_server
    from pdserve.rpc.security import Security

    pool, vocab_size, max_model_len = _source_tokens()
    chunks = [pb.GenerateChunk(token_ids=[t]) for t in pool]  # built once, sent many times
    pace = interval_ms / 1e3

    class Source(pb_grpc.DecodeWorkerServicer):
        def __init__(self) -> None:
            self.info = pb.WorkerInfo(worker_id="token-source", role="decode", model="sim",
                                      max_model_len=max_model_len, vocab_size=vocab_size, cache_root=b"s" * 16,
                                      prefix_caching=False, layout=pb.KVLayout(block_size=16))
            self.started = 0

        def stats(self) -> pb.WorkerStats:
            return pb.WorkerStats(worker_id="token-source", role="decode", num_running=8, num_free_blocks=4000,
                                  num_total_blocks=5000)

        async def Info(self, request, context):
            return self.info

        async def Stats(self, request, context):
            return self.stats()

        async def Abort(self, request, context):
            return pb.AbortReply(found=False)

        async def Watch(self, request, context):
            seq = 0
            while True:
                seq += 1
                yield pb.WorkerUpdate(seq=seq, stats=self.stats())
                await asyncio.sleep(max(0.01, (request.interval_ms or 250) / 1e3))

        async def Generate(self, request, context):
            n = request.sampling.max_tokens
            if n < 1:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1")
            prompt_len = len(request.prompt_token_ids)
            self.started += 1
            at = (self.started * 7919) % len(pool)  # each stream from its own place in the text
            first = pb.GenerateChunk(token_ids=[pool[at]], num_prompt_tokens=prompt_len, prefilled_by="local",
                                     num_cached_tokens=0, finish_reason="length" if n == 1 else "")
            yield first
            sent.value += 1
            for i in range(1, n):
                if pace:
                    await asyncio.sleep(pace)
                at = (at + 1) % len(pool)
                if i == n - 1:
                    yield pb.GenerateChunk(token_ids=[pool[at]], num_prompt_tokens=prompt_len, finish_reason="length")
                else:
                    chunk = chunks[at]
                    chunk.num_prompt_tokens = prompt_len
                    yield chunk
                sent.value += 1

    async def main() -> None:
        security = Security(TOKEN)
        server = new_server(security)
        pb_grpc.add_DecodeWorkerServicer_to_server(Source(), server)
        port.value = add_port(server, "127.0.0.1:0", security)
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


# ------------------------------------------------------------------ the load generator

class _Counts:
    def __init__(self) -> None:
        self.tokens = self.events = self.requests = self.errors = self.miscounted = self.checked = 0


def _scan(block: bytes) -> tuple[int, int, int | None]:
    """Complete SSE events' token ids and token-carrying events (a byte scan, no JSON
    parse), and the usage's completion tokens if the block holds the usage chunk."""
    tokens = events = 0
    for ids in _TOKEN_IDS.findall(block):
        events += 1
        if ids:
            tokens += ids.count(b",") + 1
    usage = None
    if b'"completion_tokens"' in block:
        usage = int(_COMPLETION_TOKENS.search(block).group(1))
    return tokens, events, usage


async def _client(session, url: str, counts: _Counts, window: list[float], seed: int, prompt_len: int,
                  max_tokens: int, vocab: int) -> None:
    import random

    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, 1.0))  # staggered: requests must not finish in waves
    measure_from, end = window
    while time.monotonic() < end:
        body = {"model": "sim", "prompt": [rng.randrange(3, vocab) for _ in range(prompt_len)],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "temperature": 0,
                "return_token_ids": True, "stream_options": {"include_usage": True}}
        try:
            async with session.post(url + "/v1/completions", json=body) as response:
                if response.status != 200:
                    counts.errors += 1
                    await response.read()
                    await asyncio.sleep(0.05)
                    continue
                pending, got, usage = b"", 0, None
                async for data in response.content.iter_any():
                    pending += data
                    cut = pending.rfind(b"\n\n")
                    if cut < 0:
                        continue
                    block, pending = pending[:cut], pending[cut + 2:]
                    tokens, events, u = _scan(block)
                    got += tokens
                    usage = u if u is not None else usage
                    if measure_from <= time.monotonic() < end:
                        counts.tokens += tokens
                        counts.events += events
        except Exception:  # noqa: BLE001 - counted; the load goes on
            counts.errors += 1
            continue
        counts.checked += 1
        counts.miscounted += got != usage
        if measure_from <= time.monotonic() < end:
            counts.requests += 1


def run_clients(url: str, concurrency: int, warm_s: float, seconds: float, prompt_len: int, max_tokens: int,
                 vocab: int, out) -> None:
    """The load generator process's body: puts its window (monotonic times) on `out` once it
    is ready, then its counts when every client has stopped."""
    async def main() -> dict:
        import aiohttp

        counts = _Counts()
        measure_from = time.monotonic() + warm_s
        window = [measure_from, measure_from + seconds]
        out.put(window)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
            await asyncio.gather(*(_client(session, url, counts, window, i, prompt_len, max_tokens, vocab)
                                   for i in range(concurrency)))
        return vars(counts)

    out.put(asyncio.run(main()))


# ------------------------------------------------------------------ the orchestration

def _cpu_s(process) -> float:
    times = process.cpu_times()
    return times.user + times.system


class _Rig:
    """The token source and the real router, started once for every concurrency."""

    def __init__(self, interval_ms: float, max_inflight: int) -> None:
        import urllib.request

        self.ctx = mp.get_context("spawn")
        self.port, self.sent = self.ctx.Value("i", 0), self.ctx.Value("q", 0, lock=False)
        self.source = self.ctx.Process(target=_serve_source, args=(self.port, self.sent, interval_ms), daemon=True)
        self.source.start()
        self.router = None
        deadline = time.monotonic() + 120
        while not self.port.value:
            if time.monotonic() > deadline or not self.source.is_alive():
                self.close()
                raise RuntimeError("the token source did not start")
            time.sleep(0.05)
        from pdserve.engine.config import SimConfig
        from pdserve.testkit.workers import free_port

        http_port = free_port()
        self.url = f"http://127.0.0.1:{http_port}"
        self.log_path = Path(tempfile.mkdtemp()) / "router.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "pdserve.router", "--model", SimConfig().like, "--served-model-name", "sim",
               "--port", str(http_port), f"--decode=127.0.0.1:{self.port.value}",
               "--max-inflight-requests", str(max_inflight)]
        env = {**os.environ, "PDSERVE_CLUSTER_TOKEN": TOKEN}
        self.router = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        while True:
            if self.router.poll() is not None:
                self.close()
                raise RuntimeError(f"the router exited {self.router.returncode}: {self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the router was not ready in time: {self.log_path.read_text()}")
            time.sleep(0.2)

    def level(self, concurrency: int, warm_s: float, seconds: float, prompt_len: int, max_tokens: int) -> dict:
        """`concurrency` streaming clients for `seconds` (after `warm_s`), measured."""
        import psutil

        out = self.ctx.Queue()
        client = self.ctx.Process(target=run_clients, args=(self.url, concurrency, warm_s, seconds, prompt_len,
                                                              max_tokens, 49152, out))
        client.start()
        try:
            measure_from, end = out.get(timeout=60)
            processes = {"router": psutil.Process(self.router.pid), "source": psutil.Process(self.source.pid),
                         "client": psutil.Process(client.pid)}
            time.sleep(max(0.0, measure_from - time.monotonic()))
            before, sent, start = {k: _cpu_s(p) for k, p in processes.items()}, self.sent.value, time.monotonic()
            time.sleep(max(0.0, end - time.monotonic()))
            wall = time.monotonic() - start
            cpu = {k: (_cpu_s(p) - before[k]) / wall for k, p in processes.items()}
            sent = self.sent.value - sent
            counts = out.get(timeout=120 + max_tokens)
        finally:
            client.join(30)
            if client.is_alive():
                client.kill()
                client.join()
        tokens_per_s = counts["tokens"] / seconds
        return {"concurrency": concurrency, "seconds": seconds, "max_tokens": max_tokens, "prompt_tokens": prompt_len,
                "tokens_per_s": tokens_per_s, "requests_per_s": counts["requests"] / seconds,
                "events_per_token": counts["events"] / max(1, counts["tokens"]),
                "router_cpu_fraction": cpu["router"],
                "router_tokens_per_cpu_s": tokens_per_s / cpu["router"] if cpu["router"] else None,
                "router_us_per_token": 1e6 * cpu["router"] / tokens_per_s if tokens_per_s else None,
                "source_cpu_fraction": cpu["source"], "source_tokens_per_s": sent / wall,
                "client_cpu_fraction": cpu["client"], "errors": counts["errors"],
                "requests_checked": counts["checked"], "miscounted_requests": counts["miscounted"]}

    def close(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(15)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        if self.router is not None:
            self._log.close()
        if self.source.is_alive():
            self.source.kill()
        self.source.join()


def relay_alone(concurrencies: tuple[int, ...] = (64, 256, 512), seconds: float = 8.0, warm_s: float = 3.0,
                interval_ms: float = 0.0, max_tokens: int = 128, prompt_len: int = 64) -> dict:
    """The router's relay capacity against a synthetic token source (see the module's
    docstring): one row per concurrency."""
    load_at_start = os.getloadavg()
    rig = _Rig(interval_ms, max(256, 2 * max(concurrencies)))
    try:
        rows = [rig.level(c, warm_s, seconds, prompt_len, max_tokens) for c in concurrencies]
    finally:
        rig.close()
    return {"label": LABEL, "measurement": LABEL,
            "setup": {"source": "one process, DecodeWorker gRPC service, one token per GenerateChunk, "
                                + (f"one token every {interval_ms:g} ms per stream" if interval_ms else
                                   "unpaced (as fast as each stream takes them)"),
                      "router": "real router, unmodified (python -m pdserve.router), one process",
                      "client": "one aiohttp process, byte-scan token count checked against usage",
                      "interval_ms": interval_ms, "max_tokens": max_tokens, "prompt_tokens": prompt_len,
                      "cores": os.cpu_count(), "load_average_at_start": load_at_start},
            "rows": rows}


def relay_alone_rows(relay: dict, row) -> list[dict]:
    """benchmarks/control_plane.py's summary rows (`row` its row builder) for `relay_alone`."""
    rows = relay["rows"]
    levels = [r["concurrency"] for r in rows]
    return [row("router relay alone (synthetic token source): streamed tokens/s", "tokens/s", levels,
                [r["tokens_per_s"] for r in rows], relay["label"], ">= 20k tokens/s from one router process",
                max(r["tokens_per_s"] for r in rows) >= RELAY_TARGET, against="concurrent streams",
                requests_per_s=[round(r["requests_per_s"], 1) for r in rows],
                router_cpu_fraction=[round(r["router_cpu_fraction"], 3) for r in rows],
                router_tokens_per_cpu_s=[round(r["router_tokens_per_cpu_s"] or 0) for r in rows],
                events_per_token=[round(r["events_per_token"], 3) for r in rows],
                source_cpu_fraction=[round(r["source_cpu_fraction"], 3) for r in rows],
                client_cpu_fraction=[round(r["client_cpu_fraction"], 3) for r in rows],
                miscounted_requests=[r["miscounted_requests"] for r in rows],
                per_router_cpu_s_met=max(r["router_tokens_per_cpu_s"] or 0 for r in rows) >= RELAY_TARGET,
                note="tokens per router CPU-second >= 20k: one router process given a whole core relays "
                     "the target; tokens/s itself is bounded by the three processes sharing this machine")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per concurrency")
    parser.add_argument("--warm", type=float, default=3.0, help="seconds of load before each window")
    parser.add_argument("--interval-ms", type=float, default=0.0, help="per-stream token pacing (0: unpaced)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout only)")
    args = parser.parse_args()
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": os.cpu_count()},
              **relay_alone(tuple(args.concurrency), args.seconds, args.warm, args.interval_ms, args.max_tokens,
                            args.prompt_tokens)}
    result["meta"]["load_average_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
