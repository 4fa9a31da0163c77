"""Tokens coalesced on their way to a streaming client: a decode worker sends the outputs
that queued behind its stream in one GenerateChunk; the router takes a several-token chunk
up to a stop string only; its SSE writer reads deltas ahead and joins each choice's that came
while the client was busy, carrying exactly what they carried in turn."""

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.decode_worker.service import DecodeService, _waiting
from pdserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos import pdserve_pb2 as pb
from pdserve.router.cache_index import PromptKeys
from pdserve.router.generation import Delta, Generation, _Leg
from pdserve.router.responses import by_choice, read_ahead


class Letters:
    """Stands in for a tokenizer: token i decodes to the i-th letter."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def output(tokens: list[int], finish: str | None = None, logprobs: bool = False, **kw) -> RequestOutput:
    return RequestOutput("r", None, [7, 8, 9], [CompletionOutput(0, "", [], finish)], new_token_ids=tokens,
                         new_logprobs=[TokenLogprob(t, -0.5 * t) for t in tokens] if logprobs else [], **kw)


def test_a_worker_sends_the_outputs_queued_behind_its_stream_in_one_chunk():
    queue: asyncio.Queue = asyncio.Queue()
    for tokens, finish in (([2], None), ([3], None), ([4], "length")):
        queue.put_nowait(output(tokens, finish, logprobs=True))
    waiting = _waiting(output([1], logprobs=True, num_cached_tokens=2,
                              prompt_logprobs=[None, TokenLogprob(8, -1.0), TokenLogprob(9, -2.0)]), queue)
    assert queue.empty() and len(waiting) == 4
    chunk = DecodeService._chunk(waiting, "local")
    assert list(chunk.token_ids) == [1, 2, 3, 4] and chunk.finish_reason == "length"
    assert [lp.logprob for lp in chunk.logprobs] == [-0.5, -1.0, -1.5, -2.0]
    assert chunk.prefilled_by == "local" and chunk.num_cached_tokens == 2 and chunk.num_prompt_tokens == 3
    assert [lp.logprob for lp in chunk.prompt_logprobs] == [-1.0, -2.0]
    later = DecodeService._chunk(waiting[1:], "")  # not the first chunk: no first-chunk fields
    assert list(later.token_ids) == [2, 3, 4] and not later.prefilled_by and not later.prompt_logprobs
    alone = DecodeService._chunk([output([5])], "")  # a stream that keeps up: one step's token
    assert list(alone.token_ids) == [5] and alone.finish_reason == "" and not alone.logprobs


def generation(stop: tuple[str, ...] = (), logprobs: int | None = None) -> tuple[Generation, _Leg]:
    expected = []
    router = SimpleNamespace(tokenizer=Letters(), registry=SimpleNamespace(
        cache_index=SimpleNamespace(expect=lambda worker, prompt: expected.append(prompt.token_ids)),
        model=SimpleNamespace(vocab_size=26)))
    prompt = PromptKeys([20, 21])
    params = SamplingParams(max_tokens=10, stop=stop, logprobs=logprobs, seed=1)
    gen = Generation(router, "r", prompt, params, route=None, decode=None)
    return gen, _Leg(SimpleNamespace(worker_id="d"), [], prompt, params)


def test_a_several_token_chunk_is_taken_up_to_the_token_completing_a_stop_string():
    gen, leg = generation(stop=("cd",), logprobs=0)
    chunk = pb.GenerateChunk(token_ids=[0, 1, 2, 3, 4, 5])
    chunk.logprobs.extend(pb.TokenLogprob(logprob=-1.0 * t) for t in range(6))
    delta = gen._take(leg, chunk)
    assert delta.token_ids == [0, 1, 2, 3] and delta.text == "ab" and delta.finish_reason == "stop"
    assert [lp.token_id for lp in delta.logprobs] == [0, 1, 2, 3]
    assert gen.output_ids == [0, 1, 2, 3] and gen.result.num_completion_tokens == 4
    assert not leg.worker_done  # its stream is cancelled: the worker still runs it


def test_a_several_token_chunk_gives_what_its_tokens_one_by_one_give():
    one_by_one, leg = generation()
    deltas = [one_by_one._take(leg, pb.GenerateChunk(token_ids=[t])) for t in (0, 1, 2)]
    deltas.append(one_by_one._take(leg, pb.GenerateChunk(token_ids=[3], finish_reason="length")))
    together, leg = generation()
    delta = together._take(leg, pb.GenerateChunk(token_ids=[0, 1, 2, 3], finish_reason="length"))
    assert delta == Delta.joined(deltas) == Delta("abcd", [0, 1, 2, 3], "length")
    assert together.output_ids == one_by_one.output_ids and leg.worker_done


def test_joined_deltas_carry_exactly_what_they_carried_in_turn():
    first = Delta("a", [0], None, [TokenLogprob(0, -1.0)], [TokenLogprob(5, -3.0)])
    deltas = [first, Delta("", [1], None, [TokenLogprob(1, -2.0)]), Delta("bc", [2], "stop", [TokenLogprob(2, 0.0)])]
    assert Delta.joined(deltas) == Delta("abc", [0, 1, 2], "stop", [TokenLogprob(0, -1.0), TokenLogprob(1, -2.0),
                                                                       TokenLogprob(2, 0.0)], [TokenLogprob(5, -3.0)])
    assert Delta.joined([first]) is first
    assert Delta.joined([Delta("a", [0]), Delta("b", [1])]).logprobs is None


def test_deltas_that_came_together_are_joined_per_choice_in_the_order_the_choices_came():
    batch = [(1, Delta("a", [0])), (0, Delta("x", [9])), (1, Delta("b", [1], "length")), (0, Delta("y", [8]))]
    assert by_choice(batch) == [(1, Delta("ab", [0, 1], "length")), (0, Delta("xy", [9, 8]))]
    assert by_choice(batch[:1]) == batch[:1]


async def items(n: int, gap_s: float = 0.0, error: Exception | None = None, closed: list | None = None):
    try:
        for i in range(n):
            await asyncio.sleep(gap_s)
            yield i
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.append(True)


def test_read_ahead_hands_a_consumer_that_keeps_up_one_item_at_a_time():
    async def run():
        return [batch async for batch in read_ahead(items(5, gap_s=0.005))]

    assert asyncio.run(run()) == [[0], [1], [2], [3], [4]]


def test_read_ahead_hands_a_slow_consumer_what_came_meanwhile_then_the_error_after_it():
    async def run():
        batches = []
        with pytest.raises(ValueError, match="worker failed"):
            async for batch in read_ahead(items(6, error=ValueError("worker failed"))):
                batches.append(batch)
                await asyncio.sleep(0.05)  # a client slow to read
        return batches

    batches = asyncio.run(run())
    assert [i for batch in batches for i in batch] == list(range(6)) and len(batches) < 6, batches


def test_leaving_read_ahead_early_stops_its_source():
    async def run():
        closed = []
        stream = read_ahead(items(1000, gap_s=0.001, closed=closed))
        async for _ in stream:
            break
        await stream.aclose()
        await asyncio.sleep(0.01)
        return closed

    assert asyncio.run(run()) == [True]
