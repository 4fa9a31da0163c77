"""One request's decode leg, as the router owns it.

Lifecycle (DESIGN.md): RECEIVED → ROUTED(P, D) → STREAMING → FINISHED | ABORTED | FAILED.
The router picks a decode worker and the prefill workers it may use, opens the decode
worker's `Generate` stream, detokenizes, and applies stop strings (cancelling the stream
when one matches, which aborts the request on both workers). A decode worker that is
unavailable before the first token (draining, or gone) is replaced once by another; a
failure after that ends the request with a clear error. Leaving the generator early
(client gone) cancels the stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb
from protos.convert import sampling_to_proto
from router.cache_index import PromptKeys
from router.policies import RouteRequest

logger = logging.getLogger(__name__)


class GenerationError(Exception):
    """The request failed after routing; the message is for the client."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Result:
    num_completion_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    decode_worker: str = ""
    prefilled_by: str = ""
    num_cached_tokens: int = 0  # prompt tokens reused from a prefix cache on the request's path
    expected_cached_tokens: int = 0  # what the router's cache index predicted for that path

    def tpot_s(self, end: float) -> float | None:
        """Mean seconds per output token after the first, up to `end` (a perf_counter time);
        None before two tokens."""
        if self.first_token_at is None or self.num_completion_tokens < 2:
            return None
        return (end - self.first_token_at) / (self.num_completion_tokens - 1)


class Generation:
    def __init__(self, router, request_id: str, prompt: PromptKeys, params: SamplingParams,
                 route: RouteRequest, decode=None) -> None:
        """`route`: what the policy knows of the request; `decode`: the decode worker already
        picked for the first attempt (None: pick one)."""
        self.router, self.request_id = router, request_id
        self.prompt, self.prompt_ids, self.params, self.route = prompt, prompt.token_ids, params, route
        self._first_decode = decode
        self.result = Result()
        self.started = time.perf_counter()

    async def deltas(self) -> AsyncIterator[Delta]:
        tried: set[str] = set()
        for attempt in range(2):
            decode = self._first_decode if attempt == 0 and self._first_decode else \
                self.router.pick_decode(self.route, exclude=tried)
            tried.add(decode.worker_id)
            try:
                async for delta in self._stream_from(decode):
                    yield delta
                return
            except _RetryElsewhere as exc:
                logger.warning("request_id=%s decode worker %s unavailable (%s); retrying",
                               self.request_id, decode.worker_id, exc)
                self.router.registry.mark_unhealthy(decode)
        raise GenerationError("no decode worker could take the request; retry later")

    async def _stream_from(self, decode) -> AsyncIterator[Delta]:
        router, params = self.router, self.params
        prefill = router.order_prefill(self.route, decode)[:2]
        request = pb.GenerateRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt_ids,
            sampling=sampling_to_proto(params), prefill_addresses=[p.address for p in prefill],
            kv_transport=router.config.kv_transport,
            prefill_queued_tokens=prefill[0].queued_prefill_tokens if prefill else 0,
        )
        detok = IncrementalDetokenizer(router.tokenizer, self.prompt_ids, params.stop, params.skip_special_tokens)
        self.result.decode_worker = decode.worker_id
        call = decode.stub.Generate(request, timeout=router.config.request_timeout_s)
        index = router.registry.cache_index
        index.expect(decode.worker_id, self.prompt)  # its blocks will be cached there, however prefilled
        output_ids: list[int] = []
        decode.note_opened(self.request_id)
        if prefill:
            prefill[0].inflight_tokens += len(self.prompt_ids)
        worker_done = False  # the decode worker ended the request itself
        try:
            async for chunk in call:
                if self.result.first_token_at is None and chunk.token_ids:
                    self.result.first_token_at = time.perf_counter()
                    self.result.prefilled_by = chunk.prefilled_by
                    self.result.num_cached_tokens = chunk.num_cached_tokens
                    self.result.expected_cached_tokens = self._expected_cached(decode, prefill, chunk.prefilled_by)
                    for worker in prefill:
                        if worker.worker_id == chunk.prefilled_by:  # and where it was prefilled
                            index.expect(worker.worker_id, self.prompt)
                    if prefill:
                        prefill[0].inflight_tokens -= len(self.prompt_ids)
                text = "".join(detok.add_token(t) for t in chunk.token_ids if not detok.stopped)
                self.result.num_completion_tokens += len(chunk.token_ids)
                output_ids.extend(chunk.token_ids)
                worker_done = bool(chunk.finish_reason)
                finish = "stop" if detok.stopped else (chunk.finish_reason or None)
                if finish:
                    text += detok.flush()
                    self.result.finish_reason = finish
                    # the conversation so far stays cached on the decode worker (all but the
                    # last token, whose KV was never computed): its next turn will look for it
                    index.expect(decode.worker_id, PromptKeys(self.prompt_ids + output_ids))
                    yield Delta(text, list(chunk.token_ids), finish)
                    return
                if text or chunk.token_ids:
                    yield Delta(text, list(chunk.token_ids))
            raise GenerationError("decode worker ended the stream without a finish reason", 502)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if self.result.first_token_at is None and code in (grpc.StatusCode.UNAVAILABLE,
                                                               grpc.StatusCode.ALREADY_EXISTS):
                raise _RetryElsewhere(exc.details()) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise GenerationError(exc.details(), 400) from None
            router.registry.mark_unhealthy(decode)
            raise GenerationError(f"decode worker {decode.worker_id} failed: {code.name}: {exc.details()}") from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # our own task is being cancelled (client gone, shutdown)
            # gRPC cancels the calls of a channel the registry closed: the worker left the pool
            router.registry.mark_unhealthy(decode)
            if self.result.first_token_at is None:
                raise _RetryElsewhere("it left the pool") from None
            raise GenerationError(f"decode worker {decode.worker_id} failed: it left the pool mid-request") from None
        finally:
            decode.note_closed()
            if prefill and self.result.first_token_at is None:
                prefill[0].inflight_tokens -= len(self.prompt_ids)
            if not worker_done:
                call.cancel()  # stop string, client gone or error: abort on the workers

    def _expected_cached(self, decode, prefill, prefilled_by: str) -> int:
        """The cached prompt tokens the route predicted for the worker that prefilled."""
        if prefilled_by == "local":
            return self.route.cached_on(decode)
        for worker in prefill:
            if worker.worker_id == prefilled_by:
                return self.route.cached_on(worker)
        return 0


class _RetryElsewhere(Exception):
    pass
