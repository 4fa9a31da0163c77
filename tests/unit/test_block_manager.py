"""Block manager properties under random allocate / grow / free / preempt sequences."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdserve.engine.block_manager import BlockManager

NUM_BLOCKS, BLOCK_SIZE = 24, 4


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[str, int] = {}  # model: tokens each live request covers

    @rule(rid=st.sampled_from("abcdefgh"), num_tokens=st.integers(1, 60))
    def allocate(self, rid, num_tokens):
        before_free = self.bm.num_free_blocks
        before_table = list(self.bm.block_table(rid))
        new = self.bm.allocate_slots(rid, num_tokens)
        needed = max(0, -(-num_tokens // BLOCK_SIZE) - len(before_table))
        if needed > before_free:
            assert new is None
            assert self.bm.num_free_blocks == before_free
            assert self.bm.block_table(rid) == before_table
        else:
            assert new is not None and len(new) == needed
            assert self.bm.block_table(rid) == before_table + new
            self.tokens[rid] = max(self.tokens.get(rid, 0), num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_or_preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        held = len(self.bm.block_table(rid))
        before = self.bm.num_free_blocks
        assert self.bm.free(rid) == held
        assert self.bm.num_free_blocks == before + held
        del self.tokens[rid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def double_free_of_a_live_allocation_is_harmless(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        held = list(self.bm.block_table(rid))
        before = self.bm.num_free_blocks
        assert self.bm.free(rid) == len(held)
        assert self.bm.free(rid) == 0  # the second free finds nothing and returns nothing twice
        assert self.bm.num_free_blocks == before + len(held)  # returned once, not twice
        del self.tokens[rid]
        self.bm.check_integrity()  # no block is free twice, or free and owned

    @invariant()
    def integrity(self):
        self.bm.check_integrity()
        owned = sum(len(self.bm.block_table(r)) for r in self.tokens)
        assert owned + self.bm.num_free_blocks == NUM_BLOCKS
        for rid, n in self.tokens.items():
            assert len(self.bm.block_table(rid)) * BLOCK_SIZE >= n

    def teardown(self):
        for rid in list(self.tokens):
            self.bm.free(rid)
        assert self.bm.num_free_blocks == NUM_BLOCKS  # after any run, nothing leaked
        self.bm.check_integrity()


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_integrity_check_names_the_counts():
    bm = BlockManager(4, 2)
    bm.allocate_slots("a", 3)
    bm._free.append(bm.block_table("a")[0])  # corrupt: a block both free and owned
    with pytest.raises(AssertionError, match=r"in two of free / cached-evictable / in use; free 3"):
        bm.check_integrity()


def test_freeing_a_live_allocation_twice_returns_its_blocks_once():
    bm = BlockManager(8, 4)
    blocks = bm.allocate_slots("a", 10)
    assert len(blocks) == 3 and bm.num_free_blocks == 5
    assert bm.free("a") == 3 and bm.free("a") == 0
    assert bm.num_free_blocks == 8
    bm.check_integrity()
    assert bm.allocate_slots("b", 32) is not None  # all 8 blocks, each handed out once
    assert sorted(bm.block_table("b")) == list(range(8)) and bm.num_free_blocks == 0


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
