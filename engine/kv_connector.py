"""The engine's KV connector: where KV computed by another engine comes in and KV computed
here goes out, in two roles (after vLLM V1's KV connector).

Scheduler side (`KVConnector.scheduler_side`), bookkeeping (tensors only as the tier
loads): say how much of a prompt this engine holds (its prefix cache, then its second KV
tier's blocks after that prefix, engine.kv_tier); reserve a prompt's blocks for KV that
will arrive from elsewhere (the cached prefix shared, the tier's blocks loaded into the
reservation, the admission headroom checked by the scheduler); admit the request once its
KV has landed; release a reservation never admitted. Also the prefix cache's identity and
its change log, for routers.

Worker side (`KVConnector.worker_side`), the paged KV cache as tensors: the cache a
receiver writes arriving KV into (only slots of blocks reserved on the scheduler side:
they are not scheduled until admitted), the KV of given blocks and positions, and a hook
that sees each layer of each newly computed chunk.

Threads: scheduler-side calls run between engine steps (a driver holds its lock); the
layer hook runs on the engine thread during a step, and `read` may be called from it.

The engine knows nothing of who moves the KV: no transport, RPC or process lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine.cache_events import CacheDelta  # what `cache_events` answers, part of this API

if TYPE_CHECKING:
    from pdserve.engine.kv_tier import TierPlan
    from pdserve.engine.model_runner import KVHook, ModelRunner
    from pdserve.engine.outputs import RequestOutput, TokenLogprob
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import Scheduler


def slot_mapping(block_table: Sequence[int] | np.ndarray, start: int, end: int, block_size: int) -> np.ndarray:
    """The cache slot (`block * block_size + offset`, int64) of each position in [start, end)
    of a request whose blocks, in position order, are `block_table`."""
    positions = np.arange(start, end, dtype=np.int64)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


class KVSchedulerSide:
    """Reservations for KV prefilled elsewhere, and prefix-cache facts. A reservation is
    open from `reserve` until `admit` or `release`; while open its blocks are the caller's
    to fill and the engine never schedules them."""

    def __init__(self, scheduler: Scheduler, admit_running: Callable[..., RequestOutput],
                 in_use: Callable[[str], bool], reserved: set[str]) -> None:
        self._scheduler, self._blocks = scheduler, scheduler.block_manager
        self._admit_running = admit_running  # the engine's: track a request whose prompt is computed
        self._in_use = in_use  # whether the engine tracks a request id
        self._reserved = reserved  # the open reservations' ids: the engine's, shared by every view

    @property
    def num_reserved(self) -> int:
        """Reservations open (not yet admitted or released)."""
        return len(self._reserved)

    def cached_tokens(self, prompt_token_ids: Sequence[int]) -> int:
        """How many leading prompt tokens `reserve` would find held here now: the prefix
        cache's blocks, then the blocks after them that the second KV tier holds when it
        would load them (engine.kv_tier's decision); whole blocks, always short of the last
        token, which must be computed to sample. Changes nothing."""
        prefix = self._cached_prefix(prompt_token_ids)
        plan = self._tier_plan(prompt_token_ids, len(prefix))
        return (len(prefix) + (plan.num_blocks if plan else 0)) * self._blocks.block_size

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int]) -> int | None:
        """Reserve blocks for the whole prompt of a request the engine does not run yet,
        starting with the cached blocks of its prefix (shared), then loading into the blocks
        after them what the second KV tier holds, when that beats computing it (engine.kv_tier:
        read here, synchronously, up to the first block the store cannot give back; loaded
        blocks are committed to the prefix cache and counted tier hits). Returns how many
        leading tokens the shared and loaded blocks hold (their KV need not arrive), or None,
        changing nothing, when the engine cannot take the request now
        (`Scheduler.can_take_prefilled`: its sequence cap and KV headroom, open reservations
        counted) or too few blocks are free. ValueError if the engine runs a request `request_id`."""
        num_tokens = len(prompt_token_ids)
        if not self._scheduler.can_take_prefilled(num_tokens, len(self._reserved)):
            return None
        if self._in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        prefix = self._cached_prefix(prompt_token_ids)
        if self._blocks.allocate_slots(request_id, num_tokens, prefix) is None:
            return None
        cached = len(prefix) * self._blocks.block_size
        self._scheduler.count_lookup(num_tokens, cached)
        self._reserved.add(request_id)
        return cached + self._load_from_tier(request_id, prompt_token_ids, len(prefix))

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_token: int,
              num_cached_tokens: int = 0, first_logprob: TokenLogprob | None = None,
              prompt_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """Admit a reserved request to the batch once its prompt KV is in its blocks and its
        first token is known (with that token's logprob when the request asked for logprobs,
        and its prompt's logprobs when it asked for those). `num_cached_tokens`: prompt
        tokens its prefill did not compute (found in a cache). Closes the reservation and
        returns the first token's output (finished if that token ends the request).
        ValueError, admitting nothing and keeping the reservation, when its blocks cannot
        hold the prompt or the logprobs are not exactly what the request asked for."""
        output = self._admit_running(request_id, prompt_token_ids, params, first_token, num_cached_tokens,
                                     first_logprob, prompt_logprobs)
        self._reserved.discard(request_id)
        return output

    def release(self, request_id: str) -> None:
        """Close a reservation and free its blocks (aborted, or prefilled here instead).
        Leaves a request the engine runs alone (its blocks are its own). Idempotent."""
        self._reserved.discard(request_id)
        if not self._in_use(request_id):
            self._blocks.free(request_id)

    def block_table(self, request_id: str) -> list[int]:
        """The blocks the request holds (reserved or running), in position order; empty if none."""
        return list(self._blocks.block_table(request_id))

    @property
    def prefix_caching(self) -> bool:
        """Whether the engine keeps a prefix cache (else `cached_tokens` is always 0)."""
        return self._blocks.enable_prefix_caching

    @property
    def cache_root(self) -> bytes:
        """The root of this engine's block hashes: engines that share it share cache keys."""
        return self._blocks.root

    def cache_events(self, cursor: int) -> CacheDelta:
        """Blocks indexed and evicted since `cursor` (engine.cache_events)."""
        return self._blocks.cache_events(cursor)

    def _cached_prefix(self, prompt_token_ids: Sequence[int]) -> list[int]:
        return self._blocks.cached_prefix(list(prompt_token_ids[:-1]))

    def _tier_plan(self, prompt_token_ids: Sequence[int], num_prefix_blocks: int) -> TierPlan | None:
        """What the tier holds of the prompt's full blocks past its pooled prefix (never the
        last token) and whether to load it; None without a tier or when it holds none."""
        tier = self._scheduler.tier
        return tier.plan(list(prompt_token_ids[:-1]), num_prefix_blocks) if tier is not None else None

    def _load_from_tier(self, request_id: str, prompt_token_ids: Sequence[int], num_prefix_blocks: int) -> int:
        """Carry out the tier's plan into the reservation's blocks after its pooled prefix,
        commit the blocks loaded (their content is final) and count them; the tokens loaded."""
        plan = self._tier_plan(prompt_token_ids, num_prefix_blocks)
        if plan is None:
            return 0
        block_size = self._blocks.block_size
        blocks = self._blocks.block_table(request_id)[num_prefix_blocks:]
        loaded = self._scheduler.tier.apply(plan, blocks) * block_size
        if loaded:  # the store holds them: nothing to write through
            self._blocks.commit(request_id, num_prefix_blocks * block_size + loaded,
                                lambda start, end: list(prompt_token_ids[start:end]))
            self._scheduler.num_tier_hit_tokens += loaded
        return loaded


class KVWorkerSide:
    """The paged KV cache, `[num_layers, 2 (K, V), num_blocks, block_size, kv_heads,
    head_dim]`; block ids from the scheduler side index its third axis."""

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner

    @property
    def cache_tensor(self) -> torch.Tensor:
        """The cache itself (not a copy): a receiver writes arriving KV into the slots of
        reserved blocks, and nowhere else."""
        return self._runner.kv_cache

    def read(self, block_table: Sequence[int], layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[end - start, kv_heads, head_dim]` of `layer` at positions [start, end)
        of a request holding `block_table` (copies, on the cache's device)."""
        cache = self._runner.kv_cache[layer]
        _, _, block_size, kv_heads, head_dim = cache.shape
        slots = torch.from_numpy(slot_mapping(block_table, start, end, block_size)).to(cache.device)
        k, v = (cache[half].view(-1, kv_heads, head_dim)[slots] for half in range(2))
        return k, v

    def set_layer_hook(self, hook: KVHook | None) -> None:
        """`hook(request_id, layer, token_start, k, v)` receives every scheduled chunk's new K
        and V (`[num_tokens, kv_heads, head_dim]`) per layer, on the engine thread, as soon as
        that layer is computed; it must copy what it keeps. None removes it."""
        self._runner.kv_hook = hook


@dataclass(frozen=True)
class KVConnector:
    """An engine's two KV connector roles."""

    scheduler_side: KVSchedulerSide
    worker_side: KVWorkerSide
