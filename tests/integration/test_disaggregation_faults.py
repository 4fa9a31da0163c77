"""Aborts at every stage, a prefill worker killed or hung mid-leg, and a misbehaving prefill
peer: nothing leaks, nothing hangs, the decode worker keeps serving."""

import asyncio
import contextlib
import random
import signal
import socket
import time

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.testkit.workers import WorkerProcess, collect, decode_stub, generate_request, prefill_stub, wait_idle

BLOCK_BYTES = 8192  # tiny model: 2 layers x K,V x 16 tokens x 2 kv heads x 16 dims x fp32


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    model = str(tiny_llama_dir)
    # the decode worker holds 80 blocks (1280 tokens): a long request makes others queue; a
    # prefill leg may take 30 s before it is abandoned (a hung peer holds its blocks that long)
    with WorkerProcess("prefill", model, "--dtype", "float32", "--max-num-batched-tokens", "8") as slow_p, \
            WorkerProcess("decode", model, "--dtype", "float32", "--kv-cache-bytes", str(80 * BLOCK_BYTES),
                          "--kv-transfer-timeout-s", "30") as d:
        yield {"model": model, "p": slow_p, "d": d}


def ids_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


async def assert_idle(*addresses_and_kinds):
    for address, kind in addresses_and_kinds:
        channel, stub = (decode_stub if kind == "d" else prefill_stub)(address)
        async with channel:
            stats = await wait_idle(stub)
        assert stats.num_free_blocks == stats.num_total_blocks, f"{kind} leaked blocks: {stats}"
        assert not stats.num_running and not stats.num_waiting and not stats.num_waiting_for_kv, stats


async def poll(stub, predicate, timeout_s: float = 20.0):
    from pdserve.protos import pdserve_pb2 as pb

    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        stats = await stub.Stats(pb.StatsRequest())
        if predicate(stats):
            return stats
        seen.append(stats)
        await asyncio.sleep(0.005)
    raise AssertionError(f"condition not reached; first and last stats seen: {seen[0]} ... {seen[-1]}")


