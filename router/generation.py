"""One request's decode leg, as the router owns it.

Lifecycle (docs/design.md, "Request lifecycle"): RECEIVED → ROUTED(P, D) → STREAMING → FINISHED | ABORTED | FAILED.
The router picks a decode worker and the prefill workers it may use, opens the decode
worker's `Generate` stream, detokenizes, and applies stop strings (cancelling the stream
when one matches, which aborts the request on both workers). A decode worker that is
unavailable before the first token (draining, or gone) is replaced once by another. After
the first token, a failed leg (worker killed, unreachable, hung past keepalive, or gone from
the pool) is resumed on another decode worker: the prompt plus the tokens sent so far, the
same seed, the sampling positions continuing (`SamplingParams.first_position`), so greedy and
seeded output is exactly what an unbroken run gives (the router resolves unseeded requests'
seeds itself). Past `max_migrations`, the client gets the error. Leaving the generator early
(client gone) cancels the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos.convert import logprob_from_proto, sampling_to_proto
from pdserve.router.cache_index import PromptKeys
from pdserve.router.errors import APIError
from pdserve.router.policies import RouteRequest
from pdserve.rpc import tracing

if TYPE_CHECKING:
    from pdserve.router.registry import WorkerView
    from pdserve.router.state import Router

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
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    # the first delta only, when the request asked for prompt logprobs: prompt tokens 1..n-1's
    prompt_logprobs: list[TokenLogprob] | None = None

    @staticmethod
    def joined(deltas: list[Delta]) -> Delta:
        """Consecutive deltas of one choice as one, carrying exactly what they carry in turn:
        their text and token ids (and logprobs) concatenated, the first one's prompt logprobs,
        the last one's finish reason (no earlier one has one)."""
        if len(deltas) == 1:
            return deltas[0]
        first = deltas[0]
        logprobs = None if first.logprobs is None else [lp for d in deltas for lp in d.logprobs or ()]
        return Delta("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids],
                     deltas[-1].finish_reason, logprobs, first.prompt_logprobs)


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


@dataclass
class _Leg:
    """One decode leg in flight: where it runs, what it was sent, how far it got."""

    decode: WorkerView
    prefill: list[WorkerView]  # the prefill workers offered to it (at most two), the first preferred
    prompt: PromptKeys  # the request's prompt, plus the tokens earlier legs generated
    params: SamplingParams  # max_tokens and sampling positions continue from earlier legs
    span: Any = None  # its tracing span
    call: Any = None  # the decode worker's Generate stream
    got_token: bool = False  # the worker sent this leg's first token
    worker_done: bool = False  # the worker ended the request itself (a finish reason)
    prompt_logprobs: list[TokenLogprob] | None = None  # to hand on with the leg's next delta


