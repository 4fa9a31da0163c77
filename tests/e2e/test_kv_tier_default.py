"""The second KV tier on by default in a real service (Ray, the router, HTTP; settings left at
their defaults but for the store's directory, one per test service): both pools' workers run
it on the node's store, and a decode worker killed and replaced finds there what its
predecessor computed: the replacement loads the prompt's blocks instead of having them
prefilled again, and answers with the same tokens."""

import os
import random
import signal
import time

import pytest

from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import post

BLOCK = 16  # the engine's default block size


@pytest.fixture(scope="module")
def service_with_defaults(ray_cluster, tiny_llama_dir):
    controller, url = start_service(tiny_llama_dir)
    yield controller, url
    stop_service(controller)


def workers(controller, role: str) -> list[dict]:
    import ray

    return ray.get(controller.status.remote())["pools"][role]["workers"]


def wait_for(predicate, what: str, timeout_s: float = 120, state=lambda: None):
    deadline = time.monotonic() + timeout_s
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {state()}"
        time.sleep(0.2)
    return result


def complete(url: str, prompt: list[int], timeout_s: float = 60) -> dict:
    """The answer to `prompt`, asked again while the router has no decode worker (503: the
    replacement is ready before the router learns of it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, out, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0.0, "ignore_eos": True})
        if status != 503 or time.monotonic() > deadline:
            assert status == 200, out
            return out
        time.sleep(0.2)


def test_a_replaced_decode_worker_loads_its_predecessors_blocks_from_the_node_store(service_with_defaults):
    controller, url = service_with_defaults
    both = wait_for(lambda: [w for role in ("prefill", "decode") for w in workers(controller, role)
                             if w["state"] == "ready" and w["stats"]], "both pools' stats")
    assert len(both) == 2 and all(w["stats"]["kv_tier_store"] for w in both)  # the tier runs in both pools
    prompt = [random.Random(11).randrange(100, 40000) for _ in range(6 * BLOCK + 5)]
    reusable = (len(prompt) - 1) // BLOCK * BLOCK
    first = complete(url, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    [old] = workers(controller, "decode")
    wait_for(lambda: (s := workers(controller, "decode")[0]["stats"]) and s["kv_tier_store"].get("files", 0) >= 6
             and s["kv_tier_store"].get("queued_bytes", 1) == 0, "the prompt's blocks in the node's store",
             state=lambda: workers(controller, "decode")[0]["stats"]["kv_tier_store"])
    os.kill(old["pid"], signal.SIGKILL)
    [new] = wait_for(lambda: [w for w in workers(controller, "decode")
                              if w["worker_id"] != old["worker_id"] and w["state"] == "ready" and w["stats"]],
                     "a replacement decode worker")
    again = complete(url, prompt)
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == reusable
    hits = wait_for(lambda: [w["stats"]["kv_tier_hit_tokens"] for w in workers(controller, "decode")
                             if w["worker_id"] == new["worker_id"] and w["stats"]["kv_tier_hit_tokens"]],
                    "the replacement's tier hits in its stats")
    assert hits == [reusable]  # loaded from the store: its own pool started empty
