"""The bare router (`python -m pdserve.router`, no Ray) over real worker processes and real gRPC:
the round-robin policy, a client hanging up on a non-streaming request, admin disabled."""

import asyncio
import json
import socket
import time

import pytest

from pdserve.testkit.workers import RouterProcess, WorkerProcess, stats_of, wait_idle_at
from tests.e2e.http import ABORTED, get, metric, post


@pytest.fixture(scope="module")
def bare(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model) as d1, \
            WorkerProcess("decode", model) as d2, \
            RouterProcess(model, [p.address], [d1.address, d2.address], "--routing", "round-robin",
                          env={"PDSERVE_ADMIN_TOKEN": None}) as router:
        yield {"router": router, "prefill": p, "decode": [d1, d2]}


def finished(bare) -> list[int]:
    async def all_stats():
        return [(await stats_of(d.address, "decode")).num_finished for d in bare["decode"]]

    return asyncio.run(all_stats())


def wait_finished(bare, total: int, timeout_s: float = 10.0) -> list[int]:
    """Per decode worker finished counts, once they add up to `total` (Stats may lag a step)."""
    deadline = time.monotonic() + timeout_s
    while sum(counts := finished(bare)) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    return counts


def test_round_robin_alternates_the_decode_workers(bare):
    url, served_by = bare["router"].url, []
    for i in range(6):
        before = finished(bare)
        status, out, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7 + i], "max_tokens": 3,
                                                        "ignore_eos": True})
        assert status == 200 and out["usage"]["completion_tokens"] == 3, out
        after = wait_finished(bare, sum(before) + 1)
        delta = [a - b for a, b in zip(after, before, strict=True)]
        assert sorted(delta) == [0, 1], delta
        served_by.append(delta.index(1))
    # least-loaded would send every one of these sequential requests to the same idle worker
    assert served_by in ([0, 1] * 3, [1, 0] * 3), served_by


def test_a_client_hanging_up_on_a_non_streaming_request_aborts_it_quietly(bare):
    router = bare["router"]
    aborted, before = metric(router.url, ABORTED), finished(bare)
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5000, "ignore_eos": True}).encode()

    async def running_anywhere() -> bool:
        return any([(await stats_of(d.address, "decode")).num_running for d in bare["decode"]])

    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 20
        while not asyncio.run(running_anywhere()):  # ~1000 tokens to go: hang up mid-generation
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.05)

    async def all_idle():
        workers = [(d.address, "decode") for d in bare["decode"]] + [(bare["prefill"].address, "prefill")]
        return [await wait_idle_at(address, role) for address, role in workers]

    for stats in asyncio.run(all_idle()):
        assert stats.num_free_blocks == stats.num_total_blocks and not stats.num_running, stats
    deadline = time.monotonic() + 10
    while metric(router.url, ABORTED) < aborted + 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(router.url, ABORTED) == aborted + 1
    assert finished(bare) == before, "the request ran to its end instead of being aborted"
    log = router.log()
    assert "Exception in ASGI application" not in log and "Traceback" not in log, log[-3000:]


def test_admin_endpoints_are_disabled_without_an_admin_token(bare):
    url = bare["router"].url
    for headers in ({}, {"Authorization": "Bearer anything"}):
        status, out, _ = post(url + "/admin/scale", "{not json", headers)
        assert status == 403 and "admin endpoints are disabled" in out["error"]["message"], out
        status, text = get(url + "/admin/status", headers)
        assert status == 403, text
