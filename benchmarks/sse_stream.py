"""SSE framing: the router's hand-written stream vs FastAPI's event-source helper, in one run.

One uvicorn server (configured as the router's: httptools, no access log) serves three
POST endpoints that stream the same OpenAI completion chunks (`protocol.completion_chunk`)
as server-sent events, with no model behind them, so only the framing differs:
  - handwritten: the router's way: `json.dumps` each chunk into `data: ...\\n\\n` bytes,
    returned through a plain `StreamingResponse` (router/app.py `_sse`);
  - fastapi_sse_dict: `response_class=fastapi.sse.EventSourceResponse`, yielding the dicts
    (FastAPI encodes each);
  - fastapi_sse_event: the same helper, yielding `ServerSentEvent(raw_data=...)` with the
    JSON already made.
An aiohttp client (a fast load generator) opens `--concurrency` streams of `--events`
events each per endpoint, round-robin over `--rounds` rounds, and reads every line.
Reports events/s per endpoint (median over rounds) and the ratios. Writes
benchmarks/results/sse_stream.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.report import panels, write  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ENDPOINTS = ("handwritten", "fastapi_sse_dict", "fastapi_sse_event")


def build_app(events: int):
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from fastapi.sse import EventSourceResponse, ServerSentEvent

    from pdserve.router import protocol

    app = FastAPI()

    def chunks():
        for i in range(events):
            yield protocol.completion_chunk("cmpl-bench", "bench", 0, " token", "length" if i == events - 1 else None)

    @app.post("/handwritten")
    async def handwritten():
        async def stream():
            for chunk in chunks():
                yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/fastapi_sse_dict", response_class=EventSourceResponse)
    async def fastapi_sse_dict():
        for chunk in chunks():
            yield chunk
        yield ServerSentEvent(raw_data="[DONE]")

    @app.post("/fastapi_sse_event", response_class=EventSourceResponse)
    async def fastapi_sse_event():
        for chunk in chunks():
            yield ServerSentEvent(raw_data=json.dumps(chunk, separators=(",", ":")))
        yield ServerSentEvent(raw_data="[DONE]")

    return app


def serve(port: int, events: int) -> None:
    import uvicorn

    uvicorn.run(build_app(events), host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def one_stream(session, url: str) -> int:
    received = 0
    async with session.post(url) as response:
        assert response.status == 200, response.status
        async for raw in response.content:
            if raw.startswith(b"data: "):
                if raw.strip() == b"data: [DONE]":
                    return received
                json.loads(raw[6:])
                received += 1
    raise AssertionError(f"{url}: stream ended without [DONE]")


async def measure(url: str, concurrency: int, events: int) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        await one_stream(session, url)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(session, url) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    assert all(c == events for c in counts), counts
    return concurrency * events / elapsed


async def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.1)
    raise TimeoutError("benchmark server did not start")


def plot(result: dict, path: Path) -> None:
    with panels(path, 1, width=6.0) as (ax,):
        rates = result["events_per_s"]
        ax.bar([n.replace("_", "\n", 1) for n in rates], list(rates.values()), color=["#2a7", "#999", "#999"])
        ax.set_ylabel("SSE events/s (median of rounds)")
        ax.set_title(f"{result['concurrency']} streams x {result['events']} events")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=64, help="streams at once")
    parser.add_argument("--events", type=int, default=200, help="events per stream")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "sse_stream.json")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: run the server
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.events)
        return

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--events", str(args.events)])
    try:
        asyncio.run(wait_listening(port))
        rounds = {name: [] for name in ENDPOINTS}
        for index in range(args.rounds):
            for name in ENDPOINTS:
                rate = asyncio.run(measure(f"http://127.0.0.1:{port}/{name}", args.concurrency, args.events))
                rounds[name].append(rate)
            print(f"round {index + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.0f}/s" for n, v in rounds.items()),
                  flush=True)
    finally:
        server.terminate()
        server.wait(10)
    rates = {name: statistics.median(v) for name, v in rounds.items()}
    result = {
        "concurrency": args.concurrency, "events": args.events, "rounds": args.rounds,
        "events_per_s_rounds": rounds, "events_per_s": rates,
        "handwritten_over": {name: statistics.median(a / b for a, b in zip(rounds["handwritten"], v, strict=True))
                             for name, v in rounds.items() if name != "handwritten"},
    }
    write(result, args.out, plot)


if __name__ == "__main__":
    main()
