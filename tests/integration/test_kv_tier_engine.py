"""The second KV tier through the real engine, a tiny random model and the real KVStore under
tmp_path: tokens with the tier equal tokens without it, blocks loaded from it included; a
block evicted from a small pool comes back from the tier; a restarted engine and an engine
beside another on the same directory find the blocks the other wrote; a corrupted block
file is refused and its block recomputed; two worker processes share it and report it."""

import asyncio

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.block_hash import prefix_hashes
from pdserve.engine.kv_host import HostBlocks
from pdserve.testkit.workers import WorkerProcess, collect, decode_stub, generate_request
from tests.integration.test_disaggregation_faults import poll

BLOCK = 16
SHARED = list(range(1000, 1000 + 3 * BLOCK))  # three full blocks shared by every prompt
PROMPTS = [
    SHARED + [5, 6, 7],
    SHARED,  # cached whole: its last block recomputed
    SHARED + list(range(2000, 2000 + BLOCK)),
    SHARED[:40] + [9] * 30,  # diverges inside the third block
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)
KWARGS = dict(max_model_len=256, block_size=BLOCK, kv_cache_bytes=16 << 20)


def reusable(prompt: list[int]) -> int:
    """The prompt tokens a cache may supply: whole blocks, never the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The same model without any cache: the tokens every run must give."""
    return LLM(str(tiny_llama_dir), enable_prefix_caching=False, **KWARGS)


@pytest.fixture
def tiered(tiny_llama_dir, tmp_path):
    """Make engines with the tier on, all on one store directory under tmp_path (their
    stores closed at the end: the writer threads stop)."""
    made = []

    def make(**overrides) -> LLM:
        made.append(LLM(str(tiny_llama_dir), kv_tier={"enabled": True, "directory": str(tmp_path)},
                        **{**KWARGS, **overrides}))
        return made[-1]
    yield make
    for llm in made:
        llm.engine.kv_tier.store.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_same_tokens_with_the_tier_and_a_restarted_engine_loads_what_it_wrote(reference, tiered, params):
    expected = tokens(reference.generate(PROMPTS, params))
    first = tiered()
    assert tokens(first.generate(PROMPTS, params)) == expected
    first.engine.kv_tier.store.close()  # the worker stops: what it queued is written
    restarted = tiered()  # an empty pool on the same directory
    outputs = restarted.generate(PROMPTS, params)
    assert tokens(outputs) == expected
    assert [o.num_cached_tokens for o in outputs] == [reusable(p) for p in PROMPTS]
    load = restarted.engine.load()
    assert load.kv_tier_hit_tokens >= reusable(PROMPTS[0])  # the pool started empty
    assert load.kv_tier_hit_tokens + load.prefix_cache_hit_tokens == sum(map(reusable, PROMPTS))
    assert load.kv_tier_decisions["load"] > 0 and load.kv_tier_decisions["load failed"] == 0
    assert load.kv_tier_blocks_written == 0  # everything it committed was in the store already
    restarted.engine.block_manager.check_integrity()


def test_a_block_evicted_from_a_small_pool_comes_back_from_the_tier(reference, tiered):
    per_block = reference.engine.runner.kv_cache[:, :, 0].nbytes
    small = tiered(max_model_len=8 * BLOCK, kv_cache_bytes=8 * per_block)  # 8 blocks: one long request fills them
    prompt = SHARED[:40]
    never_evicted = small.generate([prompt], GREEDY)[0]
    small.generate([list(range(3000, 3000 + 7 * BLOCK - 2))], GREEDY)  # 118 tokens: takes every block
    manager = small.engine.block_manager
    assert manager.cached_prefix(prompt) == []  # evicted from the pool
    small.engine.kv_tier.store.flush()
    before = small.engine.load()
    again = small.generate([prompt], GREEDY)[0]
    after = small.engine.load()
    assert again.token_ids == never_evicted.token_ids == tokens(reference.generate([prompt], GREEDY))[0]
    assert again.num_cached_tokens == reusable(prompt)
    assert after.kv_tier_hit_tokens - before.kv_tier_hit_tokens == reusable(prompt)
    assert after.prefix_cache_hit_tokens == before.prefix_cache_hit_tokens
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def test_two_engines_on_one_store_load_each_others_blocks(reference, tiered):
    one, two = tiered(), tiered()
    other = list(range(4000, 4000 + 3 * BLOCK + 5))  # nothing in common with PROMPTS[0]: no pool hits
    for writer, reader, prompt in ((one, two, PROMPTS[0]), (two, one, other)):
        written = writer.generate([prompt], SEEDED)[0]
        writer.engine.kv_tier.store.flush()
        before = reader.engine.load().kv_tier_hit_tokens
        read = reader.generate([prompt], SEEDED)[0]
        assert read.token_ids == written.token_ids == tokens(reference.generate([prompt], SEEDED))[0]
        assert read.num_cached_tokens == reusable(prompt)
        assert reader.engine.load().kv_tier_hit_tokens - before == reusable(prompt)


