"""Reuse reported the OpenAI way, through the router: a repeated prompt prefix shows up as
`usage.prompt_tokens_details.cached_tokens` (also in the streamed usage chunk) and in the
prefix-cache, prefill-decision and KV-byte metrics."""

import asyncio
import time

import aiohttp

from tests.e2e.http import metric, post, stream

SHARED = list(range(300, 300 + 64))  # four full blocks


def test_cached_tokens_in_usage_and_metrics(service):
    url = service["url"]
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    status, first, _ = post(f"{url}/v1/completions", {**body, "prompt": SHARED + [7, 8, 9]})
    assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, second, _ = post(f"{url}/v1/completions", {**body, "prompt": SHARED + [10, 11]})
    assert status == 200 and second["usage"]["prompt_tokens_details"]["cached_tokens"] == 64

    async def streamed():
        async with aiohttp.ClientSession() as session:
            return await stream(session, f"{url}/v1/completions", {
                **body, "prompt": SHARED + [12], "stream": True, "stream_options": {"include_usage": True}})

    events, done = asyncio.run(streamed())
    usage = [e["usage"] for e in events if e.get("usage")]
    assert done and usage and usage[-1]["prompt_tokens_details"]["cached_tokens"] == 64
    assert eventually(url, 'pdserve_prefix_cache_hit_tokens_total{pool="prefill"}', 128)
    assert eventually(url, 'pdserve_prefix_cache_hit_tokens_total{pool="decode"}', 128)
    assert eventually(url, 'pdserve_prefill_decisions_total{reason="many_uncached_tokens",where="remote"}', 3)
    assert eventually(url, 'pdserve_kv_transfer_bytes_total{pool="decode"}', 1)


def eventually(url: str, sample: str, at_least: float, timeout_s: float = 10.0) -> bool:
    """The router scrapes worker Stats every 0.25 s: wait for the counts to arrive."""
    deadline = time.monotonic() + timeout_s
    while metric(url, sample) < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"{sample} = {metric(url, sample)}, expected >= {at_least}")
        time.sleep(0.1)
    return True
