"""Cache-aware routing on a real cluster of 2 prefill + 2 decode workers (their own caches;
the second KV tier off): a conversation stays on the decode worker holding its KV even when
that worker is the busier one, a hot shared prefix spreads once its worker is loaded, tokens
are what the offline engine makes, and workers that leave the pool leave the router's cache
index."""

import http.client
import json
import random
import time
import urllib.parse

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get, metric, post


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_llama_dir):
    # the workers' own caches only: with the second KV tier on (its default), the other decode
    # worker on this one node holds a conversation's history in the node's store as well, and
    # may rightly take a turn (tests/unit/test_kv_tier_routing.py weighs that case)
    no_tier = {"kv_tier": {"enabled": False}}
    controller, url = start_service(tiny_llama_dir, **{"prefill.replicas": 2, "decode.replicas": 2,
                                                       "prefill.engine": no_tier, "decode.engine": no_tier})
    # the router learns each worker's hash root on its first cache poll: wait for all four
    wait_for(lambda: len(status(controller)["routing"]["index"]) == 4, "the router's index tracks every worker")
    yield controller, url, str(tiny_llama_dir)
    stop_service(controller)


def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


BLOCK_SIZE = 16  # the engine's default, which the workers here run with


def ids_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def status(controller) -> dict:
    import ray

    return ray.get(controller.status.remote())


def held_blocks(controller) -> dict[str, dict[str, int]]:
    """Per pool, the blocks the router's index holds for each worker (as its CacheEvents
    reported them, not those it merely expects)."""
    state = status(controller)
    index = state["routing"]["index"]
    return {role: {w["worker_id"]: index.get(w["worker_id"], {}).get("held", 0) for w in pool["workers"]}
            for role, pool in state["pools"].items()}


def finished(controller, role: str = "decode") -> dict[str, int]:
    return {w["worker_id"]: w["stats"]["num_finished"] for w in status(controller)["pools"][role]["workers"]
            if w["stats"]}


def served_by(controller, before: dict[str, int], timeout_s: float = 10) -> str:
    """The one decode worker whose finished count grew by one since `before`."""
    deadline = time.monotonic() + timeout_s
    while True:
        grew = [w for w, n in finished(controller).items() if n > before.get(w, 0)]
        if len(grew) == 1 or time.monotonic() > deadline:
            assert len(grew) == 1, f"finished counts: before {before}, now {finished(controller)}"
            return grew[0]
        time.sleep(0.05)


class OpenStream:
    """A streaming completion held open (the request keeps running) until closed."""

    def __init__(self, url: str, body: dict) -> None:
        parts = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        self.conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                          {"content-type": "application/json"})
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        while not self.response.readline().startswith(b"data: "):  # the first token has come
            pass

    def read_to_end(self) -> None:
        self.response.read()

    def close(self) -> None:
        self.conn.close()  # the router sees the client go and aborts the request


def complete(url: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    code, out, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                                  **extra})
    assert code == 200, out
    return out


