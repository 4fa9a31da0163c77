"""A misbehaving prefill peer (a test double standing in for the prefill worker, to test the
real decode worker's boundary): wrong layout, wrong byte counts, unknown transfer ids, a
truncated stream, an oversized torch header, a first token's logprob missing or malformed.
Each is rejected with a clear error, the request still completes (prefilled locally) with
the right tokens, and nothing leaks."""

import asyncio

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.torch_transport import TorchTransport
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos import pdserve_pb2_grpc as pb_grpc
from pdserve.rpc.channel import new_server
from pdserve.testkit.workers import SECURITY, WorkerProcess, collect, decode_stub, generate_request, wait_idle

PROMPT = list(range(100, 160))


class MisbehavingPrefill(pb_grpc.PrefillWorkerServicer):
    def __init__(self, layout: KVLayout, mode: str) -> None:
        self.layout, self.mode = layout, mode

    async def Info(self, request, context):
        info = pb.WorkerInfo(worker_id=f"fake-{self.mode}", role="prefill", kv_transports=["torch", "grpc"])
        layout = self.layout
        if self.mode == "wrong_layout":
            layout = KVLayout(layout.num_layers, layout.block_size * 2, layout.num_kv_heads,
                              layout.head_dim, layout.dtype)
        layout.to_proto(info.layout)
        return info

    async def Prefill(self, request_iterator, context):
        start = (await anext(aiter(request_iterator))).start
        n, tid = len(start.prompt_token_ids), start.transfer_id
        good = b"\0" * (n * self.layout.token_bytes)
        if self.mode == "wrong_bytes":
            yield pb.PrefillServerMessage(kv=pb.KVChunk(transfer_id=tid, layer=0, token_start=0,
                                                        num_tokens=n, data=good[:-4]))
        elif self.mode == "unknown_transfer":
            yield pb.PrefillServerMessage(kv=pb.KVChunk(transfer_id=tid + 999, layer=0, token_start=0,
                                                        num_tokens=n, data=good))
        elif self.mode == "truncated":
            yield pb.PrefillServerMessage(kv=pb.KVChunk(transfer_id=tid, layer=0, token_start=0,
                                                        num_tokens=n, data=good))
            return  # the stream ends without the other layers or `done`
        elif self.mode == "oversized_torch":
            transport = TorchTransport("fake", self.layout, "cpu", max_piece_tokens=16)
            sender = await asyncio.to_thread(transport.connect, start.kv_endpoint)
            import torch

            header = torch.tensor([tid, 0, 0, 1, 10**12], dtype=torch.int64)
            await asyncio.to_thread(lambda: sender.group.send([header], 0, 0).wait())
        first_token = 4_000_000_000 if self.mode == "bad_first_token" else 7
        done = pb.PrefillDone(first_token=first_token, num_prompt_tokens=n, prefill_worker_id="fake")
        if self.mode == "positive_logprob":  # a request asking for 2 alternatives
            done.first_logprob.CopyFrom(pb.TokenLogprob(logprob=0.5, top_token_ids=[7, 8], top_logprobs=[-1, -2]))
        elif self.mode == "short_top_logprobs":
            done.first_logprob.CopyFrom(pb.TokenLogprob(logprob=-0.5, top_token_ids=[7], top_logprobs=[-0.5]))
        elif self.mode == "missing_prompt_logprobs":  # a request asking for prompt logprobs: one short
            done.prompt_logprobs.extend([pb.TokenLogprob(logprob=-1.0)] * (n - 2))
        yield pb.PrefillServerMessage(done=done)
        await anext(aiter(request_iterator), None)


@pytest.fixture(scope="module")
def decode(tiny_llama_dir):
    # caching off: every mode must reach the transfer with the whole prompt to ship
    with WorkerProcess("decode", str(tiny_llama_dir), "--kv-transfer-timeout-s", "5",
                       "--no-enable-prefix-caching") as d:
        yield d


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    out = LLM(str(tiny_llama_dir)).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return out[0].token_ids


@pytest.mark.parametrize(
    ("mode", "transport", "logged"),
    [
        ("wrong_layout", "grpc", "KV layouts differ (block_size: 16 vs 32)"),
        # the byte count check's own message (kv_transfer.reservations.write_bytes), filled in below
        ("wrong_bytes", "grpc", "payload of {short} bytes; expected {full} for {n} tokens"),
        ("unknown_transfer", "grpc", "stream carried transfer"),
        ("truncated", "grpc", "closed the stream before finishing"),
        ("oversized_torch", "torch", "KV connection to prefill worker lost"),
        ("bad_first_token", "grpc", "sent first token 4000000000, outside the vocabulary"),
        ("missing_logprob", "grpc", "sent no logprob for the first token of a request that asked"),
        ("positive_logprob", "grpc", "sent bad logprobs: a logprob is positive or NaN"),
        ("short_top_logprobs", "grpc", "sent bad logprobs: a token's logprobs carry 1 ids and 1 values, expected 2"),
        ("missing_prompt_logprobs", "grpc", f"sent {len(PROMPT) - 2} prompt logprobs for a prompt of {len(PROMPT)} "
                                            f"tokens (expected {len(PROMPT) - 1})"),
    ],
)
def test_malformed_kv_is_rejected_and_the_request_still_completes(decode, expected, mode, transport, logged):
    log_start = decode.log_offset()  # the module's worker logs every case: look at this one's lines only

    async def scenario():
        d_channel, d_stub = decode_stub(decode.address)
        async with d_channel:
            layout = KVLayout.from_proto((await d_stub.Info(pb.InfoRequest())).layout)
            before = await d_stub.Stats(pb.StatsRequest())
            server = new_server(SECURITY)
            pb_grpc.add_PrefillWorkerServicer_to_server(MisbehavingPrefill(layout, mode), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            try:
                asks = 2 if mode.endswith("logprob") or mode.endswith("top_logprobs") else None
                request = generate_request(f"bad-{mode}", PROMPT, 6, [f"127.0.0.1:{port}"], transport, logprobs=asks)
                if mode == "missing_prompt_logprobs":
                    request.sampling.prompt_logprobs = 0
                result = await collect(d_stub, request)
                stats = await wait_idle(d_stub)
            finally:
                await server.stop(0)
            return result, before, stats, layout

    (tokens, finish, prefilled_by), before, stats, layout = asyncio.run(scenario())
    assert prefilled_by == "local", "the bad leg must be abandoned for a local prefill"
    assert tokens == expected and finish == "length"
    assert stats.num_free_blocks == stats.num_total_blocks
    # the worker's counters are cumulative over the module: this case's one leg (one prefill
    # address offered) must have failed and been replaced by a local prefill
    failed = stats.num_failed_transfers - before.num_failed_transfers
    assert failed == 1, f"{failed} failed legs counted in this case ({stats.num_failed_transfers} in all)"
    fell_back = stats.prefill_decisions.get("local/remote_failed", 0) - before.prefill_decisions.get(
        "local/remote_failed", 0)
    assert fell_back == 1, (before.prefill_decisions, stats.prefill_decisions)
    full = len(PROMPT) * layout.token_bytes  # the fake sends this many bytes less 4 in "wrong_bytes"
    logged = logged.format(short=full - 4, full=full, n=len(PROMPT))
    case_log = decode.log_since(log_start)
    assert logged in case_log, case_log[-4000:]
