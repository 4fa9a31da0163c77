"""The second KV tier through the router's eyes, over real gRPC from real worker processes:
two decode workers on one node sharing a store directory, and a router registry following
both. A block the first worker wrote shows in the registry's tier index for the node, so the
second worker, which never computed it, matches the prompt in its node's tier (and the first
in its own cache). And through a real router: a turn whose blocks left a small pool is
served from the tier, reported cached and counted in /metrics as tier hits."""

from __future__ import annotations

import asyncio
import time

from pdserve.engine import LLM
from pdserve.router.cache_index import PromptKeys
from pdserve.router.registry import WorkerRegistry, static_source
from pdserve.testkit.workers import (
    SECURITY,
    RouterProcess,
    WorkerProcess,
    collect,
    decode_stub,
    generate_request,
    stats_of,
)
from tests.e2e.http import metric, post
from tests.e2e.test_prefix_usage import eventually

BLOCK = 16
PROMPT = list(range(1000, 1000 + 4 * BLOCK + 3))
REUSABLE = (len(PROMPT) - 1) // BLOCK * BLOCK  # whole blocks, never the last token


def on_node(source, node: str):
    """`source`'s members, each reported on `node` (as the controller reports them)."""
    async def members() -> list[dict]:
        return [{**member, "node": node} for member in await source()]
    return members


def test_a_block_one_worker_wrote_is_in_the_registrys_tier_index_for_both_workers_node(tiny_llama_dir, tmp_path):
    args = ("--kv-tier-enabled", "--kv-tier-directory", str(tmp_path), "--block-size", str(BLOCK),
            "--local-prefill-max-tokens", "4096")
    with WorkerProcess("decode", str(tiny_llama_dir), *args) as writer, \
            WorkerProcess("decode", str(tiny_llama_dir), *args) as other:

        async def scenario():
            source = on_node(static_source([], [writer.address, other.address], SECURITY), "node-1")
            registry = WorkerRegistry(source, SECURITY)
            await registry.start()
            try:
                views = {v.address: v for v in registry.workers("decode", routable=False)}
                ids = [views[writer.address].worker_id, views[other.address].worker_id]
                index = registry.cache_index
                while not all(index.tracks(i) for i in ids):
                    await asyncio.sleep(0.02)
                channel, stub = decode_stub(writer.address)
                async with channel:
                    await collect(stub, generate_request("write", PROMPT, 4, []))
                deadline = time.monotonic() + 20
                while True:  # the writer's store writes, then its next update reports them
                    pool, tier = index.matched_by_tier(ids, PromptKeys(PROMPT))
                    if tier[ids[1]] == REUSABLE or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.05)
                return ids, pool, tier, [index.tier_size(i) for i in ids], views[other.address].stats
            finally:
                await registry.stop()

        (writer_id, other_id), pool, tier, sizes, other_stats = asyncio.run(scenario())
    assert pool == {writer_id: REUSABLE, other_id: 0}  # only the writer computed the prompt
    assert tier == {writer_id: 0, other_id: REUSABLE}  # the other would load what the writer wrote
    assert sizes[0] == sizes[1] >= REUSABLE // BLOCK  # one tier for the node
    assert other_stats.prefix_cache_query_tokens == 0  # it never saw the prompt


def test_a_turn_whose_blocks_left_the_pool_is_served_from_the_tier_and_metrics_say_so(tiny_llama_dir, tmp_path):
    """Through the router: a session's second turn, after another prompt took every block of
    the worker's small pool, reports its prefix cached (loaded from the tier), and /metrics
    shows the tier's hits apart from the pool's."""
    model = str(tiny_llama_dir)
    per_block = LLM(model, block_size=BLOCK, dtype="float32", kv_cache_bytes=16 << 20,
                    max_model_len=8 * BLOCK).engine.runner.kv_cache[:, :, 0].nbytes
    args = ("--kv-tier-enabled", "--kv-tier-directory", str(tmp_path), "--block-size", str(BLOCK),
            "--dtype", "float32", "--max-model-len", str(8 * BLOCK), "--kv-cache-bytes", str(8 * per_block),
            "--local-prefill-max-tokens", "4096")
    turn = PROMPT[:40]  # two full blocks to reuse
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, "user": "session"}
    with WorkerProcess("decode", model, *args) as worker, RouterProcess(model, [], [worker.address]) as router:
        status, first, _ = post(f"{router.url}/v1/completions", {**body, "prompt": turn})
        assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        filler = list(range(3000, 3000 + 8 * BLOCK - 3))  # its prompt takes every block: the turn's leave the pool
        assert post(f"{router.url}/v1/completions", {**body, "prompt": filler, "user": "other"})[0] == 200
        stats = asyncio.run(wait_written(worker.address))
        status, second, _ = post(f"{router.url}/v1/completions", {**body, "prompt": turn})
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert status == 200 and cached == (len(turn) - 1) // BLOCK * BLOCK
        worker_hits = f'pdserve_worker_kv_tier_hit_tokens_total{{pool="decode",worker="{stats.worker_id}"}}'
        assert eventually(router.url, worker_hits, cached)
        assert eventually(router.url, 'pdserve_kv_tier_hit_tokens_total{pool="decode"}', cached)
        assert metric(router.url, 'pdserve_prefix_cache_hit_tokens_total{pool="decode"}') == 0  # none from the pool


async def wait_written(address: str, timeout_s: float = 20.0):
    """The worker's Stats once its tier's store has written everything queued."""
    deadline = time.monotonic() + timeout_s
    while (stats := await stats_of(address, "decode")).kv_tier_store["queued_bytes"] > 0:
        assert time.monotonic() < deadline, "the store never wrote its queue"
        await asyncio.sleep(0.05)
    return stats
