"""The second KV tier, engine side: full prefix blocks' KV kept in a node-local store
(engine.kv_store, shared by the workers naming one directory) beyond the pool's life, and
loaded back into the pool when that beats recomputing them (docs/design.md, "Second KV tier").

- **Write-through.** Every block the block manager newly indexes at a commit (full, every
  token computed, referenced by the committing request, so its content is final) is copied
  out of the runner's cache on the engine thread and handed to the store, which writes it
  on its own thread; blocks the store holds already are skipped. Not write-on-evict: the
  pool evicts inside an allocation, when the block is about to be overwritten (no time to
  copy it out), and a crashed worker's blocks survive only if already written.
- **Load instead of recompute.** When the scheduler admits a waiting request, the chain of
  block hashes continues past the pool's cached prefix over the prompt (full blocks, never
  the last token) and the store says how many more leading blocks it holds. They are loaded
  when reading them (bytes / the store's measured read bandwidth) is predicted to take less
  than prefilling their tokens (`KVTier.prefill_seconds`), else recomputed; while either
  speed is unmeasured they are loaded, which measures the read. A block the store cannot
  give back (evicted meanwhile, corrupt) ends the load there: the request computes the rest.
- **Accounting.** Decisions by reason (`DECISIONS`), blocks written; the scheduler counts
  the tokens loaded (`Scheduler.num_tier_hit_tokens`) apart from the pool's hits, and
  counts them in the request's cached tokens.
- **Events.** Given the block manager's event log, the tier has it carry the store's
  changes (blocks this process's store wrote and evicted) and, in resets, the store's keys,
  so routers know which blocks the node's tier holds (engine.cache_events).

Threads: everything here runs on the engine thread (a step's scheduling and commits), or
between steps under the driver's lock (a KV connector admission commits its blocks).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pdserve.engine.block_hash import prefix_hashes
from pdserve.engine.cache_events import CacheEventLog
from pdserve.engine.kv_host import HostBlocks, row_view
from pdserve.engine.profile import Profile, prefill_seconds

DECISIONS = ("load", "recompute: slower", "load failed")  # the reasons counted, per request with blocks in the store
PREFILL_RATE_WEIGHT = 0.2  # the EWMA's weight of each new step's prompt tokens per second


class Store(Protocol):
    """What the tier uses of engine.kv_store.KVStore."""

    def put(self, key: bytes, payload: bytes | memoryview) -> bool: ...
    def contains(self, keys: Sequence[bytes]) -> int: ...
    def get(self, key: bytes) -> bytes | None: ...
    def read_bandwidth(self) -> float: ...
    def stats(self) -> dict[str, int | float]: ...
    # and, for an event log (CacheEventLog.attach_tier): root, watch_changes, drain_changes, keys


class BlockCopies(Protocol):
    """The runner's KV cache a block at a time (CacheBlocks); `block_bytes`: one block's payload."""

    block_bytes: int

    def read(self, blocks: Sequence[int], empty_row: Callable[[int], torch.Tensor] | None = None
             ) -> list[torch.Tensor]: ...
    def write(self, blocks: Sequence[int], rows: Sequence[torch.Tensor]) -> None: ...


class CacheBlocks:
    """The paged cache `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]` as one
    payload per block: its `[num_layers, 2, block_size, kv_heads, head_dim]` slice, raw bytes
    of the cache's dtype, as a 1-D uint8 CPU tensor (a row). Engine thread (or between steps) only."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self._cache = kv_cache
        layers, halves, _, *block = kv_cache.shape
        self._block_shape = (layers, halves, *block)
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()

    def read(self, blocks: Sequence[int], empty_row: Callable[[int], torch.Tensor] | None = None
             ) -> list[torch.Tensor]:
        """Copies of the blocks' KV, a row each: into rows `empty_row(block_bytes)` makes
        (pinned host memory: HostBlocks.empty_row) when given, else views of one host copy
        of them all."""
        index = torch.as_tensor(list(blocks), dtype=torch.long, device=self._cache.device)
        gathered = self._cache.index_select(2, index).movedim(2, 0).contiguous()
        flat = gathered.view(torch.uint8).reshape(len(blocks), -1)
        if empty_row is None:
            return list(flat.cpu())
        rows = [empty_row(self.block_bytes) for _ in blocks]
        for row, source in zip(rows, flat, strict=True):
            row.copy_(source)
        return rows

    def write(self, blocks: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
        """Put `rows` (each one block's, as `read` gives them) into `blocks`."""
        if self._cache.device.type == "cpu":
            data = torch.stack(list(rows))
        else:  # one copy per row, asynchronous from pinned rows
            data = torch.empty((len(rows), self.block_bytes), dtype=torch.uint8, device=self._cache.device)
            for target, row in zip(data, rows, strict=True):
                target.copy_(row, non_blocking=True)
        values = data.view(self._cache.dtype).view(len(blocks), *self._block_shape)
        index = torch.as_tensor(list(blocks), dtype=torch.long, device=self._cache.device)
        self._cache.index_copy_(2, index, values.movedim(0, 2))


def layout_directory(base: Path, salt: str, checkpoint: Path, block_size: int, kv_shape: Sequence[int]) -> Path:
    """The store's directory for one KV layout under `base`: named by a hash of the block
    hashes' salt (model, dtype), the checkpoint's files (name, size, mtime: one rewritten in
    place is a new layout), the block size and the cache's `(num_layers, kv_heads, head_dim)`,
    so blocks of different layouts never mix."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(checkpoint).iterdir() if p.is_file())
    key = repr((salt, files, block_size, tuple(kv_shape)))
    return Path(base) / hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class TierPlan:
    """The blocks after a request's pooled prefix that the tier holds (`keys`, a leading run
    of its block hashes; the first `num_host` of them in host memory, the rest in the node's
    store) and whether to load them (else they are recomputed)."""

    keys: list[bytes]
    load: bool
    num_host: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks to load."""
        return len(self.keys) if self.load else 0


