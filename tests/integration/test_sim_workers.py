"""Simulated workers (`--model sim`) as processes: a prompt prefilled by a prefill worker and
decoded by a decode worker, its KV shipped over each real transport, gives the offline
simulated engine's tokens; the KV shipped is the real model's size, or with
`--no-sim-kv-bytes` a stand-in of one element per token and layer; and a simulated worker
does not hold its KV budget in memory."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import SIM_MODEL
from pdserve.engine.model.llama import ModelShape
from pdserve.protos import pdserve_pb2 as pb
from pdserve.testkit.workers import WorkerProcess, collect, decode_stub, generate_request, wait_idle

KV_BUDGET_BYTES = 2 << 30  # the CPU default
SIM_ARGS = ("--sim-speed", "20", "--dtype", "float32", "--kv-cache-bytes", str(KV_BUDGET_BYTES))
FLOAT32_BYTES = 4


@pytest.fixture(scope="module")
def shape(smollm2_dir) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.from_hf_config(AutoConfig.from_pretrained(str(smollm2_dir)))


@pytest.fixture(scope="module", params=[True, False], ids=["kv-bytes", "stand-in"])
def pair(request):
    kv_flag = "--sim-kv-bytes" if request.param else "--no-sim-kv-bytes"
    with WorkerProcess("prefill", SIM_MODEL, *SIM_ARGS, kv_flag) as p, \
            WorkerProcess("decode", SIM_MODEL, *SIM_ARGS, kv_flag) as d:
        yield {"kv_bytes": request.param, "prefill": p, "decode": d}


def received_bytes(stats, transport: str) -> int:
    return sum(t.bytes for t in stats.transfers if t.transport == transport and t.direction == "receive")


@pytest.mark.parametrize("transport", ["torch", "grpc"])
def test_disaggregated_simulated_workers_ship_kv_of_the_layouts_size_and_give_the_offline_tokens(
        pair, shape, transport):
    prompt = list(range(7000 + len(transport), 7200 + len(transport)))  # new to both workers' caches
    sampling = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "seed": 31}
    [expected] = LLM(SIM_MODEL, sim={"speed": 1000.0}).generate(
        [prompt], SamplingParams(ignore_eos=True, **sampling))

    async def serve():
        channel, stub = decode_stub(pair["decode"].address)
        async with channel:
            before = received_bytes(await stub.Stats(pb.StatsRequest()), transport)
            result = await collect(stub, generate_request(f"{transport}-{pair['kv_bytes']}", prompt,
                                                          prefill=[pair["prefill"].address], transport=transport,
                                                          **sampling))
            return result, received_bytes(await wait_idle(stub), transport) - before

    (tokens, finish, prefilled_by), shipped = asyncio.run(serve())
    assert prefilled_by and finish == "length"
    assert tokens == expected.outputs[0].token_ids
    heads, dim = (shape.num_kv_heads, shape.head_dim) if pair["kv_bytes"] else (1, 1)
    assert shipped == len(prompt) * shape.num_layers * 2 * heads * dim * FLOAT32_BYTES


def test_a_simulated_worker_does_not_hold_its_kv_budget_in_memory(pair):
    for worker in (pair["prefill"], pair["decode"]):
        rss = psutil.Process(worker.proc.pid).memory_info().rss
        print(f"{worker.role} worker (kv_bytes={pair['kv_bytes']}): RSS {rss / 2**20:.0f} MiB")
        assert rss < KV_BUDGET_BYTES / 2
