"""One continuous-batching engine: requests in, token and text deltas out, a step at a time."""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from pdserve.engine.block_hash import root_hash
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import KV_TIER_DIR_ENV, KV_TIER_DIRNAME, EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.guided import GuideFactory
from pdserve.engine.kv_connector import KVConnector, KVSchedulerSide, KVWorkerSide
from pdserve.engine.kv_host import HostBlocks
from pdserve.engine.kv_store import KVStore
from pdserve.engine.kv_tier import CacheBlocks, KVTier, layout_directory
from pdserve.engine.loader import load_model, num_kv_blocks
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.model_source import cache_dir
from pdserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.stats import EngineLoad
from pdserve.engine.step_log import StepShape
from pdserve.engine.tokenizer import check_prompt_length, check_token_ids, encode_prompt

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None


class LLMEngine:
    """Public API: requests (`add_request`, `abort_request`, `step`, ...), the KV connector
    (`kv_connector`: KV that crosses the engine's edge), and load facts (`load`,
    `num_waiting`, `num_running`). `kv_tier`: the second KV tier (engine.kv_tier) or None.
    `scheduler`, `block_manager` and `runner` are internal."""

    def __init__(self, config: EngineConfig, *, serving: bool = False) -> None:
        """`serving`: this engine is a worker's (the second KV tier's default, EngineConfig.kv_tier_on)."""
        self.config = config
        self.loaded = load_model(config)
        num_blocks = num_kv_blocks(config, self.loaded)
        salt = f"{config.model}|{self.loaded.model.dtype}"  # what the KV of a token run depends on
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          root_hash(salt))
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            self.loaded.max_model_len),
            self.block_manager,
        )
        self.runner = self._make_runner(num_blocks)
        self.kv_tier = self._make_kv_tier(salt) if config.kv_tier_on(serving) else None  # the second KV tier
        self.scheduler.tier = self.kv_tier
        self._tracked: dict[str, _Tracked] = {}
        self._reserved: set[str] = set()  # requests whose blocks await KV from elsewhere (kv_connector)
        # the last step scheduled nothing although requests wait: every block they could take
        # is held by a reservation (KV arriving from elsewhere), so steps make no progress
        # until one is admitted or released (engine.async_engine waits for that)
        self.blocked = False
        self._seed_source = random.Random(config.seed)
        self.last_step_sequences = 0  # requests the last step computed tokens of
        self.last_step_shape = StepShape()  # what the last step computed (the latency model's terms)
        self.num_prefill_tokens_computed = 0  # prompt positions computed (chunked prefill)
        self.num_decode_tokens_computed = 0  # positions of generated tokens computed

    def _make_runner(self, num_blocks: int) -> ModelRunner:
        """The model's runner, or for `model: sim` the simulated one (engine.sim), which reads
        the tokens of the requests it runs from the scheduler's record."""
        if not self.config.is_sim:
            return ModelRunner(self.loaded.model, num_blocks, self.config.block_size)
        from pdserve.engine.sim import SimRunner

        requests = self.scheduler.requests
        return SimRunner(self.loaded.model, num_blocks, self.config.block_size, self.config.sim,
                         lambda request_id, start, end: requests[request_id].token_slice(start, end))

    def _make_kv_tier(self, salt: str) -> KVTier | None:
        """The second KV tier (engine.kv_tier) on a store in this KV layout's directory under
        `kv_tier.directory`; None, logged, when the store cannot run there."""
        settings, shape = self.config.kv_tier, self.loaded.shape
        base = Path(settings.directory or os.environ.get(KV_TIER_DIR_ENV) or cache_dir() / KV_TIER_DIRNAME)
        directory = layout_directory(base, salt, self.loaded.model_dir, self.config.block_size,
                                     (shape.num_layers, shape.num_kv_heads, shape.head_dim))
        store = KVStore(directory, settings.budget_bytes)
        if not store.enabled:
            logger.warning("the second KV tier is off: its store in %s cannot run (%s)", directory,
                           store.disabled_reason)
            store.close()
            return None
        cache = self.runner.kv_cache
        host = (HostBlocks(settings.host_bytes, pin=True)
                if cache.device.type == "cuda" and settings.host_bytes > 0 else None)
        return KVTier(store, CacheBlocks(cache), self.config.block_size, self.block_manager.root,
                      events=self.block_manager.events, host=host)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @cached_property
    def _guides(self) -> GuideFactory:
        """Made at the first structured-output request: a simulated engine's tokenizer is
        loaded at its first use (engine.loader.LoadedModel)."""
        return GuideFactory(self.loaded.tokenizer, self.loaded.shape.vocab_size)

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def kv_connector(self) -> KVConnector:
        """The KV connector: a view over the engine's state, made on each access. The engine
        holds no reference to it: a cycle through its bound methods kept a dropped engine
        (model, KV cache) alive until interpreter shutdown, where destroying it aborted
        `pdserve profile` about half the time (tests/unit/test_engine_api.py)."""
        return KVConnector(
            KVSchedulerSide(self.scheduler, self._add_prefilled_request, self._tracked.__contains__, self._reserved),
            KVWorkerSide(self.runner),
        )

    @property
    def vocab_size(self) -> int:
        return self.loaded.shape.vocab_size

    @property
    def num_waiting(self) -> int:
        """Requests queued for a batch slot (preempted ones too)."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        """Requests in the batch."""
        return len(self.scheduler.running)

    def load(self) -> EngineLoad:
        """What this engine holds and has done, for load reports; read it between steps."""
        scheduler, cache = self.scheduler, self.block_manager
        return EngineLoad(
            num_waiting=self.num_waiting, num_running=self.num_running,
            queued_prompt_tokens=scheduler.queued_prompt_tokens(),
            running_tokens=sum(r.num_tokens for r in scheduler.running),
            num_free_blocks=cache.num_free_blocks, num_total_blocks=cache.num_blocks,
            num_cached_blocks=cache.num_cached_blocks, num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.num_cache_queries,
            prefix_cache_query_tokens=scheduler.num_cache_query_tokens,
            prefix_cache_hit_tokens=scheduler.num_cache_hit_tokens,
            prefill_tokens_computed=self.num_prefill_tokens_computed,
            decode_tokens_computed=self.num_decode_tokens_computed,
            kv_tier_hit_tokens=scheduler.num_tier_hit_tokens,
            **(self.kv_tier.load_fields() if self.kv_tier is not None else {}),
        )

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens its requests have yet to compute (EngineLoad.queued_prompt_tokens)."""
        return self.scheduler.queued_prompt_tokens()

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, detokenize: bool = True) -> Request:
        """Validate and queue a request; raises ValueError naming what is wrong."""
        request = self._make_request(request_id, prompt, params)
        self.scheduler.add_request(request)
        self._track(request, prompt, detokenize)
        return request

    def _add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                               first_token: int, num_cached_tokens: int = 0,
                               first_logprob: TokenLogprob | None = None,
                               prompt_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """`KVSchedulerSide.admit`'s work on the engine's side (see its contract): the
        request's prompt KV is in the blocks reserved under `request_id`."""
        if (params.logprobs is not None) != (first_logprob is not None):
            raise ValueError(f"request {request_id!r}: the first token's logprob must come exactly when "
                             f"the request asks for logprobs (logprobs={params.logprobs})")
        if (params.prompt_logprobs is not None) != (prompt_logprobs is not None):
            raise ValueError(f"request {request_id!r}: prompt logprobs must come exactly when the request asks "
                             f"for them (prompt_logprobs={params.prompt_logprobs})")
        request = self._make_request(request_id, prompt_token_ids, params)
        request.num_cached_tokens = num_cached_tokens
        request.prompt_logprobs = list(prompt_logprobs or [])
        if len(self.block_manager.block_table(request_id)) * self.config.block_size < request.num_prompt_tokens:
            raise ValueError(f"request {request_id!r} has no blocks reserved for its prompt")
        request.output_token_ids.append(first_token)
        tracked = self._track(request, prompt_token_ids, detokenize=False)
        self.scheduler.add_running(request)
        return self._after_token(tracked, first_token, first_logprob)

    def _make_request(self, request_id: str, prompt: str | list[int],
                      params: SamplingParams | None) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.vocab_size
        # token ids need no tokenizer (a simulated worker's is loaded only at its first use)
        ids = encode_prompt(self.tokenizer if isinstance(prompt, str) else None, prompt, vocab)
        check_prompt_length(len(ids), self.max_model_len)
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad_stop}")
        bad_bias = [t for t, _ in params.logit_bias if t >= vocab]
        if bad_bias:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got {bad_bias}")
        if params.first_position > len(ids):
            raise ValueError(f"first_position {params.first_position} exceeds the prompt's {len(ids)} tokens")
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        guide = self._guides.new(params.json_schema) if params.json_schema is not None else None
        return Request(request_id, ids, params, seed, self.loaded.eos_token_ids, guide=guide)

    def _track(self, request: Request, prompt, detokenize: bool) -> _Tracked:
        detok = None
        if detokenize and self.tokenizer is not None:
            params = request.sampling_params
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.stop,
                                           params.skip_special_tokens)
        tracked = _Tracked(request, prompt if isinstance(prompt, str) else None, detok)
        self._tracked[request.request_id] = tracked
        return tracked

    def check_prompt_ids(self, ids) -> list[int]:
        """A prompt of token ids from elsewhere (the wire) as a list; ValueError naming what
        is wrong with it: empty, an id outside the vocabulary, too long for max_model_len."""
        ids = check_token_ids(ids, self.vocab_size)
        check_prompt_length(len(ids), self.max_model_len)
        return ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; frees its blocks. Unknown ids are ignored."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED)
        return self._output(tracked, [], "")

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for every request that produced a token."""
        scheduled = self.scheduler.schedule()
        self.blocked = scheduled.is_empty and self.scheduler.has_unfinished()
        if self.blocked:
            if not self._reserved:
                raise RuntimeError("scheduler made no progress with requests pending")
            return []  # the waiting requests' blocks are held by reservations: their KV arrives, or they go
        if scheduled.is_empty:
            return []
        started = time.perf_counter()
        result = self.runner.execute(scheduled)
        seconds = time.perf_counter() - started
        prompt_tokens = self._count_step(scheduled)
        if self.kv_tier is not None:
            self.kv_tier.observe_prefill(prompt_tokens, seconds)
        for request_id, (position, logprobs) in result.prompt_logprobs.items():
            self._tracked[request_id].request.add_prompt_logprobs(position, logprobs)
        self.scheduler.update(scheduled, result.sampled)
        outputs = []
        for request_id, token in result.sampled.items():
            tracked = self._tracked[request_id]
            outputs.append(self._after_token(tracked, token, result.logprobs.get(request_id)))
        return outputs

    def _count_step(self, scheduled) -> int:
        """Account the step's shape and tokens; returns the prompt tokens it computed."""
        self.last_step_sequences = len(scheduled.chunks)
        self.last_step_shape = StepShape.of(scheduled.chunks)
        prompt_tokens = 0
        for chunk in scheduled.chunks:
            request = self.scheduler.requests.get(chunk.request_id)
            if request is None:
                continue
            prompt = max(0, min(chunk.start_pos + len(chunk.token_ids), request.num_prompt_tokens) - chunk.start_pos)
            prompt_tokens += prompt
            self.num_decode_tokens_computed += len(chunk.token_ids) - prompt
        self.num_prefill_tokens_computed += prompt_tokens
        return prompt_tokens

    def _after_token(self, tracked: _Tracked, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        request, detok = tracked.request, tracked.detokenizer
        if logprob is not None:
            request.output_logprobs.append(logprob)
        text = detok.add_token(token) if detok is not None else ""
        if detok is not None and detok.stopped and not request.status.is_finished:
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
        if request.status.is_finished:
            if detok is not None:
                text += detok.flush()
            del self._tracked[request.request_id]
        return self._output(tracked, [token], text, [logprob] if logprob is not None else [])

    @staticmethod
    def _output(tracked: _Tracked, new_ids: list[int], new_text: str,
                new_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        request = tracked.request
        text = tracked.detokenizer.text if tracked.detokenizer is not None else ""
        logprobs = list(request.output_logprobs) if request.sampling_params.logprobs is not None else None
        completion = CompletionOutput(0, text, list(request.output_token_ids),
                                      request.status.finish_reason, logprobs)
        prompt_logprobs = [None, *request.prompt_logprobs] if request.sampling_params.prompt_logprobs is not None \
            else None
        return RequestOutput(request.request_id, tracked.prompt, request.prompt_token_ids,
                             [completion], new_ids, new_text, request.num_cached_tokens, new_logprobs or [],
                             prompt_logprobs)
