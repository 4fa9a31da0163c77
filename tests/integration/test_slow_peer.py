"""A decode worker that stops reading its KV (hung, not dead) fails only the prefill legs
shipping to it. The real prefill worker's engine thread gives up on that leg's piece after
`--kv-send-deadline-s`, the leg ends ABORTED naming the cause, and a request for another
decode worker, submitted while the hung one still holds its pair, completes with the right
tokens long before the pair's own timeout (300 s here). Nothing is left held afterwards."""

import asyncio
import subprocess
import sys

import grpc
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.protos import pdserve_pb2 as pb
from pdserve.testkit.workers import WorkerProcess, collect, decode_stub, generate_request, prefill_stub, wait_idle
from tests.integration.test_torch_transport import _HUNG_PEER

PROMPT = list(range(300, 340))
STUCK_PROMPT = list(range(1000, 1600))  # ~19 chunks of 32 tokens x 2 layers: far more pieces than staging


async def prefill_leg(stub, start: pb.PrefillRequest):
    """Open a Prefill stream as a decode worker would; returns (call, its message queue)."""
    messages: asyncio.Queue = asyncio.Queue()
    await messages.put(pb.PrefillClientMessage(start=start))

    async def outgoing():
        while (message := await messages.get()) is not None:
            yield message

    return stub.Prefill(outgoing()), messages


def test_a_hung_decode_peer_fails_only_its_own_leg(tiny_llama_dir):
    model = str(tiny_llama_dir)
    expected = LLM(model).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    hung = subprocess.Popen([sys.executable, "-c", _HUNG_PEER], stdout=subprocess.PIPE, text=True)
    try:
        endpoint = f"127.0.0.1:{hung.stdout.readline().strip()}/hung/1/key?piece_tokens=16"
        with WorkerProcess("prefill", model, "--kv-send-deadline-s", "2", "--kv-transfer-timeout-s", "300",
                           "--max-num-batched-tokens", "32") as p, \
                WorkerProcess("decode", model, "--kv-transfer-timeout-s", "300") as d:

            async def scenario():
                p_channel, p_stub = prefill_stub(p.address)
                d_channel, d_stub = decode_stub(d.address)
                async with p_channel, d_channel:
                    start = pb.PrefillRequest(
                        request_id="stuck", prompt_token_ids=STUCK_PROMPT, seed=1, transfer_id=1,
                        sampling=pb.SamplingOptions(max_tokens=1, temperature=0, ignore_eos=True),
                        kv_transport="torch", kv_endpoint=endpoint)
                    p_info = await p_stub.Info(pb.InfoRequest())
                    start.layout.CopyFrom(p_info.layout)
                    stuck, messages = await prefill_leg(p_stub, start)
                    other = await asyncio.wait_for(
                        collect(d_stub, generate_request("other", PROMPT, 8, [p.address])), timeout=120)
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        await asyncio.wait_for(anext(aiter(stuck)), timeout=120)
                    await messages.put(None)
                    hung.kill()  # the hung worker is replaced: its pair on the prefill worker breaks
                    after = await collect(d_stub, generate_request("after", PROMPT[1:], 4, [p.address]))
                    return (p_info.worker_id, other, failed.value, after, await wait_idle(p_stub, 60),
                            await wait_idle(d_stub, 60))

            p_id, (tokens, finish, prefilled_by), failed, after, p_idle, d_idle = asyncio.run(scenario())
            p_log = p.log()
    finally:
        hung.kill()
        hung.wait(30)
    assert finish == "length" and tokens == expected, "the other decode worker's request was served right"
    # not "local": a decode worker that gave up on the stalled prefill worker would pass otherwise
    assert prefilled_by == p_id, f"prefilled by {prefilled_by!r}, not on the prefill worker the hung peer stalls"
    assert failed.code() == grpc.StatusCode.ABORTED, failed
    assert "not reading" in failed.details() and "kv_send_deadline_s" in failed.details(), failed.details()
    assert after[1] == "length" and after[2] == p_id, "the prefill worker still serves after the hung peer went"
    assert p_idle.num_free_blocks == p_idle.num_total_blocks and not p_idle.num_running, p_idle
    assert d_idle.num_free_blocks == d_idle.num_total_blocks, d_idle
    assert "Traceback" not in p_log, p_log
