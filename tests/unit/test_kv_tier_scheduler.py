"""The second KV tier's engine side as bookkeeping (engine.kv_tier with the scheduler): no
model, no files. The store is a dict with KVStore's methods, the runner's cache a dict of
block id -> payload that a stand-in "forward" fills with each full block's tokens, so a
loaded block's content says which tokens it holds. Integration: tests/integration/test_kv_tier_engine.py."""

from array import array

import pytest
import torch

from pdserve.engine.block_hash import prefix_hashes, root_hash
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_tier import DECISIONS, KVTier
from pdserve.engine.profile import Profile, prefill_seconds
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

BLOCK = 4
ROOT = root_hash("test-model|float32")
PROMPT = list(range(100, 100 + 5 * BLOCK + 2))  # 5 full blocks and 2 tokens
FULL = (len(PROMPT) - 1) // BLOCK  # the full blocks a request may reuse (never its last token)


def payload_of(tokens: list[int]) -> bytes:
    """The stand-in KV of one block: its tokens."""
    return array("q", tokens).tobytes()


class DictStore:
    """KVStore's methods over a dict; `missing` keys are held but cannot be read back (as a
    corrupt or meanwhile evicted file); `bandwidth`: what read_bandwidth reports."""

    def __init__(self, bandwidth: float = 0.0) -> None:
        self.blobs: dict[bytes, bytes] = {}
        self.missing: set[bytes] = set()
        self.bandwidth = bandwidth
        self.puts = 0

    def put(self, key: bytes, payload: bytes) -> bool:
        self.puts += 1
        self.blobs[key] = payload
        return True

    def contains(self, keys) -> int:
        count = 0
        while count < len(keys) and keys[count] in self.blobs:
            count += 1
        return count

    def get(self, key: bytes) -> bytes | None:
        return None if key in self.missing else self.blobs.get(key)

    def read_bandwidth(self) -> float:
        return self.bandwidth


class DictCache:
    """The runner's cache, a payload per block id (rows in and out, as CacheBlocks); counts
    the blocks copied out."""

    block_bytes = len(payload_of([0] * BLOCK))

    def __init__(self) -> None:
        self.blocks: dict[int, bytes] = {}
        self.num_read = 0

    def read(self, blocks, empty_row=None):
        self.num_read += len(blocks)
        return [torch.frombuffer(bytearray(self.blocks[b]), dtype=torch.uint8) for b in blocks]

    def write(self, blocks, rows):
        self.blocks.update(zip(blocks, (row.numpy().tobytes() for row in rows), strict=True))


def make(store: DictStore, num_blocks: int = 32, budget: int = 64):
    manager = BlockManager(num_blocks, BLOCK, root=ROOT)
    scheduler = Scheduler(SchedulerConfig(8, budget, 256), manager)
    cache = DictCache()
    scheduler.tier = KVTier(store, cache, BLOCK, ROOT)
    return scheduler, manager, cache


def req(rid: str, prompt=PROMPT, max_tokens: int = 2, **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), seed=0)


