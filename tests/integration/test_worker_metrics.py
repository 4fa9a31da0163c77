"""Each worker's own metrics, exported by the router from the workers' Stats, over real
workers, a real router and real HTTP: engine steps and batch sizes, the positions each
worker computed, and KV transfers per transport and direction (bytes, seconds, failures
by reason), with figures derived from the requests sent."""

import asyncio
import random
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.kv_transfer.layout import KVLayout
from pdserve.protos import pdserve_pb2 as pb
from pdserve.testkit.workers import collect, decode_stub, free_port, generate_request, serving_path
from tests.e2e.http import get, post

REQUESTS, PROMPT_TOKENS, MAX_TOKENS = 3, 40, 5


def _samples(url: str) -> dict[tuple[str, frozenset], float]:
    status, text = get(url + "/metrics")
    assert status == 200, text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def _wait_for(url: str, check, timeout_s: float = 20.0) -> dict:
    """The router's samples once `check(samples)` holds (it refreshes workers' Stats every
    health interval)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = _samples(url)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.3)


@pytest.fixture(scope="module", params=["remote-torch", "remote-grpc"])
def served(request, tiny_llama_dir):
    with serving_path(str(tiny_llama_dir), request.param) as served:
        served["transport"] = request.param.removeprefix("remote-")
        yield served


def test_each_worker_reports_its_steps_positions_and_transfers(served):
    url, transport = served["url"], served["transport"]
    rng = random.Random(7)
    for _ in range(REQUESTS):  # distinct prompts: nothing cached, every position computed
        prompt = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
        status, out, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                        "ignore_eos": True, "temperature": 0.0})
        assert status == 200 and out["choices"][0]["finish_reason"] == "length", out

    async def layout_and_ids():
        channel, stub = decode_stub(served["decode"].address)
        async with channel:
            info = await stub.Info(pb.InfoRequest())
            return KVLayout.from_proto(info.layout), info.worker_id

    layout, decode_id = asyncio.run(layout_and_ids())
    decode = {"pool": "decode", "worker": decode_id}
    # the decode worker computes every generated token's position but the last (the prefill
    # worker sampled the first token; the last one sampled is never fed back)
    decoded = REQUESTS * (MAX_TOKENS - 1)

    def caught_up(s: dict) -> bool:
        """Both workers' Stats, which the router refreshes each on its own, show every request:
        the decode worker's tokens, and each direction's transfers."""
        transfers = {direction: sum(value for (name, labels), value in s.items()
                                    if name == "pdserve_kv_transfer_seconds_count"
                                    and dict(labels).get("direction") == direction)
                     for direction in ("send", "receive")}
        return (_value(s, "pdserve_worker_decode_tokens_computed_total", **decode) >= decoded
                and min(transfers.values()) >= REQUESTS)

    samples = _wait_for(url, caught_up)
    [prefill_id] = {dict(labels)["worker"] for (name, labels) in samples
                    if name == "pdserve_worker_step_seconds_count" and dict(labels)["pool"] == "prefill"}
    prefill = {"pool": "prefill", "worker": prefill_id}
    assert _value(samples, "pdserve_worker_decode_tokens_computed_total", **decode) == decoded
    assert _value(samples, "pdserve_worker_prefill_tokens_computed_total", **prefill) == REQUESTS * PROMPT_TOKENS
    assert _value(samples, "pdserve_worker_prefill_tokens_computed_total", **decode) == 0
    for worker in (prefill, decode):
        steps = _value(samples, "pdserve_worker_step_seconds_count", **worker)
        assert steps >= REQUESTS and _value(samples, "pdserve_worker_step_seconds_sum", **worker) > 0
        assert _value(samples, "pdserve_worker_batch_size_count", **worker) == steps
        assert _value(samples, "pdserve_worker_step_seconds_bucket", **worker, le="+Inf") == steps
    # one engine step per generated position at most, each with one sequence here
    assert _value(samples, "pdserve_worker_batch_size_sum", **decode) == decoded
    shipped = REQUESTS * layout.kv_bytes(PROMPT_TOKENS)
    for worker, direction in ((prefill, "send"), (decode, "receive")):
        labels = {**worker, "transport": transport, "direction": direction}
        assert _value(samples, "pdserve_kv_transfer_worker_bytes_total", **labels) == shipped, direction
        assert _value(samples, "pdserve_kv_transfer_seconds_count", **labels) == REQUESTS, direction
        seconds = _value(samples, "pdserve_kv_transfer_seconds_sum", **labels)
        assert seconds > 0
        assert _value(samples, "pdserve_kv_transfer_bandwidth_bytes_per_second", **labels) == pytest.approx(
            shipped / seconds)
    kv = {name: _value(samples, "pdserve_worker_kv_blocks", **decode, state=name)
          for name in ("used", "cached", "free")}
    assert sum(kv.values()) > 0 and kv["used"] == 0, kv  # idle: every block free, some holding cached prompts


def test_a_failed_transfer_is_counted_by_reason(served):
    """A prefill leg to an address where nothing listens: counted on the decode worker as a
    receive failure with gRPC's reason; the request still completes (prefilled locally)."""
    url, transport = served["url"], served["transport"]

    async def scenario():
        channel, stub = decode_stub(served["decode"].address)
        async with channel:
            worker_id = (await stub.Info(pb.InfoRequest())).worker_id
            request = generate_request("dead-peer", list(range(5, 30)), 3, [f"127.0.0.1:{free_port()}"], transport)
            return worker_id, await collect(stub, request)

    worker_id, (tokens, finish, prefilled_by) = asyncio.run(scenario())
    assert len(tokens) == 3 and finish == "length" and prefilled_by == "local"
    labels = {"pool": "decode", "worker": worker_id, "transport": transport, "direction": "receive",
              "reason": "unavailable"}
    samples = _wait_for(url, lambda s: _value(s, "pdserve_kv_transfer_failures_total", **labels) >= 1)
    assert _value(samples, "pdserve_kv_transfer_failures_total", **labels) == 1
