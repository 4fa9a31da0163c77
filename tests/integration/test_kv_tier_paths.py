"""The second KV tier on every serving path (docs/design.md, "Second KV tier"), over real
worker processes sharing one store directory as the workers of one node do, a tiny random
model, real gRPC and torch (gloo) KV transports and an in-process router: with the tier on,
as with it off, every path gives the tokens of the offline engine without it (greedy and
seeded), and with it on each path uses it:

- remote prefill, on either transport: a decode worker whose pool never saw the prompts
  another decode worker ran loads them from the tier into its reservation and is shipped
  only the rest, by a prefill worker that loads them too rather than computing them;
- local prefill: the blocks the tier holds count as held, so a prompt whose tail they leave
  short is prefilled on the decode worker itself (`local_prefill_max_tokens`), loading them;
- migration: a request whose decode worker leaves mid-stream resumes on another decode
  worker, which loads the prompt and the tokens generated so far from the tier.

In process: a reservation's claim stops at a block the store cannot give back."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.block_hash import prefix_hashes
from pdserve.protos import pdserve_pb2 as pb
from pdserve.testkit.models import VOCAB_SIZE
from pdserve.testkit.workers import SECURITY, WorkerProcess, collect, decode_stub, generate_request, prefill_stub
from tests.integration.test_disaggregation_faults import poll

BLOCK = 16
LENGTHS = (3 * BLOCK + 5, 2 * BLOCK, 4 * BLOCK + 1)  # a ragged tail; whole blocks (the last one computed); one past
KWARGS = dict(block_size=BLOCK, max_model_len=256, kv_cache_bytes=16 << 20)


def reusable(num_tokens: int) -> int:
    """The leading tokens of a prompt of `num_tokens` a cache may supply: whole blocks, never the last token."""
    return (num_tokens - 1) // BLOCK * BLOCK


@dataclass
class Cluster:
    tier: bool  # the workers run the tier, all on one directory
    p1: WorkerProcess
    p2: WorkerProcess
    d1: WorkerProcess  # decode workers prefilling every request remotely
    d2: WorkerProcess
    d3: WorkerProcess  # prefills a request itself when at most BLOCK of its prompt is not held


@pytest.fixture(scope="module", params=[False, True], ids=["tier-off", "tier-on"])
def cluster(request, tiny_llama_dir, tmp_path_factory):
    model, common = str(tiny_llama_dir), ("--block-size", str(BLOCK))
    if request.param:
        common += ("--kv-tier-enabled", "--kv-tier-directory", str(tmp_path_factory.mktemp("kv-tier")))
    with WorkerProcess("prefill", model, *common) as p1, WorkerProcess("prefill", model, *common) as p2, \
            WorkerProcess("decode", model, *common) as d1, WorkerProcess("decode", model, *common) as d2, \
            WorkerProcess("decode", model, *common, "--local-prefill-max-tokens", str(BLOCK)) as d3:
        yield Cluster(request.param, p1, p2, d1, d2, d3)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The offline engine without any cache: `reference(requests)` is the tokens each path must give."""
    llm = LLM(str(tiny_llama_dir), enable_prefix_caching=False, **KWARGS)

    def tokens(requests) -> list[list[int]]:
        params = [SamplingParams(ignore_eos=True, **{k: v for k, v in p.items() if v is not None}) for _, p in requests]
        return [o.token_ids for o in llm.generate([ids for ids, _ in requests], params)]
    return tokens


def workload(seed: int, sampled: bool) -> list[tuple[list[int], dict]]:
    """Prompts of LENGTHS no other test shares (`seed` apart), each with its sampling."""
    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB_SIZE) for _ in range(n)],
             dict(max_tokens=8, temperature=0.9 if sampled else 0.0, top_p=0.9 if sampled else 1.0,
                  seed=100 + i if sampled else None))
            for i, n in enumerate(LENGTHS)]


def settled(stats: pb.WorkerStats) -> bool:
    """Nothing in flight, every block free, and every block written through landed in the store."""
    return stats.num_free_blocks == stats.num_total_blocks and not stats.num_running and not stats.num_waiting \
        and not stats.num_waiting_for_kv and stats.kv_tier_store["queued_bytes"] == 0


