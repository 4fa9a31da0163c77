"""Iteration-level scheduling (Orca) with chunked prefill. Pure bookkeeping: no torch.

Every step the batch is rebuilt under a token budget (`max_num_batched_tokens`) and a
sequence cap (`max_num_seqs`). Running requests go first, in arrival order, each taking
the tokens it still has to compute (one for a decode, a chunk for a prompt); then waiting
requests join while budget, sequence slots and KV blocks last. When a running request
cannot get a block, the most recently admitted running request is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed later.

Prefix caching: a waiting request joins with its longest cached run of full blocks counted
as computed (always leaving its last token to compute, so there are logits to sample). A
preempted request finds its own blocks again the same way. After every step the blocks
that became full and computed are committed to the cache, so a finished request's prompt
and reply serve the next turn of its conversation.

Second KV tier (`tier`, engine.kv_tier, when the engine installs one): blocks committed are
written through to it, and a waiting request's blocks past its cached prefix that the tier
holds are loaded into the blocks after that prefix when it joins (when that beats recomputing
them), counted computed and cached like the prefix.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus, TokenHistory
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.guided import Guide
    from pdserve.engine.kv_tier import KVTier, TierPlan


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass
class ScheduledChunk:
    """Tokens [start_pos, start_pos + len(token_ids)) of one request, to compute this step."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool  # the chunk reaches the request's last token: sample the next one
    output_index: int  # the output position of the token sampled (if `sample`)
    seed: int
    sampling_params: SamplingParams
    history: TokenHistory | None = None  # when `sample` and the params adjust logits or have a guide
    guide: Guide | None = None  # the request's, when it has one (engine.guided)
    # when the request wants prompt logprobs: the prompt tokens its rows predict, row i's
    # being the token at start_pos + i + 1 (as many as the chunk has rows before the prompt ends)
    prompt_targets: list[int] | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_cache_queries = 0  # prompts looked up in the prefix cache
        self.num_cache_query_tokens = 0  # their tokens
        self.num_cache_hit_tokens = 0  # of which found cached
        self.tier: KVTier | None = None  # the second KV tier, installed by the engine (engine.kv_tier)
        self.num_tier_hit_tokens = 0  # prompt tokens loaded from the tier (not in num_cache_hit_tokens)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> RequestStatus | None:
        """Admit a request whose prompt KV is already in its blocks (prefilled elsewhere) and
        whose first output token is known. Returns its finished status if that token ends it."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)
        self.commit(request)
        status = request.check_stop(self.config.max_model_len)
        if status is not None:
            self.finish(request.request_id, status)
        return status

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def can_take_prefilled(self, num_prompt_tokens: int, num_reserved: int) -> bool:
        """The admission headroom for a request prefilled elsewhere, before its blocks are
        reserved: whether it fits under `max_num_seqs` with the requests here and the
        `num_reserved` others holding reservations, and whether its whole prompt's blocks
        still leave a free block per running request for its next token (waived when
        nothing else is in flight, so a prompt as large as the cache is not refused forever)."""
        busy = len(self.requests) + num_reserved
        needed = self.block_manager.blocks_for_tokens(num_prompt_tokens)
        headroom = self.block_manager.num_free_blocks - needed - len(self.running)
        return busy < self.config.max_num_seqs and (headroom >= 0 or busy == 0)

    def queued_prompt_tokens(self) -> int:
        """Tokens still to compute before requests reach decoding: every uncomputed token of
        a waiting request (a preempted one's output too), the rest of a running one's prompt."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + sum(
            r.num_prompt_tokens - r.num_computed_tokens for r in self.running
            if r.num_computed_tokens < r.num_prompt_tokens)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break  # `request` itself was preempted: nothing after it is left
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1
        while self.waiting and budget > 0 and not out.preempted_ids:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            prefix = self._cached_prefix(request)
            cached = len(prefix) * self.block_manager.block_size
            plan = self._tier_plan(request, len(prefix))
            reach = cached + (plan.num_blocks if plan else 0) * self.block_manager.block_size
            num_new = min(request.num_tokens - reach, budget)
            if self.block_manager.allocate_slots(request.request_id, reach + num_new, prefix) is None:
                break
            loaded = self._load_from_tier(request, plan, len(prefix))
            self._count_hit(request, cached, loaded)
            request.num_computed_tokens = cached + loaded
            self.commit(request)  # the loaded blocks (a plain prefix is committed already)
            # a load cut short leaves its blocks to compute into: reach + num_new covers the chunk
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return out

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Account for a step's computed tokens and sampled ids; return requests that finished."""
        finished = []
        for chunk in output.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += len(chunk.token_ids)
            self.commit(request)
            token = sampled.get(chunk.request_id)
            if token is None:
                continue
            request.output_token_ids.append(token)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish(request.request_id, status)
                finished.append(request)
        return finished

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop string, abort, ...): free its blocks, forget it. Idempotent."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.block_manager.free(request_id)
        return request

    def commit(self, request: Request) -> None:
        """Offer the request's newly full, computed blocks to the prefix cache (and write
        those it indexes through to the tier)."""
        stored = self.block_manager.commit(request.request_id, request.num_computed_tokens, request.token_slice)
        if stored and self.tier is not None:
            self.tier.write(stored)

    def _may_reuse(self, request: Request) -> bool:
        """Whether the request may start from cached KV: it holds no blocks yet, and does
        not need every prompt position computed (prompt logprobs)."""
        return not (request.num_computed_tokens or self.block_manager.block_table(request.request_id)
                    or request.needs_prompt_logprobs)

    def _cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks to start the request's table with: whole blocks of its tokens, short
        of its last token (which must be computed to sample from)."""
        if not self._may_reuse(request):
            return []
        return self.block_manager.cached_prefix(request.token_slice(0, request.num_tokens - 1))

    def _tier_plan(self, request: Request, num_prefix_blocks: int) -> TierPlan | None:
        """What the tier holds of the request's blocks past its cached prefix (the same
        tokens `_cached_prefix` may reuse), and whether to load it; None: nothing."""
        if self.tier is None or not self._may_reuse(request):
            return None
        return self.tier.plan(request.token_slice(0, request.num_tokens - 1), num_prefix_blocks)

    def _load_from_tier(self, request: Request, plan: TierPlan | None, num_prefix_blocks: int) -> int:
        """Carry out `plan` into the request's blocks after its prefix; the tokens loaded."""
        if plan is None:
            return 0
        blocks = self.block_manager.block_table(request.request_id)[num_prefix_blocks:]
        return self.tier.apply(plan, blocks) * self.block_manager.block_size

    def _count_hit(self, request: Request, cached: int, loaded: int) -> None:
        if request.num_preemptions == 0:
            pooled = min(cached, request.num_prompt_tokens)
            request.num_cached_tokens = min(cached + loaded, request.num_prompt_tokens)
            self.count_lookup(request.num_prompt_tokens, pooled)
            self.num_tier_hit_tokens += request.num_cached_tokens - pooled

    def count_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Account one prompt's prefix-cache lookup (for the hit rate in Stats)."""
        if self.block_manager.enable_prefix_caching:
            self.num_cache_queries += 1
            self.num_cache_query_tokens += num_prompt_tokens
            self.num_cache_hit_tokens += num_cached_tokens

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        needed = request.num_computed_tokens + num_new
        while self.block_manager.allocate_slots(request.request_id, needed) is None:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_slice(start, start + num_new),
            start_pos=start,
            block_table=list(self.block_manager.block_table(request.request_id)),
            sample=start + num_new == request.num_tokens,
            output_index=request.sampling_params.first_position + len(request.output_token_ids),
            seed=request.seed,
            sampling_params=request.sampling_params,
            history=request.history() if request.sampling_params.adjusts_logits or request.guide else None,
            guide=request.guide,
            prompt_targets=request.token_slice(start + 1, min(start + num_new + 1, request.num_prompt_tokens))
            if request.needs_prompt_logprobs else None,
        )