class KVTier:
    """The tier's engine side (see the module docstring): `plan` and `apply` when a request
    is admitted, `write` at commits, `observe_prefill` after steps. `profile`: a latency
    profile (engine.profile) to predict prefill time with instead of the measured rate,
    where the engine's owner has one. `events`: the block manager's event log, to carry the
    store's changes and keys (named by the store's resolved directory). `host`: the level in
    this process's pinned memory in front of the store (engine.kv_host; GPU workers)."""

    def __init__(self, store: Store, cache: BlockCopies, block_size: int, root: bytes,
                 profile: Profile | None = None, events: CacheEventLog | None = None,
                 host: HostBlocks | None = None) -> None:
        if events is not None:
            events.attach_tier(store, str(Path(store.root).resolve()))
        self.store, self.cache, self.host = store, cache, host
        self.block_size, self.root = block_size, root
        self.profile = profile
        self.prefill_rate: float | None = None  # prompt tokens per second of steps computing prompts (EWMA)
        self.decisions = dict.fromkeys(DECISIONS, 0)
        self.num_blocks_written = 0  # blocks handed to the store (it may still drop some: its queue, its budget)

    def plan(self, token_ids: list[int], num_cached_blocks: int) -> TierPlan | None:
        """For a request whose tokens to reuse are `token_ids` (its last token excluded) and
        whose first `num_cached_blocks` full blocks the pool holds: the tier's leading run of
        the blocks after them (host memory first, then the store) and whether to load it;
        None when the tier holds none."""
        keys = prefix_hashes(token_ids, self.block_size, self.root)[num_cached_blocks:]
        in_host = self.host.leading(keys) if self.host is not None else 0
        held = in_host + (self.store.contains(keys[in_host:]) if len(keys) > in_host else 0)
        if not held:
            return None
        return TierPlan(keys[:held], self._load_is_faster(in_host, held - in_host), in_host)

    def apply(self, plan: TierPlan, blocks: Sequence[int]) -> int:
        """Carry out `plan` for a request now holding `blocks` after its pooled prefix: copy
        the planned blocks' KV from the tier into them, up to the first it cannot give back;
        count the decision. Returns how many blocks were loaded (the caller commits them and
        counts them computed)."""
        if not plan.load:
            self.decisions["recompute: slower"] += 1
            return 0
        # host memory's rows first (each now recently used), so keeping the store's rows there
        # drops rows of other requests before this one's
        held = [self.host.get(key) for key in plan.keys] if self.host is not None else [None] * len(plan.keys)
        rows = []
        for key, row in zip(plan.keys, held, strict=True):
            row = row if row is not None else self._row_from_store(key)
            if row is None:
                break
            rows.append(row)
        if rows:
            start = time.perf_counter()
            self.cache.write(blocks[:len(rows)], rows)
            if self.host is not None and plan.num_host >= len(rows):
                self.host.observe_load(len(rows) * self.cache.block_bytes, time.perf_counter() - start)
        self.decisions["load" if len(rows) == len(plan.keys) else "load failed"] += 1
        return len(rows)

    def write(self, stored: Sequence[tuple[int, bytes]]) -> None:
        """Write-through: hand the tier each (block, hash) the pool just indexed (host memory
        and the store), unless it holds that hash already. Never blocks on the disk and never
        raises for the store."""
        missing = [(block, key) for block, key in stored
                   if not (self.host is not None and key in self.host) and not self.store.contains([key])]
        if not missing:
            return
        empty_row = self.host.empty_row if self.host is not None else None
        rows = self.cache.read([block for block, _ in missing], empty_row)
        for (_, key), row in zip(missing, rows, strict=True):
            if self.host is not None:
                self.host.put(key, row)
            self.num_blocks_written += self.store.put(key, row_view(row))

    def load_fields(self) -> dict:
        """The tier's part of EngineLoad (engine.stats), but the hit tokens (the scheduler's)."""
        store = self.store.stats()
        if self.host is not None:
            store.update(self.host.stats())
        return dict(kv_tier_decisions=dict(self.decisions), kv_tier_blocks_written=self.num_blocks_written,
                    kv_tier_bytes=int(store.pop("bytes", 0)),
                    kv_tier_read_bandwidth=float(store.pop("read_bandwidth", 0.0)),
                    kv_tier_store={name: int(value) for name, value in store.items()})

    def observe_prefill(self, num_prompt_tokens: int, seconds: float) -> None:
        """Account a step that computed `num_prompt_tokens` prompt tokens in `seconds`."""
        if num_prompt_tokens > 0 and seconds > 0:
            rate = num_prompt_tokens / seconds
            old = self.prefill_rate
            self.prefill_rate = rate if old is None else old + PREFILL_RATE_WEIGHT * (rate - old)

    def prefill_seconds(self, num_tokens: int) -> float | None:
        """Predicted time to prefill `num_tokens` prompt tokens: the profile's model (as the
        decode worker's local-prefill decision predicts it), else the measured rate; None
        before any step computed a prompt."""
        if self.profile is not None:
            return prefill_seconds(self.profile, num_tokens)
        return num_tokens / self.prefill_rate if self.prefill_rate else None

    def _row_from_store(self, key: bytes) -> torch.Tensor | None:
        """The store's payload under `key` as a row (in host memory when there is a host
        level, which keeps it), or None (missing, refused, the wrong size)."""
        payload = self.store.get(key)
        if payload is None or len(payload) != self.cache.block_bytes:
            return None
        if self.host is None:
            return torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        row = self.host.empty_row(len(payload))
        row.numpy()[:] = memoryview(payload)
        self.host.put(key, row)
        return row

    def _load_is_faster(self, num_host: int, num_store: int) -> bool:
        """Whether reading `num_host` blocks from host memory and `num_store` from the store
        (each at its measured bandwidth) takes less than prefilling their tokens; True while
        a speed is unmeasured (loading measures the read)."""
        compute_s = self.prefill_seconds((num_host + num_store) * self.block_size)
        read_s = 0.0
        for count, bandwidth in ((num_host, self.host.read_bandwidth() if num_host else 0.0),
                                 (num_store, self.store.read_bandwidth() if num_store else 0.0)):
            if count:
                if bandwidth <= 0:
                    return True
                read_s += count * self.cache.block_bytes / bandwidth
        return compute_s is None or read_s < compute_s
