"""A node-local second KV tier: KV blocks evicted from a worker's paged cache, kept in files
that every worker process on the node shares, bounded in bytes, evicted least recently used.

    store = KVStore(f"{cache}/kv-tier/{layout_id}", budget_bytes=64 << 30)
    store.put(block_hash, kv_bytes)          # queued; one writer thread writes it
    n = store.contains(prompt_block_hashes)  # how many leading blocks the node holds
    kv = store.get(block_hash)               # the verified payload, or None

**Keys** are content addresses (the engine's chained block hashes, `engine/block_hash.py`):
a key names its payload, so a put of a key already stored (or queued) is skipped whatever
its payload. One directory must hold one layout only: the caller names the directory after
everything that shapes a payload (model, dtype, block size, layers, heads, head dim), since
the store checks bytes, not their meaning.

**Files.** Under `<directory>/v1/` (the file format's version, so another version of this
code never reads these files): `index.sqlite` (the index) and one file per block,
`<key hex[:2]>/<key hex>`: a 20-byte header (magic `PDKV`, format version, key length,
payload length, CRC-32 of key and payload), the key, the payload. A block is written to
`<key hex>.tmp` in its own directory and `os.replace`d into place, so a reader sees a whole
file or none; nothing is fsynced (a cache: the page cache holds hot blocks, and a block a
power loss tore is caught by its checksum). A file whose magic, version, key, length or
checksum is wrong is refused (get returns None), counted (`corrupt`) and deleted, never
served. CRC-32 and not BLAKE2b: the checksum guards against torn, truncated and bit-flipped
files, not against an attacker (whoever can write the directory can write the index too);
zlib's CRC-32 verifies a 360 KB block in ~50 us here, BLAKE2b in ~260 us, on every load.

**Index and budget.** The index (SQLite, WAL mode) has a row per block (key, file size,
last use) and the node-wide totals, kept by triggers. Every change to the set of block files
(write, eviction, deletion of a bad file, the sweep at open) happens inside a write
transaction of the index, so SQLite's write lock is the node-wide mutex and, whenever the
lock is free, a block file exists exactly when its row does. A put inserts its row, evicts
least recently used rows (unlinking their files) until the indexed bytes fit the budget,
then writes and renames its file, and commits: the sum of the sizes (header + key +
payload) of indexed block files never exceeds `budget_bytes` of the store that wrote last,
and the one temporary file in flight (one writer holds the lock at a time) is counted in
it. Not counted: the index itself (~100 bytes a block, plus a WAL of at most a few MiB),
a `probe()` scratch file while it runs, and what a crashed writer left (below). Stores
sharing a directory should be given the same budget. Recency is approximate across
processes: a get records its use in memory and the writer thread writes it to the index
with its next transaction (at most ~1 s later).

**Crashes.** Opening a store sweeps the directory under the write lock: temporary files (a
writer died mid-write), block files without a row (a writer died between its rename and its
commit; removed rather than adopted: adopting would need reading and verifying the file,
for one block per crash) and rows without a file (deleted by hand) go: ~2 us a file here
(100 ms for 50k files). A row whose file vanishes while the store is open is a miss, and the
get drops the row. A get reads the file without asking the index, so until the next open a
file a crash left without its row can still be served (whole and verified, or refused).

**Failures degrade, never raise.** No method raises (misuse aside: a payload that is no
buffer, a budget that is no number: TypeError). A directory that
cannot be used at construction gives a store with `enabled` False and the reason; an I/O
error while writing (ENOSPC, EIO, a removed directory) makes the store read-only (puts
dropped) for `retry_writes_s` (60 s), after which the next put tries again (a disk that
filled up may have room again); a broken index, or an I/O error while reading, turns it off
(gets miss), for good. A store logs ONE warning until writes work again (then one info
line), and `state` and `disabled_reason` say what and why. Lock
contention past the busy timeout (10 s) only drops that batch of puts (`write_errors`).

Thread-safety: every public method may be called from any thread of the process that made
the store; a store object is not shared across fork (each process opens its own, on the
same directory). Processes sharing a directory coordinate through the index only, which
needs a local filesystem (SQLite's WAL does not work over NFS).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sHHQI")  # magic, format version, key length, payload length, crc32(key + payload)
INDEX_NAME = "index.sqlite"
TMP_SUFFIX = ".tmp"
MAX_KEY_BYTES = 64  # the hex name (128 characters) plus TMP_SUFFIX fits any filesystem's NAME_MAX
BUSY_TIMEOUT_S = 10.0

_BATCH_OPS = 32  # queued operations one write transaction takes
_OP_BYTES = 64  # what a queued forget counts against queue_bytes
_MAX_TOUCHES = 1 << 16  # recorded uses awaiting the writer; more are not recorded
_TOUCH_INTERVAL_S = 1.0  # how long recorded uses wait for the writer when nothing is queued
_EWMA_ALPHA = 0.1
_PROBE_BYTES = 1 << 20
_PROBE_READS = 4
_CONTAINS_CHUNK = 64
_MAX_CHANGES = 1 << 16  # recorded changes awaiting drain_changes; past this they are lost (it says so)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS blocks (key BLOB PRIMARY KEY, size INTEGER NOT NULL,"
    " last_used INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS blocks_lru ON blocks (last_used)",
    "CREATE TABLE IF NOT EXISTS usage (id INTEGER PRIMARY KEY CHECK (id = 0), bytes INTEGER NOT NULL,"
    " files INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO usage VALUES (0, 0, 0)",
    "CREATE TRIGGER IF NOT EXISTS blocks_added AFTER INSERT ON blocks"
    " BEGIN UPDATE usage SET bytes = bytes + NEW.size, files = files + 1; END",
    "CREATE TRIGGER IF NOT EXISTS blocks_removed AFTER DELETE ON blocks"
    " BEGIN UPDATE usage SET bytes = bytes - OLD.size, files = files - 1; END",
)
_COUNTERS = ("puts", "written", "skipped", "dropped", "write_errors", "write_retries", "hits", "misses",
             "corrupt", "evicted", "swept")


class _Op(NamedTuple):
    """A queued operation for the writer thread. put: `data` and `stamp` (its use time);
    forget: `stamp` is the identity of a bad file to delete, None to drop a row whose file
    is gone; sync: neither (flush waits for it)."""

    kind: str
    key: bytes = b""
    data: bytes = b""
    stamp: object = None

    @property
    def queued_bytes(self) -> int:
        return len(self.data) if self.kind == "put" else _OP_BYTES if self.kind == "forget" else 0


class _Corrupt(Exception):
    def __init__(self, ident: tuple[int, int, int], why: str) -> None:
        super().__init__(why)
        self.ident = ident


def _valid_key(key: object) -> bool:
    return type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES


def _file_size(key: bytes, payload_len: int) -> int:
    return HEADER.size + len(key) + payload_len


def _header(key: bytes, data: bytes) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(data), zlib.crc32(data, zlib.crc32(key))) + key


def _read_block(path: str, key: bytes) -> bytes:
    """The payload of the block file at `path` if it is whole and names `key`; raises
    FileNotFoundError, _Corrupt (with the file's identity) or another OSError."""
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        head = f.read(HEADER.size + len(key))
        if len(head) < HEADER.size:
            raise _Corrupt(ident, "shorter than a header")
        magic, version, key_len, payload_len, crc = HEADER.unpack_from(head)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise _Corrupt(ident, f"bad magic or version {magic!r} {version}")
        if key_len != len(key) or head[HEADER.size:] != key:
            raise _Corrupt(ident, "another key")
        if st.st_size != _file_size(key, payload_len):
            raise _Corrupt(ident, f"{st.st_size} bytes, the header says {_file_size(key, payload_len)}")
        payload = f.read(payload_len)
        if len(payload) != payload_len or zlib.crc32(payload, zlib.crc32(key)) != crc:
            raise _Corrupt(ident, "checksum mismatch")
        return payload


def _is_busy(error: sqlite3.Error) -> bool:
    return (getattr(error, "sqlite_errorcode", 0) & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


@contextmanager
def _write_transaction(db: sqlite3.Connection) -> Iterator[None]:
    """The index's write lock, node-wide, for the block: commits on success, else rolls back."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        raise


class KVStore:
    """KV blocks in files under `directory`, shared by the node's processes (see the module
    docstring for the format, the budget and what failures do).

    Attributes: `enabled` (False: every get misses and every put is dropped), `writable`
    (False: puts are dropped; gets still read), `disabled_reason` (why the store went
    read-only or off; None while it is on), `root` (the directory holding the files).
    """

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, *, queue_bytes: int = 64 << 20,
                 retry_writes_s: float = 60.0) -> None:
        self.directory = Path(directory)
        self.retry_writes_s = retry_writes_s
        self._retry_writes_at: float | None = None  # read-only after a write error: when a put tries again
        self._warned = False  # a warning was logged since writes last worked
        self.root = self.directory / f"v{FORMAT_VERSION}"
        self.budget_bytes, self.queue_bytes = int(budget_bytes), int(queue_bytes)
        self.enabled = self.writable = False
        self.disabled_reason: str | None = None
        self._cond = threading.Condition()  # guards everything below but the two connections
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._queue: deque[_Op] = deque()
        self._queued_bytes = 0
        self._queued_keys: dict[bytes, int] = {}  # key of a queued or in-flight put -> its latest use
        self._touches: dict[bytes, int] = {}  # key -> last use, for the writer to record
        self._enqueued = self._done = 0  # operations queued / finished, ever
        self._clock = 0
        self._ewma_bytes = self._ewma_s = 0.0
        self._probed: float | None = None
        self._stopping = self._closed = False
        self._reader_lock = threading.Lock()  # guards self._reader (contains, stats)
        self._reader: sqlite3.Connection | None = None
        self._writer: sqlite3.Connection | None = None  # the writer thread's, once started
        self._thread: threading.Thread | None = None
        self._changes: deque[tuple[bytes, bool]] | None = None  # (key, written?) for drain_changes, once watched
        self._changes_lost = False
        try:
            if self.budget_bytes <= 0:
                raise ValueError(f"budget_bytes is {self.budget_bytes}")
            self._open()
        except (OSError, sqlite3.Error, ValueError) as e:
            self._close_connections()
            self._degrade("off", f"cannot open {self.root}: {e}")
            return
        self.enabled = self.writable = True
        self._thread = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self._thread.start()

    # -- public API --------------------------------------------------------------------

    @property
    def state(self) -> str:
        """"on", "read-only" (puts dropped) or "off" (also after close)."""
        return "on" if self.writable else "read-only" if self.enabled else "off"

    def put(self, key: bytes, payload: bytes | memoryview | bytearray) -> bool:
        """Queue `payload` to be stored under `key`; never waits on disk. True if the block is
        queued (by this call, or by an earlier one: then this call only makes it the most
        recently used, without moving it in the queue); False if dropped: the store is not writable,
        the queue (`queue_bytes`) is full, the block can never fit the budget, or the key is
        not 1..64 bytes. A buffer that is not `bytes` is copied before returning (a payload
        that is no buffer at all is the one misuse that raises: TypeError)."""
        data = payload if type(payload) is bytes else memoryview(payload).tobytes()
        with self._cond:
            self._counts["puts"] += 1
            if self._retry_writes_at is not None and time.monotonic() >= self._retry_writes_at:
                self._retry_writes_at, self.disabled_reason = None, None
                self.writable = self.enabled and not self._stopping
                self._counts["write_retries"] += 1
            if _valid_key(key) and key in self._queued_keys:  # skipped, but this is its latest use
                self._queued_keys[key] = self._tick()
                self._counts["skipped"] += 1
                return True
            if (not self.writable or self._stopping or not _valid_key(key)
                    or _file_size(key, len(data)) > self.budget_bytes
                    or self._queued_bytes + len(data) > self.queue_bytes):
                self._counts["dropped"] += 1
                return False
            self._queued_keys[key] = self._tick()
            self._enqueue(_Op("put", key, data, self._queued_keys[key]))
            return True

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the index holds (a leading run): one indexed
        query per 64 keys, no file is touched. A row whose file has gone counts until a get
        finds it gone."""
        found = 0
        try:
            with self._reader_lock:
                for start in range(0, len(keys), _CONTAINS_CHUNK):
                    if self._reader is None or not self.enabled:
                        return found
                    chunk = list(keys[start:start + _CONTAINS_CHUNK])
                    valid = [key for key in chunk if _valid_key(key)]
                    stored = {row[0] for row in self._reader.execute(
                        f"SELECT key FROM blocks WHERE key IN ({','.join('?' * len(valid))})", valid)}
                    for key in chunk:
                        if not _valid_key(key) or key not in stored:
                            return found
                        found += 1
        except sqlite3.Error as e:
            if not _is_busy(e):
                self._degrade("off", f"index unreadable: {e}")
        return found

    def keys(self) -> list[bytes]:
        """Every key the index holds, node-wide (one query; [] when the store is off)."""
        try:
            with self._reader_lock:
                if self._reader is None or not self.enabled:
                    return []
                return [key for (key,) in self._reader.execute("SELECT key FROM blocks")]
        except sqlite3.Error as e:
            if not _is_busy(e):
                self._degrade("off", f"index unreadable: {e}")
            return []

    def watch_changes(self) -> None:
        """Record, from now on, each change this store object makes to the index (blocks it
        writes, evicts or drops) for `drain_changes`. Other processes' stores record theirs."""
        with self._cond:
            if self._changes is None:
                self._changes = deque()

    def drain_changes(self) -> list[tuple[bytes, bool]] | None:
        """The changes recorded since the last call (`watch_changes`), oldest first, as
        (key, True: written | False: evicted or dropped), each once its transaction
        committed; None when more than 65536 piled up undrained and some were lost (the
        caller re-reads `keys()`). Any thread."""
        with self._cond:
            if self._changes is None:
                return []
            changes, lost = list(self._changes), self._changes_lost
            self._changes.clear()
            self._changes_lost = False
        return None if lost else changes

    def get(self, key: bytes) -> bytes | None:
        """The payload stored under `key`, verified against its header and checksum, or None:
        missing (a row without its file is dropped), corrupt (the file is deleted, counted
        in `corrupt`), or an I/O error (the store turns off). The file is read directly (no
        index query); its use is recorded for the LRU by the writer thread."""
        if not self.enabled or not _valid_key(key):
            self._count("misses")
            return None
        path = self._path(key)
        start = time.perf_counter()
        try:
            payload = _read_block(path, key)
        except FileNotFoundError:
            self._miss(key, None)
            return None
        except _Corrupt as e:
            logger.debug("KV store: refused %s: %s", path, e)
            self._count("corrupt")
            self._miss(key, e.ident)
            return None
        except OSError as e:
            self._count("misses")
            self._degrade("off", f"read of {path} failed: {e}")
            return None
        elapsed = time.perf_counter() - start
        with self._cond:
            self._counts["hits"] += 1
            weight = 1.0 if self._ewma_s == 0.0 else _EWMA_ALPHA  # the first read sets the average
            self._ewma_bytes += weight * (len(payload) - self._ewma_bytes)
            self._ewma_s += weight * (elapsed - self._ewma_s)
            if self.writable and (key in self._touches or len(self._touches) < _MAX_TOUCHES):
                self._touches[key] = self._tick()
        return payload

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every put queued before the call is written (or dropped, if the store
        degraded meanwhile) and recorded uses are in the index. False on timeout."""
        with self._cond:
            if self._thread is None or self._stopping:
                return True
            target = self._enqueue(_Op("sync"))
            return self._cond.wait_for(lambda: self._done >= target, timeout_s)

    def read_bandwidth(self) -> float:
        """Bytes/s of successful gets (open, read, verify; an exponentially weighted average
        of the bytes and the seconds of each), or `probe()`'s figure while nothing was read.
        0.0 while neither could be measured."""
        measured = self._measured_bandwidth()
        return measured if measured is not None else self.probe()

    def probe(self) -> float:
        """Measure read bandwidth once: write a 1 MiB scratch block beside the index, read it
        back 4 times through get's read-and-verify path, delete it. The first call measures
        (a few ms on the caller's thread), later ones return its figure; 0.0 if the store is
        not writable or the probe failed. The scratch file was just written, so this is the
        page cache's speed: an upper bound for blocks the page cache has dropped."""
        with self._cond:
            if self._probed is not None:
                return self._probed
        if not self.writable:
            return 0.0
        key = b"probe"
        data = bytes(range(256)) * (_PROBE_BYTES // 256)
        path = os.path.join(self.root, f"probe.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            with open(path, "wb") as f:
                f.write(_header(key, data))
                f.write(data)
            start = time.perf_counter()
            for _ in range(_PROBE_READS):
                _read_block(path, key)
            bandwidth = _PROBE_READS * len(data) / max(time.perf_counter() - start, 1e-9)
        except (OSError, _Corrupt) as e:
            logger.debug("KV store: probe failed: %s", e)
            return 0.0
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        with self._cond:
            self._probed = bandwidth
        return bandwidth

    def stats(self) -> dict[str, int | float]:
        """This store object's counters (puts, written, skipped, dropped, write_errors,
        write_retries, hits, misses, corrupt, evicted, swept: files removed at open), its
        state (`writable`, `enabled`: 1 or 0) and the node-wide `bytes` and `files` of the
        index, `budget_bytes`, `queued_bytes` and `read_bandwidth` (measured or probed; never
        probes)."""
        with self._cond:
            out: dict[str, int | float] = dict(self._counts)
            out["writable"], out["enabled"] = int(self.writable), int(self.enabled)
            out["queued_bytes"] = self._queued_bytes
            out["read_bandwidth"] = self._measured_bandwidth() or self._probed or 0.0
        out["bytes"] = out["files"] = 0
        try:
            with self._reader_lock:
                if self._reader is not None:
                    out["bytes"], out["files"] = self._reader.execute("SELECT bytes, files FROM usage").fetchone()
        except sqlite3.Error as e:
            if not _is_busy(e):
                self._degrade("off", f"index unreadable: {e}")
        out["budget_bytes"] = self.budget_bytes
        return out

    def close(self, *, discard_queued: bool = False) -> None:
        """Write what is queued (or, with `discard_queued`, drop it: counted in `dropped`),
        stop the writer thread and close the index; the store is then off. Idempotent. A
        store never closed loses what it queued when the process exits (its writer thread is
        a daemon), as a crash would."""
        with self._cond:
            if self._closed:
                return
            self._closed = self._stopping = True
            if discard_queued:  # (a batch the writer holds still completes)
                for op in self._queue:
                    self._queued_bytes -= op.queued_bytes
                    if op.kind == "put":
                        self._counts["dropped"] += 1
                        del self._queued_keys[op.key]
                self._done += len(self._queue)
                self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        self.enabled = self.writable = False
        self.disabled_reason = self.disabled_reason or "closed"
        self._close_connections()

    # -- the writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._stopping:
                    self._cond.wait(_TOUCH_INTERVAL_S)
                ops = [self._queue.popleft() for _ in range(min(len(self._queue), _BATCH_OPS))]
                ops = [op._replace(stamp=self._queued_keys[op.key]) if op.kind == "put" else op for op in ops]
                touches, self._touches = self._touches, {}
                last = self._stopping and not self._queue
            if ops or touches:
                self._apply(ops, touches)
            with self._cond:
                for op in ops:
                    self._queued_bytes -= op.queued_bytes
                    latest = self._queued_keys.pop(op.key, op.stamp) if op.kind == "put" else op.stamp
                    if latest != op.stamp:  # put again while being written: a use for the next batch
                        self._touches[op.key] = max(latest, self._touches.get(op.key, 0))
                self._done += len(ops)
                self._cond.notify_all()
            if last:
                return

    def _apply(self, ops: list[_Op], touches: dict[bytes, int]) -> None:
        """Run one batch in one write transaction. Errors degrade the store; never raises."""
        puts = [op for op in ops if op.kind == "put"]
        if not self.writable:
            self._count("dropped", len(puts))
            return
        headers = {op.key: _header(op.key, op.data) for op in puts}  # the CRCs, outside the lock
        counts = dict.fromkeys(("written", "skipped", "evicted"), 0)
        renamed: list[str] = []
        changes: list[tuple[bytes, bool]] = []  # (key, written?) in the transaction, for drain_changes
        try:
            with _write_transaction(self._writer):
                self._writer.executemany("UPDATE blocks SET last_used = max(last_used, ?) WHERE key = ?",
                                         [(stamp, key) for key, stamp in touches.items()])
                for op in ops:
                    if op.kind == "put":
                        self._write(op, headers[op.key], counts, renamed, changes)
                    elif op.kind == "forget":
                        self._forget(op.key, op.stamp, changes)
        except Exception as e:  # whatever failed, the batch is lost and the store degrades
            for path in renamed:  # their rows were rolled back: do not leave them unindexed
                try:
                    os.unlink(path)
                except OSError:
                    pass
            self._count("write_errors")
            self._count("dropped", len(puts))
            if isinstance(e, sqlite3.Error) and _is_busy(e):
                logger.debug("KV store: index busy, %d puts dropped: %s", len(puts), e)
            elif isinstance(e, OSError):
                self._degrade("read-only", f"write failed: {e}", retry=True)
            else:
                self._degrade("off", f"index failed: {e!r}")
            return
        with self._cond:
            for name, n in counts.items():
                self._counts[name] += n
            self._record(changes)
            recovered = self._warned and counts["written"] > 0 and self.writable
            if recovered:
                self._warned = False
        if recovered:
            logger.info("KV store %s writes again", self.root)

    def _write(self, op: _Op, header: bytes, counts: dict[str, int], renamed: list[str],
               changes: list[tuple[bytes, bool]]) -> None:
        """Inside the write transaction: skip a stored key (recording its use), else index
        it, evict to the budget and write its file; `changes` gains the evicted keys, then
        the written one."""
        db = self._writer
        if db.execute("SELECT 1 FROM blocks WHERE key = ?", (op.key,)).fetchone():
            db.execute("UPDATE blocks SET last_used = max(last_used, ?) WHERE key = ?", (op.stamp, op.key))
            counts["skipped"] += 1
            return
        db.execute("INSERT INTO blocks VALUES (?, ?, ?)", (op.key, len(header) + len(op.data), op.stamp))
        counts["evicted"] += self._evict(keep=op.key, changes=changes)
        path = self._path(op.key)
        tmp = path + TMP_SUFFIX
        try:
            try:
                f = open(tmp, "wb")
            except FileNotFoundError:  # the shard's first block (a removed root stays removed: no parents)
                try:
                    os.mkdir(os.path.dirname(tmp))
                except FileExistsError:
                    pass
                f = open(tmp, "wb")
            with f:
                f.write(header)
                f.write(op.data)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        renamed.append(path)
        counts["written"] += 1
        changes.append((op.key, True))

    def _evict(self, keep: bytes = b"", changes: list[tuple[bytes, bool]] | None = None) -> int:
        """Inside the write transaction: drop least recently used rows but `keep`, and their
        files, until the indexed bytes fit the budget (each appended to `changes` as
        (key, False)). Returns how many."""
        db, evicted = self._writer, 0
        while True:
            excess = db.execute("SELECT bytes FROM usage").fetchone()[0] - self.budget_bytes
            victims = [] if excess <= 0 else db.execute(
                "SELECT key, size FROM blocks WHERE key != ? ORDER BY last_used LIMIT 64", (keep,)).fetchall()
            if not victims:
                return evicted
            chosen = []
            for key, size in victims:
                chosen.append(key)
                excess -= size
                if excess <= 0:
                    break
            db.executemany("DELETE FROM blocks WHERE key = ?", [(key,) for key in chosen])
            if changes is not None:
                changes.extend((key, False) for key in chosen)
            for key in chosen:
                try:
                    os.unlink(self._path(key))
                except FileNotFoundError:
                    pass
            evicted += len(chosen)

    def _forget(self, key: bytes, ident: tuple[int, int, int] | None, changes: list[tuple[bytes, bool]]) -> None:
        """Inside the write transaction: drop `key`'s row if its file is gone, or delete the
        file and the row if it is still the bad file a get saw (`ident`); `changes` gains
        (key, False) if a row went."""
        path = self._path(key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            dropped = self._writer.execute("DELETE FROM blocks WHERE key = ?", (key,)).rowcount
        else:
            if ident is None or (st.st_ino, st.st_size, st.st_mtime_ns) != ident:
                return
            os.unlink(path)
            dropped = self._writer.execute("DELETE FROM blocks WHERE key = ?", (key,)).rowcount
        if dropped:
            changes.append((key, False))

    # -- opening -----------------------------------------------------------------------

    def _open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)  # shard directories come with their first block
        self._writer = self._connect()
        if self._writer.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() != "wal":
            raise sqlite3.OperationalError("the index cannot use WAL mode")
        with _write_transaction(self._writer):
            for statement in _SCHEMA:
                self._writer.execute(statement)
            self._sweep()
        self._reader = self._connect()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.root / INDEX_NAME, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                             check_same_thread=False)
        db.execute("PRAGMA synchronous = NORMAL")  # a WAL commit survives a crash of the process
        db.execute(f"PRAGMA journal_size_limit = {8 << 20}")
        return db

    def _sweep(self) -> None:
        """Inside the write transaction at open: remove temporary files and files without a
        row, drop rows without a file, evict to this store's budget."""
        db = self._writer
        indexed = {key for (key,) in db.execute("SELECT key FROM blocks")}
        present, removed, shards = set(), 0, []
        for entry in os.scandir(self.root):
            if entry.is_dir(follow_symlinks=False):
                shards.append(entry.path)
            elif entry.name.endswith(TMP_SUFFIX):  # a probe's scratch file
                os.unlink(entry.path)
                removed += 1
        for shard in shards:
            for entry in os.scandir(shard):
                if entry.is_dir(follow_symlinks=False):  # not ours to remove
                    continue
                try:
                    key = bytes.fromhex(entry.name)
                except ValueError:
                    key = None
                if key in indexed and entry.path == self._path(key):
                    present.add(key)
                else:
                    os.unlink(entry.path)
                    removed += 1
        db.executemany("DELETE FROM blocks WHERE key = ?", [(key,) for key in indexed - present])
        evicted = self._evict()
        with self._cond:
            self._counts["swept"] += removed
            self._counts["evicted"] += evicted

    # -- helpers -----------------------------------------------------------------------

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.root, name[:2], name)

    def _tick(self) -> int:
        """A use time for the LRU: wall-clock ns (comparable across the node's processes),
        strictly increasing within this store. Call with self._cond held."""
        self._clock = max(time.time_ns(), self._clock + 1)
        return self._clock

    def _enqueue(self, op: _Op) -> int:
        """Queue `op` (self._cond held) and return its sequence number for flush."""
        self._queue.append(op)
        self._queued_bytes += op.queued_bytes
        self._enqueued += 1
        self._cond.notify_all()
        return self._enqueued

    def _miss(self, key: bytes, ident: tuple[int, int, int] | None) -> None:
        """Count a miss and have the writer drop the key's row, and its file if bad."""
        with self._cond:
            self._counts["misses"] += 1
            if self.writable and not self._stopping and self._queued_bytes + _OP_BYTES <= self.queue_bytes:
                self._enqueue(_Op("forget", key, stamp=ident))

    def _record(self, changes: list[tuple[bytes, bool]]) -> None:
        """Keep a committed transaction's changes for drain_changes, if watched (self._cond
        held); past _MAX_CHANGES undrained, drop them all and say so."""
        if self._changes is None or not changes:
            return
        self._changes.extend(changes)
        if len(self._changes) > _MAX_CHANGES:
            self._changes.clear()
            self._changes_lost = True

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:
            self._counts[name] += n

    def _measured_bandwidth(self) -> float | None:
        with self._cond:
            return self._ewma_bytes / self._ewma_s if self._ewma_s > 0 else None

    def _degrade(self, state: str, reason: str, *, retry: bool = False) -> None:
        """Go read-only or off: back on only by a put `retry_writes_s` after a read-only
        `retry` (a write error), never from off. The first call since writes last worked logs
        a warning; the reason it gives stays in `disabled_reason`."""
        with self._cond:
            first = not self._warned
            self._warned = True
            if self.disabled_reason is None:
                self.disabled_reason = reason
            self.writable = False
            if state == "off":
                self.enabled = False
            self._retry_writes_at = time.monotonic() + self.retry_writes_s if retry and self.enabled else None
        if first:
            logger.warning("KV store %s is %s: %s", self.root, self.state, reason)
        else:
            logger.debug("KV store %s is %s: %s", self.root, self.state, reason)

    def _close_connections(self) -> None:
        with self._reader_lock:
            for db in (self._reader, self._writer):
                if db is not None:
                    try:
                        db.close()
                    except sqlite3.Error:
                        pass
            self._reader = self._writer = None
