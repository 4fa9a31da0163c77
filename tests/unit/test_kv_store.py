"""engine/kv_store.py: the node-local KV block store, on real files under tmp_path, with real
threads and real (spawned) processes; nothing stands in for the store, its index or the disk."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import shutil
import sqlite3
import threading
import time

import pytest

from pdserve.engine import kv_store
from pdserve.engine.kv_store import HEADER, INDEX_NAME, MAGIC, TMP_SUFFIX, KVStore

LOGGER = "pdserve.engine.kv_store"
PAYLOAD_BYTES = 1000


def key(i: int) -> bytes:
    """A 16-byte key, as the engine's chained block hashes are."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(i: int, size: int = PAYLOAD_BYTES) -> bytes:
    """Bytes that differ for every `i` (and every offset), so a mix-up cannot go unseen."""
    return hashlib.shake_256(i.to_bytes(8, "little")).digest(size)


def file_size(size: int = PAYLOAD_BYTES) -> int:
    """What a stored block of a `size`-byte payload occupies: header, 16-byte key, payload."""
    return HEADER.size + 16 + size


def block_path(store: KVStore, k: bytes):
    return store.root / k.hex()[:2] / k.hex()


def shard_files(store: KVStore) -> dict[str, int]:
    """Every file under the store's shard directories (blocks and temporary files), by path."""
    return {entry.path: entry.stat().st_size
            for shard in os.scandir(store.root) if shard.is_dir()
            for entry in os.scandir(shard.path)}