async def settle(worker: WorkerProcess, until=settled) -> pb.WorkerStats:
    """Poll `worker`'s Stats until `until(stats)` (default: `settled`); the Stats that did."""
    channel, stub = (decode_stub if worker.role == "decode" else prefill_stub)(worker.address)
    async with channel:
        return await poll(stub, until)


def run(decode: WorkerProcess, requests, prefill: list[WorkerProcess], tag: str, transport: str = "torch",
        one_at_a_time: bool = False):
    """Run `requests` at once on `decode` (or, `one_at_a_time`, each after the last finished),
    offering it `prefill`; then wait until it and they settle. Returns ((tokens, finish,
    prefilled_by) per request, its Stats before, after)."""
    async def scenario():
        channel, stub = decode_stub(decode.address)
        async with channel:
            before = await stub.Stats(pb.StatsRequest())
            calls = [collect(stub, generate_request(f"{tag}-{i}", ids, prefill=[p.address for p in prefill],
                                                    transport=transport, **params))
                     for i, (ids, params) in enumerate(requests)]
            results = [await c for c in calls] if one_at_a_time else await asyncio.gather(*calls)
        after = await settle(decode)
        for worker in prefill:
            await settle(worker)
        return results, before, after
    return asyncio.run(scenario())


def gained(before: pb.WorkerStats, after: pb.WorkerStats, field: str) -> int:
    return getattr(after, field) - getattr(before, field)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("transport", ["torch", "grpc"])
def test_remote_prefill_computes_and_ships_only_what_the_tier_lacks(cluster, reference, transport, sampled):
    requests = workload(seed=2 * ["torch", "grpc"].index(transport) + sampled, sampled=sampled)
    expected = reference(requests)
    first, d1_before, d1_after = run(cluster.d1, requests, [cluster.p1], "first", transport)  # written through
    p2_before = asyncio.run(settle(cluster.p2))
    second, d2_before, d2_after = run(cluster.d2, requests, [cluster.p2], "second", transport)
    p2_after = asyncio.run(settle(cluster.p2))
    assert [r[0] for r in first] == [r[0] for r in second] == expected
    assert all(by not in ("", "local") and finish == "length" for _, finish, by in first + second)
    total = sum(LENGTHS)
    held = sum(map(reusable, LENGTHS)) if cluster.tier else 0  # nothing of it in either pool
    assert gained(d2_before, d2_after, "kv_tier_hit_tokens") == held  # loaded into the reservations
    assert gained(p2_before, p2_after, "kv_tier_hit_tokens") == held  # the prefill worker's own loads
    assert gained(p2_before, p2_after, "prefill_tokens_computed") == total - held
    # d1 was shipped every token (its pool and the tier held none of them): d2 only the rest
    shipped_first = gained(d1_before, d1_after, "kv_bytes_received")
    assert gained(d2_before, d2_after, "kv_bytes_received") * total == shipped_first * (total - held)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_tail_the_tier_leaves_short_is_prefilled_on_the_decode_worker(cluster, reference, sampled):
    requests = workload(seed=10 + sampled, sampled=sampled)
    run(cluster.d1, requests, [cluster.p1], "write")
    # one at a time: requests arriving together would see each other's prompts queued on d3,
    # and the pile-up rule (`_where_to_prefill`) would send the later ones to the prefill pool
    results, before, after = run(cluster.d3, requests, [cluster.p1], "local", one_at_a_time=True)
    assert [tokens for tokens, _, _ in results] == reference(requests)
    # what neither its pool nor its tier holds is at most BLOCK tokens only with the tier
    assert [by == "local" for _, _, by in results] == [cluster.tier] * len(requests)
    local = after.prefill_decisions["local/few_uncached_tokens"] - before.prefill_decisions["local/few_uncached_tokens"]
    assert local == (len(requests) if cluster.tier else 0)
    assert gained(before, after, "kv_tier_hit_tokens") == (sum(map(reusable, LENGTHS)) if cluster.tier else 0)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_a_migrated_request_resumes_from_what_the_tier_holds(cluster, reference, tiny_llama_dir, sampled):
    """A router (in process) streams the request from d1; once 3 tokens came and d1's blocks
    so far are in the store, d1 leaves the membership and d2 joins: the request resumes on
    d2 from the prompt plus the tokens sent, which d2 loads from the tier (whole blocks)."""
    from pdserve.router.cache_index import PromptKeys
    from pdserve.router.config import RouterConfig
    from pdserve.router.generation import Generation
    from pdserve.router.registry import WorkerRegistry
    from pdserve.router.state import Router

    [(prompt, params)] = workload(seed=20 + sampled, sampled=sampled)[:1]
    params = {**params, "max_tokens": 40}
    [expected] = reference([(prompt, params)])

    def member(role: str, worker: WorkerProcess) -> dict:
        return {"role": role, "worker_id": worker.address, "address": worker.address, "state": "ready"}
    members = [member("prefill", cluster.p1), member("decode", cluster.d1)]

    async def source():
        return list(members)

    async def scenario():
        config = RouterConfig(model=str(tiny_llama_dir), served_model_name="tiny", security=SECURITY,
                              max_migrations=1, migration_wait_s=30)
        router = Router(config, WorkerRegistry(source, SECURITY))
        await router.start()
        keys = PromptKeys(prompt)
        sampling = SamplingParams(ignore_eos=True, **{k: v for k, v in params.items() if v is not None})
        generation = Generation(router, f"migrate-{sampled}", keys, sampling, router.route_request(keys, None))
        received, before = [], None
        try:
            async for delta in generation.deltas():
                received.extend(delta.token_ids)
                if len(received) >= 3 and before is None:
                    await settle(cluster.d1, lambda stats: stats.kv_tier_store["queued_bytes"] == 0)  # still busy
                    before = await settle(cluster.d2)
                    members[1] = member("decode", cluster.d2)
                    await router.registry.refresh()  # d1 leaves (its stream is cancelled), d2 joins
        finally:
            await router.registry.stop()
        return received, generation.migrations, before, await settle(cluster.d2)

    received, migrations, before, after = asyncio.run(scenario())
    assert received == expected and migrations == 1
    resumed = gained(before, after, "prefix_cache_query_tokens")  # d2 looked up the resumed prompt
    assert resumed > len(prompt) and gained(before, after, "prefix_cache_hit_tokens") == 0
    assert gained(before, after, "kv_tier_hit_tokens") == (reusable(resumed) if cluster.tier else 0)


