"""Prefill on one process, decode on another, KV moved between them (real processes, real
gRPC, each transport, fp32 and bf16 KV): token identity with the offline engine in the same
dtype. Peers in different dtypes refuse to pair, and the request is prefilled locally."""

import asyncio
import random

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.testkit.workers import WorkerProcess, collect, decode_stub, generate_request, prefill_stub, wait_idle

PREFILL_ARGS = ("--max-num-batched-tokens", "32")  # prompts span several chunks


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cluster(request, tiny_llama_dir):
    model, dtype = str(tiny_llama_dir), request.param
    with WorkerProcess("prefill", model, "--dtype", dtype, *PREFILL_ARGS) as p1, \
            WorkerProcess("prefill", model, "--dtype", dtype, *PREFILL_ARGS) as p2, \
            WorkerProcess("decode", model, "--dtype", dtype) as d:
        yield {"model": model, "dtype": dtype, "prefill": [p1, p2], "decode": d}


def workload(seed: int, n: int, sampled: bool):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 49152) for _ in range(rng.randint(40, 150))]
        params = dict(max_tokens=rng.randint(5, 20), temperature=0.8 if sampled else 0.0,
                      seed=100 + i if sampled else None, top_p=0.9 if sampled else 1.0)
        out.append((ids, params))
    return out


def offline(model: str, requests, dtype: str) -> list[list[int]]:
    llm = LLM(model, dtype=dtype)
    params = [SamplingParams(ignore_eos=True, **{k: v for k, v in p.items() if v is not None})
              for _, p in requests]
    return [o.token_ids for o in llm.generate([ids for ids, _ in requests], params)]


async def run_disaggregated(cluster, requests, transport: str, tag: str):
    channel, stub = decode_stub(cluster["decode"].address)
    prefill = [p.address for p in cluster["prefill"]]
    async with channel:
        calls = [collect(stub, generate_request(f"{tag}-{i}", ids, prefill=prefill[i % 2:] + prefill[:i % 2],
                                                transport=transport, **params))
                 for i, (ids, params) in enumerate(requests)]
        results = await asyncio.gather(*calls)
        stats = await wait_idle(stub)
    return results, stats


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("transport", ["torch", "grpc"])
def test_disaggregated_matches_offline_engine(cluster, transport, sampled):
    requests = workload(seed=3 if sampled else 4, n=8, sampled=sampled)
    expected = offline(cluster["model"], requests, cluster["dtype"])
    results, decode_stats = asyncio.run(run_disaggregated(cluster, requests, transport, f"{transport}-{sampled}"))
    for i, ((tokens, finish, prefilled_by), want) in enumerate(zip(results, expected, strict=True)):
        assert prefilled_by not in ("", "local"), f"request {i} was not prefilled remotely"
        assert finish == "length"
        assert tokens == want, f"request {i}: disaggregated {tokens} != offline {want}"
    assert decode_stats.num_free_blocks == decode_stats.num_total_blocks

    async def prefill_idle():
        out = []
        for p in cluster["prefill"]:
            channel, stub = prefill_stub(p.address)
            async with channel:
                out.append(await wait_idle(stub))
        return out

    for stats in asyncio.run(prefill_idle()):
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_finished > 0


@pytest.mark.parametrize("transport", ["torch", "grpc"])
def test_peers_in_different_dtypes_refuse_to_pair(tiny_llama_dir, transport):
    """A bf16 decode worker and an fp32 prefill worker: the decode worker refuses the leg
    naming the dtypes and what to do, prefills locally (bf16 tokens), and nothing leaks."""
    model = str(tiny_llama_dir)
    ids, params = workload(seed=5, n=1, sampled=False)[0]
    expected = offline(model, [(ids, params)], "bfloat16")[0]
    with WorkerProcess("prefill", model, "--dtype", "float32") as p, \
            WorkerProcess("decode", model, "--dtype", "bfloat16") as d:
        async def scenario():
            channel, stub = decode_stub(d.address)
            async with channel:
                result = await collect(stub, generate_request("mixed", ids, prefill=[p.address],
                                                              transport=transport, **params))
                return result, await wait_idle(stub)

        (tokens, finish, prefilled_by), stats = asyncio.run(scenario())
        log = d.log()
    assert prefilled_by == "local" and tokens == expected and finish == "length"
    assert "dtype: bfloat16 vs float32" in log and "give both pools the same engine dtype" in log
    assert stats.num_free_blocks == stats.num_total_blocks