def step(scheduler: Scheduler, cache: DictCache):
    """Schedule, "compute" (every block a chunk fills gets its tokens' payload), update."""
    out = scheduler.schedule()
    for chunk in out.chunks:
        request = scheduler.requests[chunk.request_id]
        end = chunk.start_pos + len(chunk.token_ids)
        for index in range(chunk.start_pos // BLOCK, end // BLOCK):
            cache.blocks[chunk.block_table[index]] = payload_of(request.token_slice(index * BLOCK, (index + 1) * BLOCK))
    scheduler.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    return out


def run(scheduler: Scheduler, cache: DictCache, request: Request):
    """Run `request` to the end; its first step's output."""
    scheduler.add_request(request)
    first = step(scheduler, cache)
    while scheduler.has_unfinished():
        step(scheduler, cache)
    return first


def filled_store(**kwargs) -> DictStore:
    """A store holding PROMPT's blocks, written through by another scheduler (a worker)."""
    store = DictStore(**kwargs)
    scheduler, _, cache = make(store)
    run(scheduler, cache, req("writer"))
    return store


def prompt_payloads(count: int) -> list[bytes]:
    """The stand-in KV of PROMPT's first `count` blocks."""
    return [payload_of(PROMPT[i * BLOCK:(i + 1) * BLOCK]) for i in range(count)]


def rates(tier: KVTier, read_blocks_per_s: float, prefill_blocks_per_s: float, store: DictStore) -> None:
    """Set the measured speeds: the store's read bandwidth and the tier's prefill rate."""
    store.bandwidth = read_blocks_per_s * tier.cache.block_bytes
    tier.prefill_rate = prefill_blocks_per_s * BLOCK


def test_every_committed_block_is_written_through_once_under_its_hash():
    store = filled_store()
    keys = prefix_hashes(PROMPT, BLOCK, ROOT)
    assert store.blobs == dict(zip(keys, prompt_payloads(len(keys)), strict=True))
    scheduler, _, cache = make(store)  # speeds unmeasured: it loads
    run(scheduler, cache, req("again"))
    assert scheduler.tier.decisions["load"] == 1
    assert store.puts == len(store.blobs) and scheduler.tier.num_blocks_written == 0  # held already: not copied
    assert cache.num_read == 0


@pytest.mark.parametrize(("read_blocks_per_s", "prefill_blocks_per_s", "decision"),
                         [(100, 1, "load"), (1, 100, "recompute: slower")])
def test_the_tiers_blocks_are_loaded_when_that_is_faster_else_recomputed(read_blocks_per_s, prefill_blocks_per_s,
                                                                          decision):
    store = filled_store()
    scheduler, manager, cache = make(store)
    rates(scheduler.tier, read_blocks_per_s, prefill_blocks_per_s, store)
    request = req("r")
    out = run(scheduler, cache, request)
    loaded = FULL * BLOCK if decision == "load" else 0
    assert out.chunks[0].start_pos == loaded  # joined with the loaded blocks computed
    assert request.num_cached_tokens == scheduler.num_tier_hit_tokens == loaded
    assert scheduler.num_cache_hit_tokens == 0
    assert scheduler.tier.decisions == {**dict.fromkeys(DECISIONS, 0), decision: 1}
    table = out.chunks[0].block_table
    assert [cache.blocks[b] for b in table[:FULL]] == prompt_payloads(FULL)  # loaded or computed: the prompt's KV
    manager.check_integrity()
    assert manager.cached_prefix(PROMPT) == table[:FULL]  # indexed in the pool
    assert manager.num_free_blocks == manager.num_blocks


def test_the_tier_continues_the_pools_prefix():
    store = filled_store()
    scheduler, _, cache = make(store)
    rates(scheduler.tier, read_blocks_per_s=100, prefill_blocks_per_s=1, store=store)
    run(scheduler, cache, req("short", PROMPT[:2 * BLOCK + 1]))  # the pool now holds 2 blocks
    pooled, tiered = scheduler.num_cache_hit_tokens, scheduler.num_tier_hit_tokens
    request = req("r")
    out = run(scheduler, cache, request)
    assert out.chunks[0].start_pos == FULL * BLOCK
    assert scheduler.num_cache_hit_tokens - pooled == 2 * BLOCK
    assert scheduler.num_tier_hit_tokens - tiered == (FULL - 2) * BLOCK
    assert request.num_cached_tokens == FULL * BLOCK


def test_a_block_the_store_cannot_give_back_ends_the_load_and_the_rest_is_recomputed():
    store = filled_store()
    keys = prefix_hashes(PROMPT, BLOCK, ROOT)
    store.missing.add(keys[2])
    scheduler, manager, cache = make(store, budget=BLOCK)  # one block's tokens a step
    request = req("r")
    scheduler.add_request(request)
    out = step(scheduler, cache)
    assert out.chunks[0].start_pos == 2 * BLOCK and len(out.chunks[0].token_ids) == BLOCK
    table = list(manager.block_table("r"))
    assert len(table) == FULL + 1  # allocated for the planned load and the chunk after it: computed into
    assert request.num_cached_tokens == 2 * BLOCK
    while scheduler.has_unfinished():
        step(scheduler, cache)
    assert [cache.blocks[b] for b in table[:FULL]] == prompt_payloads(FULL)
    assert scheduler.tier.decisions == {**dict.fromkeys(DECISIONS, 0), "load failed": 1}
    assert scheduler.num_tier_hit_tokens == 2 * BLOCK
    manager.check_integrity()
    assert manager.num_free_blocks == manager.num_blocks


def test_a_request_wanting_prompt_logprobs_loads_nothing():
    store = filled_store()
    scheduler, _, cache = make(store)
    out = run(scheduler, cache, req("r", prompt_logprobs=0))
    assert out.chunks[0].start_pos == 0 and scheduler.num_tier_hit_tokens == 0
    assert sum(scheduler.tier.decisions.values()) == 0


def test_a_store_without_the_prompts_first_block_makes_no_decision():
    store = filled_store()
    scheduler, _, cache = make(store)
    out = run(scheduler, cache, req("r", [1] + PROMPT[1:]))
    assert out.chunks[0].start_pos == 0 and sum(scheduler.tier.decisions.values()) == 0


def test_the_prefill_rate_is_an_ewma_of_steps_that_computed_prompts_and_a_profile_wins():
    tier = KVTier(DictStore(), DictCache(), BLOCK, ROOT)
    assert tier.prefill_seconds(BLOCK) is None
    tier.observe_prefill(100, 1.0)
    tier.observe_prefill(0, 5.0)  # a decode-only step says nothing of prefill
    assert tier.prefill_rate == 100
    tier.observe_prefill(300, 1.0)
    assert 100 < tier.prefill_rate < 300 and tier.prefill_seconds(50) == 50 / tier.prefill_rate
    profile = Profile("m", (0.01, 0.001, 0.0), (0.01, 0.0, 0.0), 1, 1.0, max_num_batched_tokens=32)
    tier.profile = profile
    assert tier.prefill_seconds(100) == prefill_seconds(profile, 100)
