"""A hypothesis state machine over engine/kv_store.py on a real directory: blocks stored,
loaded, evicted by a budget that holds a few, wrecked as a crashed writer would leave them
(a temporary file, a file whose row never committed, a truncated or flipped file, a file
deleted by hand), and the store closed with or without its queue and reopened.

Keys are content addresses, as the engine's block hashes are: a key's payload is fixed (here
`payload(i)`, of a size that differs by key), so "the last payload stored for a key" is that
payload, and a load must return exactly it or None, never other bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from pdserve.engine.kv_store import HEADER, INDEX_NAME, TMP_SUFFIX, KVStore

KEYS = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(8)]
SIZES = [150 + 300 * i for i in range(len(KEYS))]
LARGEST_FILE = HEADER.size + 16 + max(SIZES)
BUDGETS = (LARGEST_FILE, 3 * LARGEST_FILE)  # one block of any size fits either; a few, only the larger
indices = st.integers(0, len(KEYS) - 1)


def payload(i: int) -> bytes:
    return hashlib.shake_256(KEYS[i]).digest(SIZES[i])


class StoreMachine(RuleBasedStateMachine):
    wrecked = Bundle("wrecked")  # keys a wreck touched: loads aim at them

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="kv-machine-")
        self.budget = BUDGETS[1]
        self.store = KVStore(self.tmp.name, self.budget)
        self.index = sqlite3.connect(self.store.root / INDEX_NAME, isolation_level=None, timeout=30)
        # keys that may have a row and a bad or missing file (so may miss), until a load or reopen
        self.damaged: set[int] = set()
        self.unindexed: set[str] = set()  # files the wreckage left without a row, until reopen
        self.queued: set[int] = set()  # keys put since the last flush

    def path(self, i: int) -> str:
        return os.path.join(self.store.root, KEYS[i].hex()[:2], KEYS[i].hex())

    def flush(self) -> None:
        assert self.store.flush()
        self.queued.clear()

    @rule(i=indices, flush=st.booleans())
    def store_block(self, i, flush):
        requeued = i in self.queued  # then the put only refreshes its use: it keeps its place in the queue
        assert self.store.put(KEYS[i], payload(i))
        self.queued.add(i)
        if flush:
            self.flush()
            if i not in self.damaged and not requeued:  # written last, it fits, so it is there
                assert self.store.get(KEYS[i]) == payload(i)

    @rule(i=indices)
    def load(self, i):
        self.check_load(i)

    @rule(i=wrecked)
    def load_wrecked(self, i):
        self.check_load(i)

    def check_load(self, i: int) -> None:
        got = self.store.get(KEYS[i])
        assert got is None or got == payload(i)  # a wrecked file served would fail this
        if i in self.damaged:  # (or it was rewritten since: a put after its row went)
            self.flush()  # the get had its row (and bad file) dropped
            self.damaged.discard(i)

    @rule(ids=st.lists(indices, max_size=6))
    def contains_agrees_with_loads(self, ids):
        self.flush()
        n = self.store.contains([KEYS[i] for i in ids])
        assert 0 <= n <= len(ids)
        for i in ids[:n]:
            if i not in self.damaged:
                assert self.store.get(KEYS[i]) == payload(i)
        if n < len(ids) and self.path(ids[n]) not in self.unindexed:
            assert self.store.get(KEYS[ids[n]]) is None

    @rule(target=wrecked, n=st.integers(0, len(KEYS) - 1),
          how=st.sampled_from(["truncate", "flip", "delete_file", "misplace", "drop_row", "leave_tmp"]))
    def wreck(self, n, how):
        """What a writer killed mid-way, a power loss or a hand leaves behind, on the n-th
        stored block (modulo how many there are)."""
        self.flush()
        if how == "leave_tmp":
            path = self.path(n)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + TMP_SUFFIX, "wb") as f:
                f.write(payload(n)[: SIZES[n] // 2])
            self.unindexed.add(path + TMP_SUFFIX)
            return n
        stored = [j for j in range(len(KEYS)) if os.path.exists(self.path(j))]
        if not stored:  # (the bundle grows whatever happens: what it holds may differ run to run, not its size)
            return n
        i = stored[n % len(stored)]
        path = self.path(i)
        if how == "misplace":  # another key's block, whole and valid, under this key's name
            other = stored[(n + 1) % len(stored)]
            if other == i:
                return i
            shutil.copyfile(self.path(other), path)
        elif how == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
        elif how == "flip":  # the last byte made wrong (set, not toggled: a second flip keeps it wrong)
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                f.write(bytes([payload(i)[-1] ^ 0xFF]))
        elif how == "delete_file":
            os.unlink(path)
        elif how == "drop_row":  # killed between its rename and its commit
            self.index.execute("DELETE FROM blocks WHERE key = ?", (KEYS[i],))
            self.unindexed.add(path)
            return i
        self.damaged.add(i)
        return i

    @rule(budget=st.sampled_from(BUDGETS), discard_queued=st.booleans())
    def reopen(self, budget, discard_queued):
        """A worker restarts: closed cleanly, or with what it had queued lost."""
        self.store.close(discard_queued=discard_queued)
        self.queued.clear()
        self.budget = budget
        self.store = KVStore(self.tmp.name, budget)
        rows, files = self.snapshot()
        assert {os.path.basename(p) for p in files} == {k.hex() for k in rows}  # swept both ways
        self.unindexed.clear()
        self.damaged = {i for i in self.damaged if os.path.exists(self.path(i))}

    def snapshot(self) -> tuple[dict[bytes, int], dict[str, int]]:
        """The index's rows and the files under the store, under the index's write lock (so
        no writer is midway)."""
        self.index.execute("BEGIN IMMEDIATE")
        try:
            rows = dict(self.index.execute("SELECT key, size FROM blocks"))
            total, count = self.index.execute("SELECT bytes, files FROM usage").fetchone()
            assert (total, count) == (sum(rows.values()), len(rows))
            files = {entry.path: entry.stat().st_size
                     for shard in os.scandir(self.store.root) if shard.is_dir()
                     for entry in os.scandir(shard.path)}
        finally:
            self.index.execute("COMMIT")
        return rows, files

    @invariant()
    def within_budget_and_never_degraded(self):
        assert self.store.state == "on", self.store.disabled_reason
        rows, files = self.snapshot()
        assert sum(rows.values()) <= self.budget
        for k, size in rows.items():  # so the indexed files on disk fit the budget, wreckage aside
            i = KEYS.index(k)
            assert i in self.damaged or files.get(self.path(i)) == size
        assert set(files) - {self.path(KEYS.index(k)) for k in rows} <= self.unindexed

    def teardown(self) -> None:
        self.store.close()
        self.index.close()
        self.tmp.cleanup()


StoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestStoreMachine = StoreMachine.TestCase
