"""A routed request's choices run, and its answer shaped: one JSON body, or an SSE stream.

A request asks for `n` choices; each is a `Generation` of its own (own worker-level request
id, own seed), run concurrently, their deltas merged as they come. Usage counts the prompt
once and the completion tokens of every choice. The router counts the request once in flight;
each choice is observed in the metrics and the autoscaler's window as a sequence of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request

from pdserve.engine.outputs import TokenLogprob
from pdserve.router import protocol
from pdserve.router.errors import APIError
from pdserve.router.generation import Delta, Generation, GenerationError
from pdserve.router.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, joined
from pdserve.router.state import FinishedRequest

if TYPE_CHECKING:
    from pdserve.router.state import Router

_END = object()
_DONE = b"data: [DONE]\n\n"


@dataclass
class Collected:
    """One choice of a non-streaming request, as it ended."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with echo and logprobs


async def merged_deltas(generations: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every generation as they arrive; the first error raises,
    and leaving early (or an error) cancels the choices still running. The choices after the
    first start once it has its first token: its prompt's KV is then in the prefix caches of
    the workers that computed it, and they compute only what is not (the last token, at least)."""
    if len(generations) == 1:
        async for delta in generations[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    prompt_cached = asyncio.Event()

    async def pump(index: int, generation: Generation) -> None:
        try:
            if index:
                await prompt_cached.wait()
            async for delta in generation.deltas():
                prompt_cached.set()
                await queue.put((index, delta))
            await queue.put((index, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there
            await queue.put((index, exc))
        finally:
            prompt_cached.set()  # the first choice failed or ended: the others go on regardless

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class _ReadAhead:
    """An async iterator's items, read by a task of their own as they come and kept until
    taken; then its end (`done`), with the error it raised, if any."""

    def __init__(self, source: AsyncIterator) -> None:
        self.waiting: list = []
        self.done = False
        self.error: BaseException | None = None
        self._wakeup: asyncio.Future | None = None
        self.task = asyncio.ensure_future(self._read(source))

    async def _read(self, source: AsyncIterator) -> None:
        try:
            async for item in source:
                self.waiting.append(item)
                self._wake()
        except (Exception, asyncio.CancelledError) as exc:  # raised to the consumer, after the items before it
            self.error = exc
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            self.done = True
            self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def wait(self) -> None:
        """Until an item or the end comes (return at once if one is there)."""
        if not (self.waiting or self.done):
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup


async def read_ahead(source: AsyncIterator) -> AsyncIterator[list]:
    """`source`'s items in lists, each holding what came while the consumer was busy with the
    last: one item while it keeps up, several once it falls behind (a client slow to read its
    stream). `source`'s error is raised after the items before it; leaving early cancels it."""
    reader = _ReadAhead(source)
    try:
        while True:
            await reader.wait()
            if reader.waiting:
                batch, reader.waiting = reader.waiting, []
                yield batch
            elif reader.error is not None:
                raise reader.error
            else:
                return
    finally:
        reader.task.cancel()


def by_choice(batch: list[tuple[int, Delta]]) -> list[tuple[int, Delta]]:
    """(choice index, delta) pairs that came together, one per choice (in the order the choices
    came), each choice's deltas joined into one (`Delta.joined`)."""
    if len(batch) == 1:
        return batch
    grouped: dict[int, list[Delta]] = {}
    for index, delta in batch:
        grouped.setdefault(index, []).append(delta)
    return [(index, Delta.joined(deltas)) for index, deltas in grouped.items()]


def usage(generations: list[Generation]) -> dict:
    """The prompt once, every choice's completion tokens, the first choice's cached tokens."""
    first = generations[0]
    return protocol.usage(len(first.prompt_ids), sum(g.result.num_completion_tokens for g in generations),
                          first.result.num_cached_tokens)


def begin(router: Router) -> None:
    router.inflight += 1
    router.metrics.inflight.inc()


def end(router: Router, generations: list[Generation]) -> None:
    router.inflight -= 1
    router.metrics.inflight.dec()
    finished_at = time.perf_counter()
    for generation in generations:
        router.metrics.observe(generation, finished_at)
        result = generation.result
        if result.finish_reason in ("stop", "length") and result.first_token_at is not None:
            now = time.monotonic()
            router.finished.append(FinishedRequest(
                end=now, prompt_tokens=len(generation.prompt_ids), completion_tokens=result.num_completion_tokens,
                ttft_s=result.first_token_at - generation.started, tpot_s=result.tpot_s(finished_at),
                cached_tokens=result.num_cached_tokens, arrival=now - (finished_at - generation.started)))


async def collect(request: Request, generations: list[Generation]) -> list[Collected]:
    """Run a non-streaming request's choices; a client that disconnects aborts them."""
    collected = [Collected() for _ in generations]

    async def run():
        async for index, delta in merged_deltas(generations):
            choice = collected[index]
            choice.parts.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs or ())
            choice.prompt_logprobs.extend(delta.prompt_logprobs or ())

    task = asyncio.ensure_future(run())
    client_gone = False
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                client_gone = True
                task.cancel()
        await task
    except GenerationError as exc:
        retry = {"Retry-After": "1"} if exc.status in (429, 503) else None
        raise APIError(exc.status, str(exc), headers=retry) from None
    except asyncio.CancelledError:
        _mark_unfinished(generations, "abort")
        if client_gone and not asyncio.current_task().cancelling():
            # we cancelled it: end the request normally (the answer goes nowhere) rather than
            # letting CancelledError escape into the ASGI server as an unhandled exception
            raise APIError(499, "client closed the request") from None
        raise
    finally:
        task.cancel()  # no-op once done; stops the choices if this handler itself is cancelled
    return collected


