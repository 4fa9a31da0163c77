"""Through the router on a real cluster with two decode workers, round-robin routing and the
grpc KV transport: token identity with the offline engine, and a request whose decode
worker refuses it before the first token is retried on the other one."""

import random
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import post


@pytest.fixture(scope="module")
def routing(ray_cluster, tiny_llama_dir):
    controller, url = start_service(tiny_llama_dir, kv_transport="grpc",
                                    **{"router.routing": "round-robin", "decode.replicas": 2})
    yield controller, url, str(tiny_llama_dir)
    stop_service(controller)


def pools(controller) -> dict:
    import ray

    return ray.get(controller.status.remote())["pools"]


def counts(controller, role: str, field: str) -> dict[str, int]:
    return {w["worker_id"]: w["stats"][field] for w in pools(controller)[role]["workers"]}


def wait_counts(controller, role: str, field: str, total: int, timeout_s: float = 10) -> dict[str, int]:
    """Per worker counts once they add up to `total` (a worker's Stats may lag a step)."""
    deadline = time.monotonic() + timeout_s
    while sum((now := counts(controller, role, field)).values()) < total and time.monotonic() < deadline:
        time.sleep(0.1)
    return now


def test_grpc_kv_transport_matches_the_offline_engine(routing):
    controller, url, model = routing
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (17, 90, 250, 600)]
    expected = [o.token_ids for o in LLM(model, max_model_len=1024).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    prefilled = sum(counts(controller, "prefill", "num_finished").values())
    for prompt, want in zip(prompts, expected, strict=True):
        status, out, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                        "temperature": 0, "ignore_eos": True,
                                                        "return_token_ids": True})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want
    # every prompt was prefilled on the prefill worker and its KV arrived over the grpc transport
    assert sum(wait_counts(controller, "prefill", "num_finished", prefilled + len(prompts)).values()) == \
        prefilled + len(prompts)
    assert sum(counts(controller, "decode", "num_failed_transfers").values()) == 0


def test_a_draining_decode_worker_is_retried_elsewhere_before_the_first_token(routing):
    """Must run last here: the drained worker stays draining. Round-robin over two routable
    workers sends one of the first two requests to the draining one first, which refuses it
    (UNAVAILABLE): only the retry on the other worker lets every request succeed."""
    import ray

    controller, url, _ = routing
    victim, other = (w["worker_id"] for w in pools(controller)["decode"]["workers"])
    ray.get(ray.get(controller.handle_of.remote(victim)).drain.remote())
    before = counts(controller, "decode", "num_finished")
    for i in range(4):
        body = {"model": "tiny", "prompt": [5, 6, 7 + i], "max_tokens": 5, "ignore_eos": True, "stream": i % 2 == 1}
        status, out, _ = post(url + "/v1/completions", body)
        assert status == 200, out
        if body["stream"]:
            assert out["done"] and not [e for e in out["events"] if "error" in e], out
            assert out["events"][-1]["choices"][0]["finish_reason"] == "length", out
        else:
            assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"
    after = wait_counts(controller, "decode", "num_finished", sum(before.values()) + 4)
    assert after[victim] == before[victim]
    assert after[other] == before[other] + 4