def test_a_reservations_claim_stops_at_a_block_the_store_cannot_give_back(tiny_llama_dir, tmp_path):
    """The decode worker's admission call in process: an engine whose pool never saw a prompt
    reserves it after another engine on the same store computed it, its third block's file
    corrupted. It claims (so a prefill worker ships from there) and commits the two blocks
    before that one only, loaded with the writer's KV; the blocks past them are left to fill."""
    tier = {"enabled": True, "directory": str(tmp_path)}
    prompt = workload(seed=30, sampled=False)[2][0]  # four full blocks and a token
    writer = LLM(str(tiny_llama_dir), kv_tier=tier, **KWARGS)
    writer.generate([prompt], SamplingParams(max_tokens=1))
    store = writer.engine.kv_tier.store
    store.flush()
    key = prefix_hashes(prompt, BLOCK, writer.engine.block_manager.root)[2]
    path = store.root / key.hex()[:2] / key.hex()  # the store's file of a block (engine.kv_store)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = LLM(str(tiny_llama_dir), kv_tier=tier, **KWARGS)
    try:
        side = reader.engine.kv_connector.scheduler_side
        assert side.cached_tokens(prompt) == reusable(len(prompt))  # the index holds all four: files read at load
        assert side.reserve("r", prompt) == 2 * BLOCK
        table, manager = side.block_table("r"), reader.engine.block_manager
        assert manager.cached_prefix(prompt[:-1]) == table[:2]
        written = writer.engine.block_manager.cached_prefix(prompt[:-1])[:2]
        loaded, computed = reader.engine.kv_tier.cache.read(table[:2]), writer.engine.kv_tier.cache.read(written)
        assert all(torch.equal(a, b) for a, b in zip(loaded, computed, strict=True))
        load = reader.engine.load()
        assert load.kv_tier_hit_tokens == 2 * BLOCK and load.prefix_cache_hit_tokens == 0
        assert load.kv_tier_decisions["load failed"] == 1
        side.release("r")
        manager.check_integrity()
    finally:
        store.close()
        reader.engine.kv_tier.store.close()