class Generation:
    def __init__(self, router: Router, request_id: str, prompt: PromptKeys, params: SamplingParams,
                 route: RouteRequest, decode: WorkerView | None = None) -> None:
        """`route`: what the policy knows of the request; `decode`: the decode worker already
        picked for the first attempt (None: pick one)."""
        self.router, self.request_id = router, request_id
        self.prompt, self.prompt_ids, self.route = prompt, prompt.token_ids, route
        if params.seed is None:  # resolved here, so a leg resumed elsewhere samples alike
            params = dataclasses.replace(params, seed=_SEEDS.getrandbits(63))
        self.params = params
        self._first_decode = decode
        self.result = Result()
        self.started = time.perf_counter()
        self.output_ids: list[int] = []  # every token sent to the client, across legs
        self.migrations = 0
        self._detok = IncrementalDetokenizer(router.tokenizer, self.prompt_ids, params.stop,
                                             params.skip_special_tokens)

    async def deltas(self) -> AsyncIterator[Delta]:
        """The request's text as it comes. Before the first token, an unavailable decode
        worker is replaced (up to `max(1, max_migrations)` times: a worker can die while a
        request waits in its queue, and so can the next); after it, a failed leg is resumed on
        another decode worker (up to `max_migrations` times) from the tokens already sent, so
        the client sees one unbroken stream."""
        tried: set[str] = set()
        decode = self._first_decode or self.router.pick_decode(self.route)
        replaced = 0
        refusal = None  # why the last decode worker could not take it (before any token)
        while True:
            tried.add(decode.worker_id)
            full = False  # the worker refused for lack of room: healthy, only busy
            try:
                async for delta in self._leg(decode):
                    yield delta
                return
            except _RetryElsewhere as exc:
                if replaced >= max(1, self.router.config.max_migrations):
                    raise GenerationError(f"no decode worker could take the request: {exc}",
                                          exc.status) from None
                replaced, refusal, full = replaced + 1, exc, exc.status == 429
                logger.warning("request_id=%s decode worker %s unavailable (%s); retrying",
                               self.request_id, decode.worker_id, exc)
            except _LegFailed as exc:
                if self.migrations >= self.router.config.max_migrations:
                    raise GenerationError(str(exc)) from None
                self.migrations += 1
                self.router.metrics.migrations.labels(exc.reason).inc()
                tracing.add_event("migration", reason=exc.reason, tokens_sent=len(self.output_ids))
                logger.warning("request_id=%s migrating after %d tokens (%d of at most %d): %s",
                               self.request_id, len(self.output_ids), self.migrations,
                               self.router.config.max_migrations, exc)
            if not full:
                self.router.registry.mark_unhealthy(decode)
            try:
                decode = await self._next_decode(tried, wait=not full)
            except APIError:
                why = f": {refusal}" if refusal else "; retry later"
                raise GenerationError(f"no other decode worker could take the request{why}",
                                      refusal.status if refusal else 503) from None

    async def _next_decode(self, tried: set[str], wait: bool) -> WorkerView:
        """A routable decode worker not tried yet for this request; when there is none, and
        `wait`, poll for up to `migration_wait_s` (a failed worker's replacement joins the pool
        seconds later). Raises APIError when none came."""
        deadline = time.monotonic() + (self.router.config.migration_wait_s if wait else 0.0)
        while True:
            try:
                return self.router.pick_decode(self._leg_route(), exclude=tried)
            except APIError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.25)

    def _leg_route(self) -> RouteRequest:
        """The route of the next leg: the prompt plus the tokens generated so far."""
        if not self.output_ids:
            return self.route
        return self.router.route_request(PromptKeys(self.prompt_ids + self.output_ids), self.route.session)

    async def _leg(self, decode: WorkerView) -> AsyncIterator[Delta]:
        """One decode worker's part of the request: from the start, or resumed after the
        tokens already generated (its prompt ends with them, its sampling positions and
        `max_tokens` continue where the last leg stopped). Raises `_RetryElsewhere` (the worker
        could not take it, no token sent yet), `_LegFailed` (resumable elsewhere) or
        `GenerationError` (for the client); leaving early cancels the worker's stream."""
        if len(self.output_ids) >= self.params.max_tokens:  # the failed leg had sent every token, not its finish
            self.result.finish_reason = "length"
            yield Delta(self._detok.flush(), [], "length")
            return
        leg = self._open_leg(decode)
        try:
            async for chunk in leg.call:
                if not leg.got_token and chunk.token_ids:
                    self._first_token(leg, chunk)
                delta = self._take(leg, chunk)
                if delta is not None:
                    yield delta
                    if delta.finish_reason:
                        return
            raise self._failed(decode, "ended_early", "ended the stream without a finish reason", 502)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_failure(decode, exc) from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # our own task is being cancelled (client gone, shutdown)
            # gRPC cancels the calls of a channel the registry closed: the worker left the pool
            if not self.output_ids:
                raise _RetryElsewhere("it left the pool") from None
            raise self._failed(decode, "worker_left", "it left the pool mid-request") from None
        finally:
            self._close_leg(leg, sys.exc_info()[1])  # the exception leaving the leg, if any

    def _open_leg(self, decode: WorkerView) -> _Leg:
        """Open the next leg's `Generate` stream on `decode`: the prompt plus the tokens sent so
        far (the first leg alone asks for the prompt's logprobs), with the (at most two)
        prefill workers the policy orders for it. Counts it open on `decode`, its prompt as in
        flight on the first prefill worker, and its blocks as expected in `decode`'s cache."""
        router, done = self.router, len(self.output_ids)
        params = self.params if not done else dataclasses.replace(  # the first leg sent the prompt's logprobs
            self.params, max_tokens=self.params.max_tokens - done, first_position=self.params.first_position + done,
            prompt_logprobs=None)
        prompt = self.prompt if not done else PromptKeys(self.prompt_ids + self.output_ids)
        route = self.route if not done else self._leg_route()
        leg = _Leg(decode, router.order_prefill(route, decode)[:2], prompt, params)
        request = pb.GenerateRequest(
            request_id=self.request_id, prompt_token_ids=prompt.token_ids,
            sampling=sampling_to_proto(params), prefill_addresses=[p.address for p in leg.prefill],
            kv_transport=router.config.kv_transport,
            prefill_queued_tokens=leg.prefill[0].queued_prefill_tokens if leg.prefill else 0,
        )
        self.result.decode_worker = decode.worker_id
        leg.span = tracing.start_span("pdserve.decode_leg", client=True, request_id=self.request_id,
                                      decode_worker=decode.worker_id, migration=self.migrations,
                                      resumed_after_tokens=done)
        leg.call = decode.stub.Generate(request, timeout=router.config.request_timeout_s,
                                        metadata=tracing.metadata(leg.span))
        # its blocks will be cached there, however prefilled
        router.registry.cache_index.expect(decode.worker_id, prompt)
        decode.note_opened(self.request_id)
        if leg.prefill:
            leg.prefill[0].inflight_tokens += len(prompt.token_ids)
        return leg

    def _first_token(self, leg: _Leg, chunk: pb.GenerateChunk) -> None:
        """The leg's first token came: its prompt is no longer in flight on the prefill worker,
        whichever prefilled it now caches its blocks; the request's first token (of any leg)
        sets its TTFT and cache figures; the prompt's logprobs wait for the leg's next delta."""
        leg.got_token = True
        tracing.add_event("first_token", on=leg.span, prefilled_by=chunk.prefilled_by)
        if leg.prefill:
            leg.prefill[0].inflight_tokens -= len(leg.prompt.token_ids)
        for worker in leg.prefill:
            if worker.worker_id == chunk.prefilled_by:  # and where it was prefilled
                self.router.registry.cache_index.expect(worker.worker_id, leg.prompt)
        if self.result.first_token_at is None:
            self.result.first_token_at = time.perf_counter()
            self.result.prefilled_by = chunk.prefilled_by
            self.result.num_cached_tokens = chunk.num_cached_tokens
            self.result.expected_cached_tokens = self._expected_cached(leg.decode, leg.prefill, chunk.prefilled_by)
        leg.prompt_logprobs = self._prompt_logprobs(chunk, leg.decode, leg.params)

    def _take(self, leg: _Leg, chunk: pb.GenerateChunk) -> Delta | None:
        """Add a chunk's tokens to the request's: the delta to send (None: nothing yet), with
        a finish reason when the worker finished the request or a stop string matched (then
        the whole conversation so far is expected in the decode worker's cache)."""
        token_ids, text = self._detokenize(chunk.token_ids)
        self.result.num_completion_tokens += len(token_ids)
        self.output_ids.extend(token_ids)
        leg.worker_done = bool(chunk.finish_reason)
        finish = "stop" if self._detok.stopped else (chunk.finish_reason or None)
        if finish:
            text += self._detok.flush()
            self.result.finish_reason = finish
            # the conversation so far stays cached on the decode worker (all but the
            # last token, whose KV was never computed): its next turn will look for it
            self.router.registry.cache_index.expect(leg.decode.worker_id,
                                                    PromptKeys(self.prompt_ids + self.output_ids))
        elif not (text or token_ids):
            return None
        prompt_logprobs, leg.prompt_logprobs = leg.prompt_logprobs, None
        return Delta(text, token_ids, finish, self._logprobs(chunk, token_ids, leg.decode), prompt_logprobs)

    def _detokenize(self, chunk_ids) -> tuple[list[int], str]:
        """A chunk's tokens (a decode worker sends several in one when its stream fell behind)
        up to the one that completes a stop string, if one does (the rest are not the
        client's: neither sent, nor counted), and the text they add."""
        detok = self._detok
        if len(chunk_ids) == 1:  # the usual chunk
            return list(chunk_ids), detok.add_token(chunk_ids[0])
        parts = []
        for taken, token_id in enumerate(chunk_ids, 1):
            parts.append(detok.add_token(token_id))
            if detok.stopped:
                return list(chunk_ids[:taken]), "".join(parts)
        return list(chunk_ids), "".join(parts)

    def _rpc_failure(self, decode: WorkerView, exc: grpc.aio.AioRpcError) -> Exception:
        """What a leg's failed call raises: the client's 400 for a request the worker found
        invalid; before any token, `_RetryElsewhere` for a worker unavailable, full (429) or
        that already had the request id; a resumable failure for a worker gone or broken
        (`_MIGRATABLE`); else the client's error, with the worker kept out of routing a while."""
        code = exc.code()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return GenerationError(exc.details(), 400)
        if not self.output_ids and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ALREADY_EXISTS,
                                            grpc.StatusCode.RESOURCE_EXHAUSTED):
            full = code == grpc.StatusCode.RESOURCE_EXHAUSTED
            return _RetryElsewhere(exc.details(), 429 if full else 503)
        if code in _MIGRATABLE:
            return self._failed(decode, code.name.lower(), f"{code.name}: {exc.details()}")
        self.router.registry.mark_unhealthy(decode)
        return GenerationError(f"decode worker {decode.worker_id} failed: {code.name}: {exc.details()}")

    def _close_leg(self, leg: _Leg, error: BaseException | None) -> None:
        """However the leg ended: no longer open on its decode worker, nor in flight on the
        prefill worker (when no token came); a stream the worker did not finish itself is
        cancelled (stop string, client gone or error: the request is aborted on the
        workers); its span ends, failed with `error` if any."""
        leg.decode.note_closed()
        if leg.prefill and not leg.got_token:
            leg.prefill[0].inflight_tokens -= len(leg.prompt.token_ids)
        if not leg.worker_done:
            leg.call.cancel()
        tracing.end(leg.span, error)

    def _logprobs(self, chunk: pb.GenerateChunk, token_ids: list[int],
                  decode: WorkerView) -> list[TokenLogprob] | None:
        """The per-token logprobs of the chunk's first `token_ids` (the ones taken), checked,
        when the request asked for them."""
        want = self.params.logprobs
        if want is None:
            return None
        if len(chunk.logprobs) != len(chunk.token_ids):
            raise GenerationError(f"decode worker {decode.worker_id} sent {len(chunk.logprobs)} logprobs for "
                                  f"{len(chunk.token_ids)} tokens", 502)
        vocab = self.router.registry.model.vocab_size or None
        try:
            return [logprob_from_proto(t, m, vocab, want)
                    for t, m in zip(token_ids, chunk.logprobs[:len(token_ids)], strict=True)]
        except ValueError as exc:
            raise GenerationError(f"decode worker {decode.worker_id} sent bad logprobs: {exc}", 502) from None

    def _prompt_logprobs(self, chunk: pb.GenerateChunk, decode: WorkerView,
                         params: SamplingParams) -> list[TokenLogprob] | None:
        """A leg's first chunk's prompt logprobs (tokens 1..n-1's), checked, when it asked."""
        if params.prompt_logprobs is None:
            return None
        ids = self.prompt_ids
        if len(chunk.prompt_logprobs) != len(ids) - 1:
            raise GenerationError(f"decode worker {decode.worker_id} sent {len(chunk.prompt_logprobs)} prompt "
                                  f"logprobs for a prompt of {len(ids)} tokens", 502)
        vocab = self.router.registry.model.vocab_size or None
        try:
            return [logprob_from_proto(t, m, vocab, params.prompt_logprobs)
                    for t, m in zip(ids[1:], chunk.prompt_logprobs, strict=True)]
        except ValueError as exc:
            raise GenerationError(f"decode worker {decode.worker_id} sent bad prompt logprobs: {exc}", 502) from None

    def _failed(self, decode: WorkerView, reason: str, what: str, status: int = 503) -> Exception:
        """A leg's failure: resumable once it has sent tokens, else the client's error."""
        message = f"decode worker {decode.worker_id} failed: {what}"
        if self.output_ids:
            return _LegFailed(message, reason)
        return GenerationError(message, status)

    def _expected_cached(self, decode: WorkerView, prefill: list[WorkerView], prefilled_by: str) -> int:
        """The cached prompt tokens the route predicted for the worker that prefilled."""
        if prefilled_by == "local":
            return self.route.cached_on(decode)
        for worker in prefill:
            if worker.worker_id == prefilled_by:
                return self.route.cached_on(worker)
        return 0


class _RetryElsewhere(Exception):
    """The decode worker could not take the request (no token yet): try another."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status  # for the client, if no other worker takes it either


class _LegFailed(Exception):
    """The decode leg failed after sending tokens: resume it elsewhere."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# After the first token, these end a leg in a way another decode worker can take over from:
# the worker is gone or unreachable (UNAVAILABLE), shut its server (CANCELLED), or failed
# inside (INTERNAL, UNKNOWN). A DEADLINE_EXCEEDED leg used the request's whole timeout.
_MIGRATABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                         grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED})
_SEEDS = random.SystemRandom()