@contextlib.contextmanager
def silent_peer():
    """An address that accepts TCP connections and never says a word (a hung peer)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


LONG = 5000  # capped by max_model_len (1024): each request here has hundreds of tokens to go when aborted


@pytest.mark.parametrize("how", ["cancel", "abort_rpc"])
@pytest.mark.parametrize("transport", ["torch", "grpc"])
def test_abort_at_every_stage_frees_both_sides(workers, transport, how):
    """Every request asks for more tokens than it can make before being aborted, so it ends
    only by the abort: its stream ends with "abort" (Abort RPC), the decode worker counts no
    finished request, and both workers end with every block free."""
    from pdserve.protos import pdserve_pb2 as pb

    d, p = workers["d"].address, workers["p"].address
    # prompts of their own: no prefix cached by an earlier case may shorten a stage
    seed = 1000 * (2 * ["torch", "grpc"].index(transport) + ["cancel", "abort_rpc"].index(how))

    async def abort(stub, call, request_id):
        if how == "cancel":
            call.cancel()
            return
        deadline = time.monotonic() + 20
        # Generate and Abort race on the channel: until the worker has the request, Abort finds nothing
        while not (await stub.Abort(pb.AbortRequest(request_id=request_id))).found:
            assert time.monotonic() < deadline, f"{request_id} never reached the decode worker"
            await asyncio.sleep(0.005)
        last = None
        while (chunk := await call.read()) is not grpc.aio.EOF:
            last = chunk
        assert last is not None and last.finish_reason == "abort", last

    async def scenario():
        d_channel, d_stub = decode_stub(d)
        p_channel, p_stub = prefill_stub(p)
        async with d_channel, p_channel:
            finished = (await wait_idle(d_stub)).num_finished
            # 1. decoding: a long request (600 prompt tokens, up to 424 more), aborted after its first token
            rid = f"dec-{how}-{transport}"
            call = d_stub.Generate(generate_request(rid, ids_of(600, seed + 1), LONG, [p], transport))
            await call.read()
            await abort(d_stub, call, rid)
            await assert_idle((d, "d"), (p, "p"))
            # 2. queued for blocks: a holder keeps 38 of the 80 blocks reserved while its prefill
            # leg waits on a peer that accepts connections and never answers (for 10 s, the deadline
            # of the decode worker's first call to a new peer), so a 700-token request (44 blocks) must queue until
            # the test aborts it: no race with a request finishing on its own
            with silent_peer() as silent:
                holder = d_stub.Generate(generate_request(f"hold-{how}-{transport}", ids_of(600, seed + 2), LONG,
                                                          [silent], transport))
                await poll(d_stub, lambda s: s.num_waiting_for_kv >= 1)
                queued = d_stub.Generate(generate_request(f"q-{how}-{transport}", ids_of(700, seed + 4), LONG, [p],
                                                          transport))
                await poll(d_stub, lambda s: s.num_waiting >= 1)
                await abort(d_stub, queued, f"q-{how}-{transport}")
                await abort(d_stub, holder, f"hold-{how}-{transport}")
                await assert_idle((d, "d"), (p, "p"))
            # 3. prefilling on the prefill worker (8-token chunks of a 900-token prompt)
            rid = f"pf-{how}-{transport}"
            call = d_stub.Generate(generate_request(rid, ids_of(900, seed + 3), LONG, [p], transport))
            await poll(p_stub, lambda s: s.num_running >= 1 and s.queued_prefill_tokens > 0)
            await abort(d_stub, call, rid)
            await assert_idle((d, "d"), (p, "p"))
            # 4. every other moment, transfers included: abort after a sweep of delays
            for i, delay in enumerate([0.0, 0.01, 0.03, 0.06, 0.1, 0.15, 0.25, 0.4]):
                rid = f"sweep-{how}-{transport}-{i}"
                call = d_stub.Generate(generate_request(rid, ids_of(120, seed + 10 + i), LONG, [p], transport))
                await asyncio.sleep(delay)
                await abort(d_stub, call, rid)
            await assert_idle((d, "d"), (p, "p"))
            stats = await d_stub.Stats(pb.StatsRequest())
        assert stats.num_finished == finished, "a request ran to its end instead of being aborted"

    asyncio.run(scenario())


def test_killed_prefill_worker_fails_over_and_decode_keeps_serving(tiny_llama_dir):
    from pdserve.protos import pdserve_pb2 as pb

    model = str(tiny_llama_dir)
    requests = [(ids_of(300 + 20 * i, 40 + i), 8) for i in range(4)]
    llm = LLM(model)
    expected = [o.token_ids for o in llm.generate(
        [ids for ids, _ in requests], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                       for _, n in requests])]
    with WorkerProcess("prefill", model, "--max-num-batched-tokens", "8") as victim, \
            WorkerProcess("prefill", model) as backup, \
            WorkerProcess("decode", model, "--kv-transfer-timeout-s", "5") as d:

        async def scenario():
            d_channel, d_stub = decode_stub(d.address)
            v_channel, v_stub = prefill_stub(victim.address)
            async with d_channel, v_channel:
                victim_id = (await v_stub.Info(pb.InfoRequest())).worker_id
                calls = [asyncio.ensure_future(collect(d_stub, generate_request(
                    f"kill-{i}", ids, n, [victim.address, backup.address])))
                    for i, (ids, n) in enumerate(requests)]
                await poll(v_stub, lambda s: s.num_running >= 2)
                victim.kill()  # mid-prefill / mid-transfer
                results = await asyncio.gather(*calls)
                after = await collect(d_stub, generate_request("after", ids_of(50, 99), 4, [backup.address]))
                await assert_idle((d.address, "d"), (backup.address, "p"))
                stats = await d_stub.Stats(pb.StatsRequest())
            return results, after, victim_id, stats

        results, after, victim_id, stats = asyncio.run(scenario())
        log = d.log_path.read_text()
    for (tokens, finish, prefilled_by), want in zip(results, expected, strict=True):
        assert finish == "length" and tokens == want  # completed on the retry path, same tokens
        assert prefilled_by not in (victim_id, "", "local")  # the backup prefilled it
    # each request's leg on the victim failed once, seen as a lost connection, not waited out to the deadline
    assert stats.num_failed_transfers == len(requests)
    assert log.count(f"prefill leg on {victim.address} failed") == len(requests), log[-3000:]
    assert "failed: TimeoutError" not in log, log[-3000:]
    assert after[1] == "length" and len(after[0]) == 4


def test_hung_prefill_worker_misses_the_deadline_and_is_abandoned(tiny_llama_dir):
    from pdserve.protos import pdserve_pb2 as pb

    model = str(tiny_llama_dir)
    with WorkerProcess("prefill", model) as hung, WorkerProcess("decode", model, "--kv-transfer-timeout-s", "2") as d:

        async def scenario():
            d_channel, d_stub = decode_stub(d.address)
            async with d_channel:
                hung.proc.send_signal(signal.SIGSTOP)
                try:
                    result = await collect(d_stub, generate_request("hung", ids_of(60, 5), 4, [hung.address]))
                finally:
                    hung.proc.send_signal(signal.SIGCONT)
                await assert_idle((d.address, "d"), (hung.address, "p"))
                stats = await d_stub.Stats(pb.StatsRequest())
            return result, stats

        (tokens, finish, prefilled_by), stats = asyncio.run(scenario())
        log = d.log_path.read_text()
    assert prefilled_by == "local" and finish == "length" and len(tokens) == 4
    # abandoned because it missed the leg's deadline (the stopped worker never answers)
    assert stats.num_failed_transfers == 1
    assert f"request_id=hung prefill leg on {hung.address} failed: TimeoutError" in log, log[-3000:]


def test_prefill_rejects_a_mismatched_layout(workers):
    from pdserve.protos import pdserve_pb2 as pb

    async def scenario():
        channel, stub = prefill_stub(workers["p"].address)
        async with channel:
            start = pb.PrefillRequest(request_id="bad-layout", prompt_token_ids=[5, 6, 7],
                                      sampling=pb.SamplingOptions(max_tokens=1), kv_transport="grpc",
                                      layout=pb.KVLayout(num_layers=2, block_size=32, num_kv_heads=2,
                                                         head_dim=16, dtype="float32"))
            call = stub.Prefill(iter([pb.PrefillClientMessage(start=start)]))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in call:
                    pass
            return info.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "block_size: 16 vs 32" in error.details()
