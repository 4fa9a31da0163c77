"""KV block bookkeeping: block ids, a free list, and one block table per request.

No tensors here: a block id indexes the `num_blocks` axis of the KV cache. A block has at
most one owner (request) at a time. Allocation that cannot be satisfied returns None and
changes nothing; the caller decides whether to wait or preempt.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: list[str | None] = [None] * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in position order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` tokens.

        Returns the newly added block ids (possibly none), or None, changing nothing, when
        too few blocks are free.
        """
        table = self._tables.get(request_id)
        have = len(table) if table is not None else 0
        missing = self.blocks_for_tokens(num_tokens) - have
        if missing > len(self._free):
            return None
        if table is None:
            table = self._tables[request_id] = []
        new_blocks = [self._free.popleft() for _ in range(max(missing, 0))]
        for block in new_blocks:
            self._owner[block] = request_id
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> int:
        """Return all the request's blocks to the free list; returns how many. Idempotent."""
        table = self._tables.pop(request_id, [])
        for block in table:
            if self._owner[block] != request_id:
                raise RuntimeError(f"block {block} owned by {self._owner[block]!r}, not {request_id!r}")
            self._owner[block] = None
        self._free.extend(table)
        return len(table)

    def check_integrity(self) -> None:
        """Raise naming the counts if any block is lost, shared or double-freed."""
        in_tables = [b for table in self._tables.values() for b in table]
        free_set = set(self._free)
        problems = []
        if len(free_set) != len(self._free):
            problems.append(f"{len(self._free) - len(free_set)} duplicate(s) in the free list")
        if len(set(in_tables)) != len(in_tables):
            problems.append(f"{len(in_tables) - len(set(in_tables))} block(s) in two tables")
        if free_set & set(in_tables):
            problems.append(f"{len(free_set & set(in_tables))} block(s) both free and owned")
        if len(free_set | set(in_tables)) != self.num_blocks:
            problems.append(
                f"free {len(free_set)} + owned {len(set(in_tables))} != capacity {self.num_blocks}"
            )
        for request_id, table in self._tables.items():
            if any(self._owner[b] != request_id for b in table):
                problems.append(f"owner map disagrees with the table of {request_id!r}")
        if problems:
            raise AssertionError("block manager integrity: " + "; ".join(problems))
