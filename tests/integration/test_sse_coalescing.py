"""A streaming client that falls behind gets the tokens that came meanwhile coalesced into
fewer SSE chunks, carrying exactly the tokens, text, finish reason and usage an uncoalesced
stream (and the non-streamed answer) carries; a client that keeps up gets one event per
token. The real bare router over a simulated decode worker process."""

import asyncio
import http.client
import json
import socket
import time

import aiohttp
import pytest

from pdserve.engine.config import DEFAULT_MODEL, SIM_MODEL
from pdserve.testkit.workers import RouterProcess, WorkerProcess, stats_of
from tests.e2e.http import parse_sse, post

PROMPT = list(range(400, 432))


def sim_router(speed: str):
    """A router over one simulated decode worker stepping `speed` times faster than the 2-core profile."""
    with WorkerProcess("decode", SIM_MODEL, "--sim-speed", speed, "--no-sim-kv-bytes",
                       "--local-prefill-max-tokens", "100000") as d, \
            RouterProcess(DEFAULT_MODEL, [], [d.address], served_model_name="sim") as router:
        yield {"url": router.url, "port": router.port, "decode": d}


@pytest.fixture(scope="module")
def paced():
    """Tokens some 20 ms apart: a client reading as they come keeps up."""
    yield from sim_router("1")


@pytest.fixture(scope="module")
def fast():
    """Tokens as fast as the worker's loop sends them."""
    yield from sim_router("1000")


def body(max_tokens: int, stream: bool = True, **more) -> dict:
    usage = {"stream_options": {"include_usage": True}} if stream else {}
    return {"model": "sim", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True, "stream": stream, **usage, **more}


def reference(url: str, max_tokens: int, **more) -> dict:
    """The non-streamed answer: each choice's token ids, text, finish reason (and logprobs), the usage."""
    status, out, _ = post(url + "/v1/completions", body(max_tokens, stream=False, **more))
    assert status == 200, out
    return out


def streamed(events: list[dict], index: int = 0) -> dict:
    """What a stream's chunks carry in all for choice `index`: token ids, text, finish
    reasons, logprobs, how many chunks carried them, and the usage."""
    token_events = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
    logprobs = [c["logprobs"] for c in token_events if c["logprobs"]]
    return {"token_ids": [t for c in token_events for t in c["token_ids"]],
            "text": "".join(c["text"] for c in token_events),
            "finishes": [c["finish_reason"] for c in token_events],
            "logprobs": {k: [v for lp in logprobs for v in lp[k]] for k in ("tokens", "token_logprobs", "top_logprobs")}
            if logprobs else None,
            "usage": [e["usage"] for e in events if not e["choices"]], "token_events": len(token_events)}


def assert_same_as(got: dict, expected: dict, index: int = 0) -> None:
    """`got` (`streamed`) carries what choice `index` of the non-streamed answer carries."""
    choice = expected["choices"][index]
    assert got["token_ids"] == choice["token_ids"], "no token dropped, duplicated or reordered"
    assert got["text"] == choice["text"]
    assert got["finishes"] == [None] * (got["token_events"] - 1) + [choice["finish_reason"]]
    if choice["logprobs"] is not None:
        assert got["logprobs"] == {k: choice["logprobs"][k] for k in ("tokens", "token_logprobs", "top_logprobs")}
    [usage] = got["usage"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # the cached tokens differ: the prompt ran before
    assert [usage[k] for k in counts] == [expected["usage"][k] for k in counts]


def test_a_client_that_keeps_up_gets_one_event_per_token(paced):
    expected = reference(paced["url"], 24)

    async def read():
        events = []
        async with aiohttp.ClientSession() as session, \
                session.post(paced["url"] + "/v1/completions", json=body(24)) as response:
            assert response.status == 200
            async for line in response.content:  # read as each event comes
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[len(b"data: "):]))
        return events

    got = streamed(asyncio.run(read()))
    assert_same_as(got, expected)
    assert got["usage"][0]["completion_tokens"] == 24
    assert got["token_events"] == len(got["token_ids"]) == 24, "one token per event, as it came"


def test_a_client_that_falls_behind_gets_the_same_tokens_in_fewer_chunks(fast):
    # 8 choices x 2000 tokens with 20 logprobs each: some 12 MB of events as they come, past
    # what the sockets (a few MB on loopback) and the router's write buffer hold, so its writes
    # wait on the client meanwhile
    n, max_tokens, more = 8, 2000, {"n": 8, "logprobs": 20, "seed": 7, "temperature": 1.0}
    expected = reference(fast["url"], max_tokens, **more)

    async def finished() -> int:
        return (await stats_of(fast["decode"].address, "decode")).num_finished

    before = asyncio.run(finished())
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
    sock.connect(("127.0.0.1", fast["port"]))
    connection = http.client.HTTPConnection("127.0.0.1", fast["port"], timeout=120)
    connection.sock = sock
    try:
        connection.request("POST", "/v1/completions", json.dumps(body(max_tokens, **more)),
                           {"Content-Type": "application/json"})
        deadline = time.monotonic() + 120
        while asyncio.run(finished()) < before + n:  # not reading until the worker has sent every token
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.05)
        response = connection.getresponse()
        assert response.status == 200
        raw = response.read()
        events, done = parse_sse(raw.decode())
    finally:
        connection.close()
    assert done
    token_events = 0
    for index in range(n):
        got = streamed(events, index)
        assert_same_as(got, expected, index)
        token_events += got["token_events"]
    assert token_events < n * max_tokens / 2, \
        f"{token_events} events ({len(raw) / 2**20:.1f} MiB) for {n * max_tokens} tokens: not coalesced"
