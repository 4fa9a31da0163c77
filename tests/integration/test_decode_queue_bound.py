"""A decode worker's queue of waiting requests (for KV blocks or a batch slot) is bounded: past
`--max-queued-requests` a new request is refused with RESOURCE_EXHAUSTED at once and changes
nothing; the router, with no other decode worker to try, answers 429 with Retry-After."""

import asyncio

import grpc
import pytest

from pdserve.protos import pdserve_pb2 as pb
from pdserve.testkit.workers import RouterProcess, WorkerProcess, collect, decode_stub, generate_request, wait_idle
from tests.e2e.http import post
from tests.integration.test_disaggregation_faults import poll, silent_peer

PROMPT = list(range(20, 60))


def test_past_max_queued_requests_a_request_is_refused_and_the_router_answers_429(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with WorkerProcess("decode", model, "--max-num-seqs", "1", "--max-queued-requests", "1") as d, \
            RouterProcess(model, [], [d.address]) as router, silent_peer() as silent:

        async def scenario():
            channel, stub = decode_stub(d.address)
            async with channel:
                # the holder's prefill leg waits on a peer that never answers: it holds the one
                # sequence slot until aborted, so the next request must queue for blocks
                holder = stub.Generate(generate_request("holder", PROMPT, 8, [silent]))
                await poll(stub, lambda s: s.num_waiting_for_kv == 1)
                queued = asyncio.ensure_future(collect(stub, generate_request("queued", PROMPT[1:], 4, [silent])))
                await poll(stub, lambda s: s.num_waiting == 1)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await collect(stub, generate_request("refused", PROMPT[2:], 4, []))
                http = await asyncio.to_thread(post, router.url + "/v1/completions",
                                               {"model": "tiny", "prompt": PROMPT[3:], "max_tokens": 4})
                still = await stub.Stats(pb.StatsRequest())
                holder.cancel()
                tokens, finish, _ = await queued
                return refused.value, http, still, (tokens, finish), await wait_idle(stub)

        refused, (status, body, headers), still, (tokens, finish), idle = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_requests" in refused.details()
    assert status == 429 and {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1", (status, body)
    assert "max_queued_requests" in body["error"]["message"]
    assert still.num_waiting == 1 and still.num_waiting_for_kv == 1, "a refused request changed the queue"
    assert finish == "length" and len(tokens) == 4, "the queued request still runs"
    assert idle.num_free_blocks == idle.num_total_blocks


def test_past_max_queued_requests_a_prefill_worker_refuses_and_the_decode_worker_prefills_itself(tiny_llama_dir):
    """A prefill worker holds at most `--max-queued-requests` legs open: one more is refused
    with RESOURCE_EXHAUSTED at once; a decode worker sent there prefills the request itself
    (right tokens); once the open leg ends, the prefill worker takes legs again."""
    from pdserve.engine import LLM, SamplingParams
    from pdserve.testkit.workers import prefill_stub
    from tests.integration.test_slow_peer import prefill_leg

    model = str(tiny_llama_dir)
    expected = LLM(model).generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    with WorkerProcess("prefill", model, "--max-queued-requests", "1") as p, WorkerProcess("decode", model) as d:

        async def scenario():
            p_channel, p_stub = prefill_stub(p.address)
            d_channel, d_stub = decode_stub(d.address)
            async with p_channel, d_channel:
                layout = (await p_stub.Info(pb.InfoRequest())).layout
                start = pb.PrefillRequest(request_id="open", prompt_token_ids=PROMPT, seed=1, transfer_id=1,
                                          sampling=pb.SamplingOptions(max_tokens=1, ignore_eos=True),
                                          kv_transport="grpc", layout=layout)
                held, messages = await prefill_leg(p_stub, start)
                async for message in held:  # KV chunks, then `done`; the leg waits for the ack
                    if message.HasField("done"):
                        break
                refused_start = pb.PrefillRequest(request_id="refused", prompt_token_ids=PROMPT[1:], seed=1,
                                                  transfer_id=2, kv_transport="grpc", layout=layout,
                                                  sampling=pb.SamplingOptions(max_tokens=1, ignore_eos=True))
                refused, refused_messages = await prefill_leg(p_stub, refused_start)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await anext(aiter(refused))
                await refused_messages.put(None)
                local = await collect(d_stub, generate_request("via-d", PROMPT, 4, [p.address]))
                await messages.put(pb.PrefillClientMessage(ack=pb.KVAck(transfer_id=1, ok=True)))
                await messages.put(None)
                await wait_idle(p_stub)
                remote = await collect(d_stub, generate_request("later", PROMPT, 4, [p.address]))
                return error.value, local, remote, await wait_idle(p_stub), await wait_idle(d_stub)

        error, local, remote, p_idle, d_idle = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_requests" in error.details()
    assert local[:2] == (expected, "length") and local[2] != remote[2], (local, remote)
    assert remote[:2] == (expected, "length") and remote[2] == p_idle.worker_id, remote
    assert p_idle.num_running == 0 and d_idle.num_free_blocks == d_idle.num_total_blocks