def json_body(router: Router, rid: str, model: str, chat: bool, generations: list[Generation],
              collected: list[Collected], return_token_ids: bool, echo: str | None = None) -> dict:
    """The whole answer of a non-streaming request; `echo`: the prompt's text, to answer
    before each completion's (completions' `echo`)."""
    want_logprobs = generations[0].params.logprobs is not None
    choices = []
    for index, (generation, choice) in enumerate(zip(generations, collected, strict=True)):
        text, finish = (echo or "") + "".join(choice.parts), generation.result.finish_reason
        entry = {"index": index, "message": {"role": "assistant", "content": text}} if chat \
            else {"index": index, "text": text}
        entry.update(logprobs=None, finish_reason=finish)
        if want_logprobs and chat:
            entry["logprobs"] = chat_logprobs(router.tokenizer, choice.logprobs)
        elif want_logprobs:
            entry["logprobs"] = _completion_logprobs(router, generation, choice.logprobs, choice.prompt_logprobs,
                                                     echo is not None, 0)[0]
        if return_token_ids:
            entry["token_ids"] = choice.token_ids
        choices.append(entry)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(generations)}


def _completion_logprobs(router: Router, generation: Generation, logprobs: list[TokenLogprob],
                         prompt_logprobs: list[TokenLogprob] | None, echo: bool, text_offset: int) -> tuple[dict, int]:
    """Completions-shaped logprobs of `logprobs` from `text_offset`, after the echoed
    prompt's when `echo` (then `prompt_logprobs` holds prompt tokens 1..n-1's)."""
    if not echo:
        return completion_logprobs(router.tokenizer, logprobs, text_offset)
    prompt_part, text_offset = echo_logprobs(router.tokenizer, generation.prompt_ids, prompt_logprobs or [])
    rest, text_offset = completion_logprobs(router.tokenizer, logprobs, text_offset)
    return joined(prompt_part, rest), text_offset


