"""Prefix caching in the block manager and the scheduler, with no tensors: a model of what
each block physically holds checks that a cache hit always names a block that holds
exactly the tokens asked for (an evicted or reused block is never read), while requests
share, free, get evicted, preempted and aborted at random."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.block_hash import prefix_hashes, root_hash
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

NUM_BLOCKS, BS = 12, 4
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 13]  # overlapping prefixes


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, root=root_hash("test"))
        self.live: dict[str, list[int]] = {}  # request -> its tokens
        self.computed: dict[str, int] = {}
        self.holds: dict[int, tuple] = {}  # block -> the tokens physically written into it

    @rule(rid=st.sampled_from("abcdef"), base=st.sampled_from(BASES), extra=st.lists(st.integers(0, 3), max_size=6))
    def admit(self, rid, base, extra):
        if rid in self.live:
            return
        tokens = base + extra
        prefix = self.bm.cached_prefix(tokens[:-1])
        for i, block in enumerate(prefix):  # a hit names a block holding exactly those tokens
            assert self.holds.get(block) == tuple(tokens[i * BS : (i + 1) * BS])
        if self.bm.allocate_slots(rid, len(tokens), prefix) is None:
            return
        self.live[rid], self.computed[rid] = tokens, len(prefix) * BS

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, table = self.live[rid], self.bm.block_table(rid)
        end = min(len(tokens), self.computed[rid] + data.draw(st.integers(1, 8)))
        for pos in range(self.computed[rid], end):  # the model writes KV of these positions
            block = table[pos // BS]
            written = list(self.holds.get(block, ()))[: pos % BS] + [tokens[pos]]
            self.holds[block] = tuple(written)
        self.computed[rid] = end
        self.bm.commit(rid, end, lambda a, b: tokens[a:b])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_finish_abort_or_preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        held = len(self.bm.block_table(rid))
        assert self.bm.free(rid) == held
        del self.live[rid], self.computed[rid]

    @invariant()
    def integrity(self):
        self.bm.check_integrity()
        in_use = {b for rid in self.live for b in self.bm.block_table(rid)}
        assert len(in_use) + self.bm.num_free_blocks == NUM_BLOCKS

    def teardown(self):
        for rid in list(self.live):
            self.bm.free(rid)
        assert self.bm.num_free_blocks == NUM_BLOCKS
        self.bm.check_integrity()


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)


def test_freed_prefix_is_found_again_and_evicted_last_first():
    bm = BlockManager(4, BS, root=root_hash("m"))
    tokens = list(range(10))  # two full blocks and a partial one
    bm.allocate_slots("a", 10)
    bm.commit("a", 10, lambda a, b: tokens[a:b])
    first_two = bm.block_table("a")[:2]
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.cached_prefix(tokens) == first_two
    assert bm.cached_prefix([99] + tokens[1:]) == []  # a different first block: no hit at all
    bm.allocate_slots("b", 4 * BS - 2)  # needs all blocks: evicts the tail block first
    assert bm.num_cached_blocks == 0 and bm.cached_prefix(tokens) == []
    bm.check_integrity()


def test_hashes_are_chained_and_salted():
    tokens = list(range(12))
    assert prefix_hashes(tokens, BS, root_hash("m"))[1] != prefix_hashes([0, 0, 0, 0] + tokens[4:], BS,
                                                                          root_hash("m"))[1]
    assert prefix_hashes(tokens, BS, root_hash("m")) != prefix_hashes(tokens, BS, root_hash("other model"))
    assert len(prefix_hashes(tokens[:11], BS, root_hash("m"))) == 2  # only full blocks


def test_disabled_cache_never_hits():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    tokens = list(range(8))
    bm.allocate_slots("a", 8)
    bm.commit("a", 8, lambda a, b: tokens[a:b])
    bm.free("a")
    assert bm.cached_prefix(tokens) == [] and bm.num_cached_blocks == 0


def _scheduler(num_blocks=16, budget=64):
    bm = BlockManager(num_blocks, BS, root=root_hash("m"))
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256), bm), bm


def _run_to_end(sched, request, token=42):
    sched.add_request(request)
    scheduled_tokens = []
    while request.request_id in sched.requests:
        out = sched.schedule()
        scheduled_tokens.append(sum(len(c.token_ids) for c in out.chunks if c.request_id == request.request_id))
        sched.update(out, {c.request_id: token for c in out.chunks if c.sample})
    return scheduled_tokens


def _request(rid, prompt, max_tokens=3):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0)


@pytest.mark.parametrize(("prompt_len", "expected_cached"), [(13, 12), (12, 8), (9, 8), (3, 0)],
                         ids=["mid-block", "block-boundary-keeps-last-block", "one-past", "shorter-than-a-block"])
def test_second_request_computes_only_what_is_not_cached(prompt_len, expected_cached):
    sched, bm = _scheduler()
    prompt = list(range(100, 100 + prompt_len))
    _run_to_end(sched, _request("first", prompt))
    second = _request("second", prompt)
    steps = _run_to_end(sched, second)
    assert second.num_cached_tokens == expected_cached
    assert steps[0] == prompt_len - expected_cached  # the prefill computed only the rest
    assert sched.num_cache_hit_tokens == expected_cached and sched.num_cache_queries == 2
    bm.check_integrity()
    assert bm.num_free_blocks == 16


def test_next_turn_finds_the_previous_prompt_and_reply():
    sched, bm = _scheduler()
    turn1 = _request("t1", list(range(100, 110)), max_tokens=8)
    _run_to_end(sched, turn1)
    history = turn1.prompt_token_ids + turn1.output_token_ids  # 18 tokens: prompt and reply
    turn2 = _request("t2", history + [7, 7, 7])
    _run_to_end(sched, turn2)
    # the reply's last token was sampled, never computed: 17 computed tokens -> 4 full blocks
    assert turn2.num_cached_tokens == 16


def test_preempted_request_finds_its_own_blocks_again():
    sched, bm = _scheduler(num_blocks=6, budget=64)
    a = _request("a", list(range(100, 108)), max_tokens=12)
    b = _request("b", list(range(200, 208)), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    resumed_at = {}  # preempted request -> where its first chunk after preemption started
    while sched.requests:
        out = sched.schedule()
        for chunk in out.chunks:
            request = sched.requests[chunk.request_id]
            if request.num_preemptions and chunk.request_id not in resumed_at:
                resumed_at[chunk.request_id] = chunk.start_pos
        sched.update(out, {c.request_id: 1 for c in out.chunks if c.sample})
        bm.check_integrity()
    assert sched.num_preemptions >= 1 and resumed_at
    assert all(start > 0 and start % BS == 0 for start in resumed_at.values()), resumed_at
    assert bm.num_free_blocks == 6