def indexed(store: KVStore) -> dict[bytes, int]:
    with sqlite3.connect(store.root / INDEX_NAME) as db:
        return dict(db.execute("SELECT key, size FROM blocks"))


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture
def open_store(tmp_path):
    """Opens stores on tmp_path/"kv" (each call another store object on the same directory)
    and closes them all at the end."""
    stores = []

    def make(budget: int = 100 * file_size(), directory=None, **kwargs) -> KVStore:
        store = KVStore(directory or tmp_path / "kv", budget, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_round_trip(open_store):
    store = open_store()
    assert store.state == "on" and store.enabled and store.disabled_reason is None
    buffer = bytearray(payload(1))
    assert store.put(key(1), buffer)
    buffer[:] = bytes(len(buffer))  # the caller reuses its buffer: the store copied it
    assert store.put(key(2), memoryview(payload(2)))
    assert store.flush()

    assert store.contains([key(1), key(2)]) == 2
    assert store.get(key(1)) == payload(1)
    assert store.get(key(2)) == payload(2)
    on_disk = block_path(store, key(1)).read_bytes()
    assert on_disk.startswith(MAGIC) and on_disk.endswith(payload(1)) and len(on_disk) == file_size()
    stats = store.stats()
    assert (stats["puts"], stats["written"], stats["hits"], stats["misses"]) == (2, 2, 2, 0)
    assert (stats["bytes"], stats["files"]) == (2 * file_size(), 2)


def test_contains_counts_the_leading_run(open_store):
    store = open_store(budget=200 * file_size())
    for i in (0, 1, 3):
        store.put(key(i), payload(i))
    assert store.flush()
    assert store.contains([key(0), key(1), key(2), key(3)]) == 2
    assert store.contains([key(2), key(0)]) == 0
    assert store.contains([]) == 0
    many = [key(i) for i in range(200)]  # more than one query's worth
    for i in range(4, 200):
        store.put(key(i), payload(i))
    assert store.flush()
    assert store.contains(many) == 2  # key(2) was never stored
    store.put(key(2), payload(2))
    assert store.flush()
    assert store.contains(many) == 200


def test_put_of_a_stored_or_queued_key_is_skipped(open_store):
    store = open_store()
    assert store.put(key(1), payload(1))
    assert store.put(key(1), payload(1))  # still queued: skipped at once
    assert store.flush()
    mtime = block_path(store, key(1)).stat().st_mtime_ns
    assert store.put(key(1), payload(1))  # stored: the writer skips it without writing
    assert store.flush()
    stats = store.stats()
    assert (stats["written"], stats["skipped"]) == (1, 2)
    assert block_path(store, key(1)).stat().st_mtime_ns == mtime


def test_invalid_keys_and_oversized_blocks_are_refused_without_raising(open_store):
    store = open_store(budget=3 * file_size())
    assert not store.put(b"", payload(0))
    assert not store.put(bytes(65), payload(0))
    assert not store.put(key(1), payload(1, size=3 * file_size()))  # larger than the whole budget
    assert store.get(b"") is None and store.get("not bytes") is None
    store.put(key(2), payload(2))
    assert store.flush()
    assert store.contains([key(2), "not bytes", key(2)]) == 1
    assert store.stats()["dropped"] == 3 and store.state == "on"


def test_lru_eviction_order_and_the_budget_under_many_puts(open_store):
    budget = 10 * file_size()
    store = open_store(budget=budget)
    sizes = [PAYLOAD_BYTES // 4 + (i * 397) % (2 * PAYLOAD_BYTES) for i in range(150)]
    for i, size in enumerate(sizes):
        assert store.put(key(i), payload(i, size))
        if i % 7 == 0:
            assert store.flush()
            assert sum(shard_files(store).values()) <= budget
    assert store.flush()

    # With puts only, LRU keeps the longest run of the latest puts that fits the budget.
    expected, total = set(), 0
    for i in reversed(range(len(sizes))):
        if total + file_size(sizes[i]) > budget:
            break
        expected.add(i)
        total += file_size(sizes[i])
    stored = {i for i in range(len(sizes)) if store.contains([key(i)])}
    assert stored == expected
    for i in expected:
        assert store.get(key(i)) == payload(i, sizes[i])
    files = shard_files(store)
    assert sum(files.values()) == total == store.stats()["bytes"] <= budget
    assert store.stats()["evicted"] == len(sizes) - len(expected)
    assert set(indexed(store)) == {key(i) for i in expected}


def test_get_refreshes_recency(open_store):
    store = open_store(budget=3 * file_size())
    for i in range(3):
        store.put(key(i), payload(i))
    assert store.flush()
    assert store.get(key(0)) == payload(0)  # 0 is now the most recently used; 1 the least
    store.put(key(3), payload(3))
    assert store.flush()
    assert [store.contains([key(i)]) for i in range(4)] == [1, 0, 1, 1]


def damage_flip(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))


def damage_truncate(path):
    os.truncate(path, path.stat().st_size - 100)


def damage_magic(path):
    data = bytearray(path.read_bytes())
    data[:4] = b"XXXX"
    path.write_bytes(bytes(data))


def damage_header_only(path):  # a power loss kept the first page of the file only
    os.truncate(path, HEADER.size)


@pytest.mark.parametrize("damage", [damage_flip, damage_truncate, damage_magic, damage_header_only])
def test_a_damaged_file_is_refused_counted_and_deleted(open_store, damage):
    store = open_store()
    store.put(key(1), payload(1))
    assert store.flush()
    path = block_path(store, key(1))
    damage(path)

    assert store.get(key(1)) is None
    assert store.flush()
    assert not path.exists() and store.contains([key(1)]) == 0
    stats = store.stats()
    assert (stats["corrupt"], stats["misses"], stats["hits"], stats["files"]) == (1, 1, 0, 0)
    assert store.put(key(1), payload(1)) and store.flush()
    assert store.get(key(1)) == payload(1)
    assert store.state == "on"


def test_a_file_under_another_keys_name_is_refused(open_store):
    store = open_store()
    store.put(key(1), payload(1))
    store.put(key(2), payload(2))
    assert store.flush()
    shutil.copyfile(block_path(store, key(1)), block_path(store, key(2)))  # whole, valid, misplaced
    assert store.get(key(2)) is None
    assert store.stats()["corrupt"] == 1
    assert store.get(key(1)) == payload(1)


def test_a_half_written_file_is_never_served_and_is_removed_at_open(open_store):
    store = open_store()
    store.put(key(1), payload(1))
    assert store.flush()
    store.close()
    # A writer died mid-write: its temporary file holds part of a block; no row, no final file.
    tmp = block_path(store, key(2)).with_name(key(2).hex() + TMP_SUFFIX)
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_bytes(block_path(store, key(1)).read_bytes()[: file_size() // 2])

    reopened = open_store()
    assert not tmp.exists() and reopened.stats()["swept"] == 1
    assert reopened.get(key(2)) is None
    assert reopened.put(key(2), payload(2)) and reopened.flush()
    assert reopened.get(key(2)) == payload(2) and reopened.get(key(1)) == payload(1)


def test_a_row_without_a_file_is_a_miss_and_the_row_goes(open_store):
    store = open_store()
    store.put(key(1), payload(1))
    assert store.flush()
    os.unlink(block_path(store, key(1)))  # deleted by hand

    assert store.contains([key(1)]) == 1  # the index alone still has it
    assert store.get(key(1)) is None
    assert store.flush()
    assert store.contains([key(1)]) == 0
    stats = store.stats()
    assert (stats["misses"], stats["corrupt"], stats["files"], stats["bytes"]) == (1, 0, 0, 0)


def test_a_file_without_a_row_is_removed_at_open(open_store):
    store = open_store()
    for i in range(3):
        store.put(key(i), payload(i))
    assert store.flush()
    store.close()
    with sqlite3.connect(store.root / INDEX_NAME) as db:  # a writer died between rename and commit
        db.execute("DELETE FROM blocks WHERE key = ?", (key(1),))

    reopened = open_store()
    assert not block_path(store, key(1)).exists() and reopened.stats()["swept"] == 1
    assert sum(shard_files(reopened).values()) == reopened.stats()["bytes"] == 2 * file_size()
    assert reopened.contains([key(0)]) == 1 and reopened.contains([key(1)]) == 0


def test_reopening_finds_the_blocks_written_before(open_store):
    store = open_store()
    for i in range(5):
        store.put(key(i), payload(i))
    store.close()  # close writes what is queued

    restarted = open_store()
    assert restarted.contains([key(i) for i in range(5)]) == 5
    assert all(restarted.get(key(i)) == payload(i) for i in range(5))
    assert restarted.stats()["swept"] == 0


def test_reopening_with_a_smaller_budget_evicts_to_it(open_store):
    store = open_store(budget=10 * file_size())
    for i in range(10):
        store.put(key(i), payload(i))
    store.close()
    smaller = open_store(budget=4 * file_size())
    assert smaller.stats()["bytes"] == sum(shard_files(smaller).values()) == 4 * file_size()
    assert [smaller.contains([key(i)]) for i in range(10)] == [0] * 6 + [1] * 4


def test_an_unusable_directory_gives_a_store_that_is_off(tmp_path, caplog):
    (tmp_path / "file").write_text("a regular file")  # as root, chmod would not stop writes; this does
    store = KVStore(tmp_path / "file" / "store", 10 * file_size())
    assert not store.enabled and store.state == "off"
    assert "Not a directory" in store.disabled_reason
    assert not store.put(key(1), payload(1))
    assert store.get(key(1)) is None and store.contains([key(1)]) == 0
    assert store.flush() and store.read_bandwidth() == 0.0
    stats = store.stats()
    assert (stats["dropped"], stats["misses"], stats["files"]) == (1, 1, 0)
    store.close()
    store.close()
    assert len(warnings_of(caplog)) == 1


def test_the_directory_removed_under_an_open_store_degrades_with_one_warning(tmp_path, open_store, caplog):
    store = open_store()
    store.put(key(1), payload(1))
    assert store.flush()
    shutil.rmtree(tmp_path / "kv")

    for i in range(2, 6):
        store.put(key(i), payload(i))
        store.flush()
    assert store.state != "on" and store.disabled_reason
    assert not store.put(key(9), payload(9))
    assert store.get(key(1)) is None and store.get(key(2)) is None
    store.contains([key(1)])
    store.stats()
    store.close()
    assert len(warnings_of(caplog)) == 1


RETRY_S = 2.0  # the store's retry_writes_s in the write-error test


def _fill_past_a_file_size_limit(directory: str) -> dict:
    """In a spawned process: store a block, then let the OS refuse writes past 256 KiB per
    file (RLIMIT_FSIZE: a real EFBIG, as a full disk gives ENOSPC) and store a 1 MiB block;
    then lift the limit (room again) and store one more after the retry interval."""
    import resource
    import signal

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(LOGGER).addHandler(handler)
    logging.getLogger(LOGGER).setLevel(logging.INFO)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    store = KVStore(directory, 100 << 20, retry_writes_s=RETRY_S)
    store.put(key(1), payload(1))
    store.flush()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, limit[1]))
    queued = store.put(key(2), payload(2, 1 << 20))
    flushed = store.flush()
    after = store.put(key(3), payload(3))
    result = {"queued": queued, "flushed": flushed, "state": store.state, "reason": store.disabled_reason,
              "after": after, "old_block_served": store.get(key(1)) == payload(1),
              "new_block": store.get(key(2)), "write_errors": store.stats()["write_errors"],
              "warnings": sum(r.levelno >= logging.WARNING for r in records)}
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    time.sleep(RETRY_S + 0.1)
    result["retried"] = store.put(key(4), payload(4)) and store.flush()
    result.update(state_after_retry=store.state, reason_after_retry=store.disabled_reason,
                  retried_block_served=store.get(key(4)) == payload(4), write_retries=store.stats()["write_retries"],
                  warnings_after_retry=sum(r.levelno >= logging.WARNING for r in records),
                  writes_again_logged=any("writes again" in r.getMessage() for r in records))
    store.close()
    return result


def test_a_write_error_makes_the_store_read_only_with_one_warning_until_a_retry_writes(tmp_path, open_store):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        result = pool.apply(_fill_past_a_file_size_limit, (str(tmp_path / "kv"),))
    assert result["queued"] and result["flushed"] and not result["after"]
    assert result["state"] == "read-only" and "File too large" in result["reason"]
    assert result["old_block_served"] and result["new_block"] is None
    assert result["write_errors"] == 1 and result["warnings"] == 1
    assert not [p for p in shard_files(open_store()) if p.endswith(TMP_SUFFIX)]  # the failed write's went
    assert result["retried"] and result["state_after_retry"] == "on" and result["reason_after_retry"] is None
    assert result["retried_block_served"] and result["write_retries"] == 1
    assert result["warnings_after_retry"] == 1 and result["writes_again_logged"]


def test_put_never_waits_for_a_stalled_writer(open_store):
    store = open_store(queue_bytes=5 * PAYLOAD_BYTES)
    assert store.flush()
    holder = sqlite3.connect(store.root / INDEX_NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's long transaction: the writer stalls
    results = []
    putter = threading.Thread(target=lambda: results.extend(store.put(key(i), payload(i)) for i in range(20)))
    putter.start()
    putter.join(timeout=5)  # well under the writer's 10 s busy timeout
    assert not putter.is_alive(), "put waited for the stalled writer"
    assert results == [True] * 5 + [False] * 15  # the queue holds 5 payloads; the rest are dropped
    assert store.stats()["dropped"] == 15 and not store.flush(timeout_s=0.1)
    holder.execute("COMMIT")
    assert store.flush()
    assert store.stats()["written"] == 5 and store.contains([key(i) for i in range(20)]) == 5
    holder.close()


def test_a_busy_index_drops_the_batch_and_the_store_stays_on(open_store, monkeypatch):
    monkeypatch.setattr(kv_store, "BUSY_TIMEOUT_S", 0.2)
    store = open_store()
    holder = sqlite3.connect(store.root / INDEX_NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    store.put(key(1), payload(1))
    assert store.flush()  # the writer gave up after its busy timeout
    holder.execute("COMMIT")
    stats = store.stats()
    assert (stats["write_errors"], stats["dropped"], stats["written"]) == (1, 1, 0)
    assert store.state == "on"
    assert store.put(key(1), payload(1)) and store.flush() and store.get(key(1)) == payload(1)
    holder.close()


def test_read_bandwidth_is_probed_first_then_measured_from_gets(open_store):
    store = open_store()
    assert store.stats()["read_bandwidth"] == 0.0  # stats never probes
    probed = store.read_bandwidth()
    assert probed > 0 and store.probe() == probed and store.stats()["read_bandwidth"] == probed
    assert not [e for e in os.scandir(store.root) if e.is_file() and e.name.endswith(TMP_SUFFIX)]

    other = open_store()
    other.put(key(1), payload(1))
    assert other.flush() and other.get(key(1)) == payload(1)
    measured = other.stats()["read_bandwidth"]
    assert measured > 0 and other.read_bandwidth() == measured  # from the get; no probe needed


def _share(directory: str, budget: int, read: list[int], write: range) -> tuple[list[bool], dict]:
    """In a spawned process: read blocks `read` (whether each came back right), then store
    blocks `write`; returns what was read and the store's stats."""
    store = KVStore(directory, budget)
    got = [store.get(key(i)) == payload(i) for i in read]
    for i in write:
        while not store.put(key(i), payload(i)) and store.writable:  # the queue is full: let the writer catch up
            store.flush()
    store.close()
    return got, store.stats()


def test_two_processes_share_blocks_and_one_budget(tmp_path, open_store):
    directory, budget = str(tmp_path / "kv"), 30 * file_size()
    store = open_store(budget=budget)
    for i in range(10):
        store.put(key(i), payload(i))
    assert store.flush()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        # Another process reads what this one wrote, and writes what this one then reads.
        assert pool.apply(_share, (directory, budget, list(range(10)), range(100, 110)))[0] == [True] * 10
        assert all(store.get(key(i)) == payload(i) for i in range(100, 110))

        # Two processes write 2000 blocks each at once; whenever the index's write lock is
        # free, the block files on disk fit the budget.
        runs = [pool.apply_async(_share, (directory, budget, [], range(start, start + 2000)))
                for start in (10_000, 20_000)]
        holder = sqlite3.connect(store.root / INDEX_NAME, isolation_level=None, timeout=30)
        samples = 0
        while not all(run.ready() for run in runs) or samples == 0:
            holder.execute("BEGIN IMMEDIATE")
            assert sum(shard_files(store).values()) <= budget
            holder.execute("COMMIT")
            samples += 1
            time.sleep(0.001)  # let the writers in
        assert all(run.get()[1]["written"] > 0 for run in runs)
        holder.close()
    files = shard_files(store)
    assert sum(files.values()) == store.stats()["bytes"] <= budget
    assert {os.path.basename(p) for p in files} == {k.hex() for k in indexed(store)}
    stored = [i for i in [*range(10_000, 12_000), *range(20_000, 22_000)] if store.contains([key(i)])]
    assert stored and all(store.get(key(i)) == payload(i) for i in stored)