class _StreamChunks:
    """The SSE events of one streamed request, in OpenAI's chunk shapes: every chunk names its
    choice's index; with `continuous_usage_stats`, every one that carries choices also carries
    the usage so far; a choice's first chunk starts with `echo` (the prompt's text) and its
    logprobs, when asked."""

    def __init__(self, router: Router, rid: str, generations: list[Generation], model: str, chat: bool,
                 options: protocol.StreamOptions, return_token_ids: bool, echo: str | None) -> None:
        self.router, self.rid, self.generations, self.model, self.chat = router, rid, generations, model, chat
        self.return_token_ids, self.echo = return_token_ids, echo
        self.created = int(time.time())
        self.continuous = options.include_usage and options.continuous_usage_stats
        self.text_offsets = [0] * len(generations)  # completions logprobs: where each choice's next token starts
        self.to_echo = [echo is not None] * len(generations)

    def event(self, payload: dict) -> bytes:
        """`payload` as one SSE event."""
        if self.continuous and payload.get("choices"):
            payload["usage"] = usage(self.generations)
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    def role(self, index: int) -> dict:
        """A chat choice's first chunk: the assistant's role, no content yet."""
        chunk = protocol.chat_chunk(self.rid, self.model, self.created, {"role": "assistant", "content": ""}, None)
        chunk["choices"][0]["index"] = index
        return chunk

    def chunk(self, index: int, delta: Delta) -> dict:
        """Choice `index`'s `delta` as a chunk."""
        if self.chat:
            content = {"content": delta.text} if delta.text else {}
            chunk = protocol.chat_chunk(self.rid, self.model, self.created, content, delta.finish_reason)
        else:
            text = (self.echo if self.to_echo[index] else "") + delta.text
            chunk = protocol.completion_chunk(self.rid, self.model, self.created, text, delta.finish_reason)
        choice = chunk["choices"][0]
        choice["index"] = index
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        if delta.logprobs is not None:
            choice["logprobs"] = self._logprobs(index, delta)
        self.to_echo[index] = False
        return chunk

    def _logprobs(self, index: int, delta: Delta) -> dict:
        """Choice `index`'s `delta`'s logprobs, chat- or completions-shaped (the latter moving
        the choice's text offset on)."""
        if self.chat:
            return chat_logprobs(self.router.tokenizer, delta.logprobs)
        logprobs, self.text_offsets[index] = _completion_logprobs(
            self.router, self.generations[index], delta.logprobs, delta.prompt_logprobs, self.to_echo[index],
            self.text_offsets[index])
        return logprobs

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return protocol.usage_chunk(self.rid, self.model, self.created, kind, usage(self.generations))


def _mark_unfinished(generations: list[Generation], reason: str) -> None:
    """Give every choice that has no finish reason yet `reason`."""
    for generation in generations:
        if generation.result.finish_reason is None:
            generation.result.finish_reason = reason


async def sse(router: Router, rid: str, generations: list[Generation], model: str, chat: bool,
              options: protocol.StreamOptions, return_token_ids: bool, echo: str | None = None):
    """The SSE stream of a request: chunks (each naming its choice's index), then (with
    `include_usage`) a usage chunk, then `[DONE]`; with `continuous_usage_stats` too, every
    chunk carries the usage so far. A client that keeps up gets a chunk per delta; one that
    falls behind gets each choice's deltas that came meanwhile in one chunk (`read_ahead`).
    `echo`: the prompt's text, which each choice's first chunk starts with (with its
    logprobs, when asked). A failed choice ends the stream with an error event, then `[DONE]`."""
    chunks = _StreamChunks(router, rid, generations, model, chat, options, return_token_ids, echo)
    begin(router)  # counted from the first iteration: a stream never started holds nothing
    try:
        if chat:
            for index in range(len(generations)):
                yield chunks.event(chunks.role(index))
        try:
            # what came while the client was still reading the last event goes out as one
            async for batch in read_ahead(merged_deltas(generations)):
                yield b"".join(chunks.event(chunks.chunk(index, delta)) for index, delta in by_choice(batch))
        except (GenerationError, APIError) as exc:
            _mark_unfinished(generations, "error")
            yield chunks.event({"error": {"message": str(exc), "type": "server_error",
                                          "code": getattr(exc, "status", 503)}})
            yield _DONE
            return
        if options.include_usage:
            yield chunks.event(chunks.usage_chunk())
        yield _DONE
    finally:
        _mark_unfinished(generations, "abort")  # the client went away mid-stream
        end(router, generations)
