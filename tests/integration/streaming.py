"""Streams the migration tests drive: a streamed completion read token by token, with a
hook after N tokens (to kill the worker serving it), and which decode worker is serving."""

import asyncio

import aiohttp

from pdserve.testkit.workers import WorkerProcess, stats_of


async def stream_ids(url: str, body: dict, after: int | None = None, on_tokens=None, logprobs: list | None = None):
    """Stream a completion with token ids; once `after` tokens arrived, await `on_tokens()`.
    Returns (token ids, finish reasons seen, usage, error events, saw [DONE]); each chunk's
    (token_logprobs, top_logprobs) pairs are appended to `logprobs` if given."""
    import json

    ids, finishes, usage, errors, done = [], [], None, [], False
    async with aiohttp.ClientSession() as session, \
            session.post(url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True,
                                                        "stream_options": {"include_usage": True}}) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[len("data: "):])
            if "error" in event:
                errors.append(event["error"])
            elif event.get("usage") and not event["choices"]:
                usage = event["usage"]
            else:
                choice = event["choices"][0]
                ids.extend(choice.get("token_ids") or [])
                if logprobs is not None and choice.get("logprobs"):
                    logprobs.extend(zip(choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"],
                                        strict=True))
                if choice.get("finish_reason"):
                    finishes.append(choice["finish_reason"])
            if on_tokens is not None and after is not None and len(ids) >= after:
                await on_tokens()
                on_tokens = None
    return ids, finishes, usage, errors, done


async def serving_worker(decode_workers) -> WorkerProcess:
    """The decode worker running the (only) request."""
    for _ in range(200):
        for worker in decode_workers:
            if worker.proc.poll() is None and (await stats_of(worker.address, "decode")).num_running:
                return worker
        await asyncio.sleep(0.01)
    raise AssertionError("no decode worker is running the request")
