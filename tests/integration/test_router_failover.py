"""The router's decode leg when its worker goes away mid-stream, over real worker processes
and real gRPC: a worker that leaves the router's membership (the registry closes its channel,
which cancels the open calls) ends the request with an error the client is told, never an
unhandled cancellation that cuts the HTTP stream."""

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from router.app import Router, RouterConfig
from router.cache_index import PromptKeys
from router.generation import Generation, GenerationError
from router.registry import WorkerRegistry
from testkit.workers import SECURITY, WorkerProcess

PROMPT = list(range(7, 47))


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model) as d:
        yield p, d


def test_a_decode_worker_leaving_mid_stream_fails_the_request_cleanly(workers, tiny_llama_dir):
    prefill, decode = workers
    members = [{"role": "prefill", "worker_id": "p1", "address": prefill.address, "state": "ready"},
               {"role": "decode", "worker_id": "d1", "address": decode.address, "state": "ready"}]

    async def source():
        return list(members)

    async def scenario():
        config = RouterConfig(model=str(tiny_llama_dir), served_model_name="tiny", security=SECURITY)
        router = Router(config, WorkerRegistry(source, SECURITY))
        await router.start()
        prompt = PromptKeys(PROMPT)
        generation = Generation(router, "leaves", prompt, SamplingParams(max_tokens=400, ignore_eos=True),
                                router.route_request(prompt, None))
        received = []
        try:
            with pytest.raises(GenerationError) as failed:
                async for delta in generation.deltas():
                    received.extend(delta.token_ids)
                    if len(received) >= 3 and len(members) == 2:
                        members.pop()  # the decode worker leaves the pool
                        await router.registry.refresh()
        finally:
            await router.registry.stop()
        return received, str(failed.value)

    received, message = asyncio.run(scenario())
    assert 3 <= len(received) < 400
    assert "decode worker" in message
