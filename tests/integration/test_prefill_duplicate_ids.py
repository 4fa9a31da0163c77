"""Two Prefill streams with the same request id at once on a real prefill worker (the test
plays the decode worker's side of the stream): the second is refused with ALREADY_EXISTS
naming the id, the first is unaffected, and nothing leaks."""

import asyncio
import datetime
import random

import grpc
import pytest

from pdserve.protos import pdserve_pb2 as pb
from pdserve.testkit.workers import WorkerProcess, prefill_stub, wait_idle


@pytest.fixture(scope="module")
def prefill(tiny_llama_dir):
    # 8-token chunks: a 600-token prompt takes 75 steps, time enough for a second stream to arrive
    with WorkerProcess("prefill", str(tiny_llama_dir), "--max-num-batched-tokens", "8",
                       "--kv-transfer-timeout-s", "3") as p:
        yield p


def start_message(layout: pb.KVLayout, request_id: str, seed: int, transport: str, endpoint: str = ""):
    rng = random.Random(seed)
    start = pb.PrefillRequest(request_id=request_id, prompt_token_ids=[rng.randrange(3, 49152) for _ in range(600)],
                              sampling=pb.SamplingOptions(max_tokens=1, temperature=0), seed=seed,
                              kv_transport=transport, transfer_id=seed, kv_endpoint=endpoint)
    start.layout.CopyFrom(layout)
    return pb.PrefillClientMessage(start=start)


async def refused(stub, message) -> grpc.aio.AioRpcError:
    call = stub.Prefill()
    await call.write(message)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    return info.value


async def until(stub, predicate, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate(await stub.Stats(pb.StatsRequest())):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_duplicate_mid_prefill_is_refused_and_the_first_completes(prefill):
    async def scenario():
        channel, stub = prefill_stub(prefill.address)
        async with channel:
            layout = (await stub.Info(pb.InfoRequest())).layout
            message = start_message(layout, "dup-grpc", 1, "grpc")
            first = stub.Prefill()
            await first.write(message)
            await until(stub, lambda s: s.num_running == 1 and s.queued_prefill_tokens > 0)
            error = await refused(stub, message)
            shipped, done = 0, None
            while done is None:
                reply = await first.read()
                assert reply is not grpc.aio.EOF, "the first stream ended without `done`"
                if reply.HasField("done"):
                    done = reply.done
                elif reply.kv.layer == 0:
                    shipped += reply.kv.num_tokens
            await first.write(pb.PrefillClientMessage(ack=pb.KVAck(transfer_id=1, ok=True)))
            await first.done_writing()
            assert await first.read() is grpc.aio.EOF
            return error, shipped, done, await wait_idle(stub)

    error, shipped, done, stats = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "'dup-grpc' is in use" in error.details()
    assert shipped == 600 and done.num_prompt_tokens == 600  # the first stream got all of its KV
    assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_running and not stats.num_waiting


def test_a_duplicate_while_the_first_joins_its_kv_pair_is_refused(prefill):
    """The first stream waits to join the decode worker's torch pair (a rendezvous store that
    nobody completes stands in for a slow one) before its request reaches the engine."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))

    async def scenario():
        channel, stub = prefill_stub(prefill.address)
        async with channel:
            layout = (await stub.Info(pb.InfoRequest())).layout
            message = start_message(layout, "dup-torch", 2, "torch", f"127.0.0.1:{store.port}/pair?piece_tokens=8")
            first = stub.Prefill()
            await first.write(message)
            await until(stub, lambda s: s.num_running == 1)
            error = await refused(stub, message)
            first.cancel()
            return error, await wait_idle(stub)

    error, stats = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "'dup-torch' is in use" in error.details()
    assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_running and not stats.num_waiting