def test_a_corrupted_block_file_is_refused_and_the_rest_recomputed(reference, tiered):
    prompt = PROMPTS[2]  # four full blocks
    first = tiered()
    first.generate([prompt], GREEDY)
    store = first.engine.kv_tier.store
    store.flush()
    key = prefix_hashes(prompt, BLOCK, first.engine.block_manager.root)[1]
    path = store.root / key.hex()[:2] / key.hex()  # the store's file of a block (engine.kv_store)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one payload byte flipped
    path.write_bytes(bytes(data))
    second = tiered()
    output = second.generate([prompt], GREEDY)[0]
    assert output.token_ids == tokens(reference.generate([prompt], GREEDY))[0]
    assert output.num_cached_tokens == BLOCK  # the block before the bad one
    load = second.engine.load()
    assert load.kv_tier_decisions["load failed"] == 1 and load.kv_tier_store["corrupt"] == 1
    second.engine.block_manager.check_integrity()


def test_two_worker_processes_on_one_node_share_the_tier_and_report_it(tiny_llama_dir, tmp_path):
    """Real decode workers (processes) prefilling locally: the second loads what the first
    wrote, and each reports the tier in its Stats."""
    model, prompt = str(tiny_llama_dir), PROMPTS[2]
    tier = ("--kv-tier-enabled", "--kv-tier-directory", str(tmp_path), "--block-size", str(BLOCK))
    with WorkerProcess("decode", model, *tier) as one, WorkerProcess("decode", model, *tier) as two:

        async def scenario():
            reports = []
            for worker in (one, two):
                channel, stub = decode_stub(worker.address)
                async with channel:
                    tokens, _, _ = await collect(stub, generate_request(f"r-{len(reports)}", prompt, 8, []))
                    stats = await poll(stub, lambda s: s.kv_tier_store["queued_bytes"] == 0)  # its writes landed
                    reports.append((tokens, stats))
            return reports

        (tokens_one, wrote), (tokens_two, read) = asyncio.run(scenario())
    expected = tokens(LLM(model, **KWARGS).generate([prompt], GREEDY))[0]
    assert tokens_one == tokens_two == expected
    assert wrote.kv_tier_blocks_written == len(prompt + expected[:-1]) // BLOCK and wrote.kv_tier_bytes > 0
    assert read.kv_tier_hit_tokens == reusable(prompt) and read.kv_tier_decisions["load"] == 1
    assert read.prefix_cache_hit_tokens == 0 and read.kv_tier_store["hits"] == reusable(prompt) // BLOCK


def test_with_a_host_level_an_evicted_block_comes_back_from_host_memory(reference, tiered):
    """The level GPU workers keep in pinned memory (engine.kv_host), unpinned on this CPU engine."""
    per_block = reference.engine.runner.kv_cache[:, :, 0].nbytes
    small = tiered(max_model_len=8 * BLOCK, kv_cache_bytes=8 * per_block)
    tier = small.engine.kv_tier
    tier.host = HostBlocks(64 * per_block, pin=False)
    prompt = SHARED[:40]
    small.generate([prompt], GREEDY)
    small.generate([list(range(3000, 3000 + 7 * BLOCK - 2))], GREEDY)  # evicts the prompt from the pool
    assert small.engine.block_manager.cached_prefix(prompt) == []
    store_hits = tier.store.stats()["hits"]
    again = small.generate([prompt], GREEDY)[0]
    assert again.token_ids == tokens(reference.generate([prompt], GREEDY))[0]
    assert again.num_cached_tokens == reusable(prompt)
    assert tier.store.stats()["hits"] == store_hits and tier.host.stats()["host_hits"] == reusable(prompt) // BLOCK
    assert small.engine.load().kv_tier_store["host_blocks"] == tier.host.stats()["host_blocks"]


def test_a_decode_worker_with_a_latency_profile_predicts_the_tiers_prefill_by_it(tiny_llama_dir, tmp_path):
    from pdserve.decode_worker.service import DecodeService
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.profile import prefill_seconds
    from pdserve.engine.sim import DEFAULT_PROFILE
    from pdserve.testkit.workers import SECURITY
    from pdserve.worker_base.config import WorkerConfig

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), kv_tier={"directory": str(tmp_path)}, **KWARGS),
                       serving=True)  # the default: on in a serving worker
    service = DecodeService(engine, WorkerConfig(security=SECURITY, prefill_profile=str(DEFAULT_PROFILE)))
    try:
        assert engine.kv_tier is not None and engine.kv_tier.prefill_rate is None  # nothing measured yet
        assert engine.kv_tier.prefill_seconds(10 * BLOCK) == prefill_seconds(service.profile, 10 * BLOCK) > 0
    finally:
        asyncio.run(service.stop())
