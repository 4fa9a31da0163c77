"""Prefix caching across the prefill/decode split (real processes, real gRPC, both
transports): the decode worker reserves its cached prefix and the prefill worker ships only
what the decode worker lacks, from its own cache or computed; the tokens equal the offline
engine's in every case, and the bytes shipped shrink with the decode worker's hit."""

import asyncio
import random
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.kv_transfer.layout import KVLayout
from pdserve.protos import pdserve_pb2 as pb
from pdserve.testkit.workers import WorkerProcess, decode_stub, generate_request, stats_of, wait_idle

BLOCK = 16
MAX_TOKENS = 6


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


@pytest.fixture(scope="module")
def split(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with WorkerProcess("prefill", model, "--max-num-batched-tokens", "32") as p, \
            WorkerProcess("decode", model) as d1, WorkerProcess("decode", model) as d2:
        llm = LLM(model)  # the workers' dtype (`auto` on the same machine)
        yield {"model": model, "p": p.address, "d1": d1.address, "d2": d2.address, "llm": llm,
               "token_bytes": KVLayout.of_cache(llm.engine.runner.kv_cache).kv_bytes(1)}


async def generate(address: str, rid: str, prompt: list[int], prefill: list[str], transport: str):
    channel, stub = decode_stub(address)
    async with channel:
        before = await stub.Stats(pb.StatsRequest())
        tokens, first = [], None
        async for chunk in stub.Generate(generate_request(rid, prompt, MAX_TOKENS, prefill, transport)):
            first = first or chunk
            tokens.extend(chunk.token_ids)
        after = await wait_idle(stub)
    assert after.num_free_blocks == after.num_total_blocks
    return tokens, first, after.kv_bytes_received - before.kv_bytes_received, after


def offline(split, prompt):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return split["llm"].generate([prompt], params)[0].token_ids


@pytest.mark.parametrize("transport", ["torch", "grpc"])
def test_only_what_the_decode_worker_lacks_is_shipped(split, transport):
    seed = {"torch": 0, "grpc": 100}[transport]
    system = ids(4 * BLOCK, seed + 1)  # four full blocks every prompt below starts with
    token_bytes = split["token_bytes"]  # one token's K and V in every layer

    async def scenario():
        p, d1, d2 = split["p"], split["d1"], split["d2"]
        before = await stats_of(d1, "decode")  # the module's workers count over every case
        first = system + ids(21, seed + 2)
        out = {"first": await generate(d1, f"a-{transport}", first, [p], transport)}
        # d1 holds the system prompt now: it reserves those blocks and receives only the rest
        second = system + ids(30, seed + 3)
        out["second"] = await generate(d1, f"b-{transport}", second, [p], transport)
        # d2 holds nothing, the prefill worker holds the system prompt: it ships it from its cache
        third = system + ids(25, seed + 4)
        out["third"] = await generate(d2, f"c-{transport}", third, [p], transport)
        # d2 computes a prompt itself (no prefill worker offered); the prefill worker never saw
        # it: it computes it all and ships only what d2 lacks
        own = ids(3 * BLOCK + 5, seed + 5)
        out["local"] = await generate(d2, f"d-{transport}", own, [], transport)
        fourth = own[: 3 * BLOCK] + ids(40, seed + 6)
        out["fourth"] = await generate(d2, f"e-{transport}", fourth, [p], transport)
        return out, {"first": first, "second": second, "third": third, "local": own, "fourth": fourth}, before

    out, prompts, before = asyncio.run(scenario())
    for name, (tokens, _, _, _) in out.items():
        assert tokens == offline(split, prompts[name]), f"{name}: tokens differ from the offline engine"
    assert out["local"][1].prefilled_by == "local"
    for name in ("first", "second", "third", "fourth"):
        assert out[name][1].prefilled_by not in ("", "local"), name
    assert out["first"][2] == len(prompts["first"]) * token_bytes
    assert out["second"][2] == (len(prompts["second"]) - 4 * BLOCK) * token_bytes  # the delta only
    assert out["third"][2] == len(prompts["third"]) * token_bytes  # d2 lacked it all
    assert out["third"][1].num_cached_tokens == 4 * BLOCK  # ...but the prefill worker computed the tail only
    assert out["fourth"][2] == (len(prompts["fourth"]) - 3 * BLOCK) * token_bytes
    assert out["fourth"][1].num_cached_tokens == 0  # the prefill worker had none of it
    # this case's two requests on d1 (the second with its cached system prompt too) went remote
    # because of their uncached tokens
    key = "remote/many_uncached_tokens"
    decided = out["second"][3].prefill_decisions.get(key, 0) - before.prefill_decisions.get(key, 0)
    assert decided == 2, f"{decided} {key} decisions on d1 in this case"


def test_abort_during_a_delta_transfer_keeps_the_shared_prefix(split):
    """A request sharing cached blocks is aborted while its delta lands: its own blocks are
    freed, the shared ones stay cached and correct for the next request."""
    system = ids(4 * BLOCK, 900)

    async def scenario():
        p, d = split["p"], split["d1"]
        await generate(d, "warm", system + ids(10, 901), [p], "torch")
        channel, stub = decode_stub(d)
        async with channel:
            call = stub.Generate(generate_request("aborted", system + ids(900, 902), 50, [p], "torch"))
            deadline = time.monotonic() + 60
            while not (await stub.Stats(pb.StatsRequest())).num_waiting_for_kv:  # the delta is landing
                assert time.monotonic() < deadline, "the request never waited for its KV on d1 in 60 s"
                await asyncio.sleep(0.002)
            reply = await stub.Abort(pb.AbortRequest(request_id="aborted"))
            async for _ in call:
                pass
            idle = await wait_idle(stub)
        after = await generate(d, "after", system + ids(12, 903), [p], "torch")
        return reply, idle, after

    reply, idle, (tokens, first, shipped, stats) = asyncio.run(scenario())
    assert reply.found
    assert idle.num_free_blocks == idle.num_total_blocks and idle.num_cached_blocks >= 4
    assert tokens == offline(split, system + ids(12, 903))
    assert shipped == 12 * split["token_bytes"]  # the four shared blocks were still there to reuse


def test_bad_cached_token_counts_are_refused_by_the_prefill_worker(split):
    from pdserve.testkit.workers import prefill_stub

    async def attempt(num_cached: int):
        channel, stub = prefill_stub(split["p"])
        async with channel:
            layout = (await stub.Info(pb.InfoRequest())).layout
            start = pb.PrefillRequest(request_id=f"bad-{num_cached}", prompt_token_ids=ids(40, 7), seed=1,
                                      kv_transport="grpc", transfer_id=1, num_cached_tokens=num_cached,
                                      sampling=pb.SamplingOptions(max_tokens=1))
            start.layout.CopyFrom(layout)
            with pytest.raises(Exception) as refused:
                async for _ in stub.Prefill(iter([pb.PrefillClientMessage(start=start)])):
                    pass
            return refused.value

    for bad in (40, 48, 5):  # the whole prompt, past it, not whole blocks
        error = asyncio.run(attempt(bad))
        assert "num_cached_tokens" in error.details() and error.code().name == "INVALID_ARGUMENT"