def test_a_conversation_stays_where_its_kv_is_even_when_that_worker_is_busier(pool):
    """Before each turn a long request sharing the conversation's prefix is opened (it lands
    with the conversation and stays running), so the conversation's decode worker is the
    busier of the two: least-loaded would move the turn, cache-aware keeps it (its cached
    history is worth more than one open request) and the turn reuses that history."""
    controller, url, _ = pool
    history = ids_of(400, 1)
    before = finished(controller)
    out = complete(url, history, 8)
    home = served_by(controller, before)
    for turn in range(2, 5):
        reusable = 16 * ((len(history) - 1) // 16)  # the last turn's prompt, in whole blocks
        history = history + out["choices"][0]["token_ids"] + ids_of(24, turn)
        # no wait: the next turn comes the moment the last one ended, as from a chat client
        busy = OpenStream(url, {"model": "tiny", "prompt": history + ids_of(16, 100 + turn), "max_tokens": 500,
                                "ignore_eos": True})
        try:
            before = finished(controller)
            out = complete(url, history, 8)
            assert served_by(controller, before) == home, f"turn {turn} left its decode worker"
        finally:
            busy.close()
        # the previous turns' KV was reused
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= reusable


def test_a_hot_prefix_spreads_over_both_decode_workers_once_one_is_loaded(pool):
    controller, url, _ = pool
    prefix = ids_of(512, 2)
    before = finished(controller)
    streams = []
    try:
        for i in range(6):  # each open (generating 500 tokens) when the next is routed: it counts as load
            streams.append(OpenStream(url, {"model": "tiny", "prompt": prefix + ids_of(8, 200 + i),
                                            "max_tokens": 500, "ignore_eos": True}))
        for s in streams:
            s.read_to_end()
    finally:
        for s in streams:
            s.close()
    deadline = time.monotonic() + 10
    while sum((now := finished(controller)).values()) < sum(before.values()) + 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    served = {w: now[w] - before.get(w, 0) for w in now}
    # pure prefix affinity would put all six on one worker
    assert sum(served.values()) == 6 and all(n >= 2 for n in served.values()), served


def test_tokens_are_the_offline_engines_whatever_the_route(pool):
    """Greedy and seeded sampled requests over shared prefixes (cache hits on both pools):
    the same tokens as the offline engine, so the same as any other policy would give."""
    _, url, model = pool
    shared = ids_of(300, 3)
    prompts = [shared + ids_of(20 + 7 * i, 400 + i) for i in range(4)] + [ids_of(90, 500)]
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)]
    llm = LLM(model, max_model_len=1024)
    for p in params:
        expected = [o.token_ids for o in llm.generate(prompts, p)]
        for prompt, want in zip(prompts, expected, strict=True):
            extra = {"temperature": p.temperature, "top_p": p.top_p}
            if p.seed is not None:
                extra["seed"] = p.seed
            out = complete(url, prompt, 10, **extra)
            assert out["choices"][0]["token_ids"] == want


def test_metrics_and_status_show_the_index_and_its_accuracy(pool):
    controller, url, _ = pool
    prompt = ids_of(200, 4)
    before = held_blocks(controller)
    complete(url, prompt, 4)
    # the workers that prefilled and decoded it report the prompt's full blocks cached: once
    # the index holds them, the next request's prediction is made from what the workers hold
    blocks = len(prompt) // BLOCK_SIZE
    wait_for(lambda: all(max(n - before[role].get(w, 0) for w, n in now.items()) >= blocks
                         for role, now in held_blocks(controller).items()),
             f"the router's index holds the prompt's {blocks} blocks for a prefill and a decode worker")
    expected_before = metric(url, "pdserve_router_expected_cached_tokens_total")
    actual_before = metric(url, "pdserve_router_actual_cached_tokens_total")
    out = complete(url, prompt + ids_of(5, 5), 4)
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 192
    assert metric(url, "pdserve_router_actual_cached_tokens_total") - actual_before == cached
    assert metric(url, "pdserve_router_expected_cached_tokens_total") - expected_before == cached
    routing = status(controller)["routing"]
    assert routing["policy"] == "cache-aware"
    assert routing["expected_cached_tokens"] > 0 and routing["actual_cached_tokens"] > 0
    decode_ids = {w["worker_id"] for w in status(controller)["pools"]["decode"]["workers"]}
    assert decode_ids <= set(routing["index"]) and any(v["held"] > 0 for v in routing["index"].values())
    code, text = get(url + "/metrics")
    assert code == 200
    assert sum(line.startswith("pdserve_worker_prefix_cache_hit_rate{") for line in text.splitlines()) == 4, text


def test_workers_that_leave_the_pool_leave_the_index(pool):
    """Must run last here: it shrinks the pools. A drained decode worker and a killed
    prefill worker disappear from the router's index."""
    import ray

    controller, url, _ = pool
    decode_ids = [w["worker_id"] for w in status(controller)["pools"]["decode"]["workers"]]
    prefill_ids = [w["worker_id"] for w in status(controller)["pools"]["prefill"]["workers"]]
    assert set(decode_ids + prefill_ids) <= set(status(controller)["routing"]["index"])
    ray.get(controller.scale.remote(decode=1, wait=True))
    victim = prefill_ids[0]
    ray.kill(ray.get(controller.handle_of.remote(victim)))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        index = status(controller)["routing"]["index"]
        remaining = [w for w in decode_ids if w in index]
        if len(remaining) == 1 and victim not in index:
            break
        time.sleep(0.2)
    assert len(remaining) == 1 and victim not in index, index
    complete(url, ids_of(50, 6), 4)  # still serving
