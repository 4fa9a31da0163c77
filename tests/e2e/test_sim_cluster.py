"""A simulated cluster (`model: sim`) end to end: sixteen simulated workers under the real
controller, served through the real router over HTTP. It says `sim` wherever the model is
named; its answers are the offline simulated engine's tokens, with n choices and across a
migration off a killed decode worker; the KV it ships is the real model's size; and a
simulated worker costs little memory and, idle, little CPU."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import psutil
import pytest

from pdserve.cluster.cli_service import print_status
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import SIM_MODEL
from pdserve.engine.model.llama import ModelShape
from tests.e2e.conftest import start_service, stop_service
from tests.e2e.http import get, metric, post, stream

PREFILL, DECODE = 4, 12
KV_BUDGET_BYTES = 2 << 30  # each worker's, the CPU default: never resident in a simulated worker
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MIGRATED = 'pdserve_migrations_total{reason="unavailable"}'


@pytest.fixture(scope="module")
def sim_service(ray_cluster):
    engine = {"kv_cache_bytes": KV_BUDGET_BYTES}
    controller, url = start_service(SIM_MODEL, served_model_name=None, **{
        "prefill.replicas": PREFILL, "decode.replicas": DECODE, "prefill.num_cpus": 0.1, "decode.num_cpus": 0.1,
        "prefill.engine": engine, "decode.engine": engine})
    yield controller, url
    stop_service(controller)


@pytest.fixture(scope="module")
def offline():
    return LLM(SIM_MODEL, sim={"speed": 1000.0})


def status(controller) -> dict:
    import ray

    return ray.get(controller.status.remote())


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(30, 150))] for _ in range(n)]


def test_the_cluster_says_sim_where_it_names_its_model(sim_service, capsys):
    controller, url = sim_service
    code, body = get(url + "/v1/models")
    assert code == 200 and '"id":"sim"' in body.replace(" ", "")
    now = status(controller)
    assert now["model"] == SIM_MODEL and now["simulated"]["speed"] == 1.0
    assert [len(now["pools"][role]["workers"]) for role in ("prefill", "decode")] == [PREFILL, DECODE]
    print_status(now)
    assert "model: sim (simulated" in capsys.readouterr().out


def test_sixteen_workers_serve_the_offline_tokens_and_ship_kv_of_the_real_size(sim_service, offline, smollm2_dir):
    from transformers import AutoConfig

    controller, url = sim_service
    prompts = random_prompts(4 * DECODE, seed=5)
    params = [{"temperature": 0.0} if i % 2 else {"temperature": 0.9, "top_p": 0.95, "seed": i}
              for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in offline.generate(
        prompts, [SamplingParams(max_tokens=16, ignore_eos=True, **p) for p in params])]
    received_before = shipped_bytes(status(controller))

    async def all_at_once():
        async with aiohttp.ClientSession() as session:
            async def one(prompt, extra):
                body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 16, "ignore_eos": True,
                        "return_token_ids": True, **extra}
                async with session.post(url + "/v1/completions", json=body) as response:
                    assert response.status == 200, await response.text()
                    return await response.json()
            return await asyncio.gather(*(one(p, e) for p, e in zip(prompts, params, strict=True)))

    answers = asyncio.run(all_at_once())
    assert [a["choices"][0]["token_ids"] for a in answers] == expected
    cached = [(i, a["usage"]) for i, a in enumerate(answers) if a["usage"]["prompt_tokens_details"]["cached_tokens"]]
    assert not cached, f"random prompts found cached: {cached}"
    now = status(controller)
    served = [w["stats"]["num_finished"] for w in now["pools"]["decode"]["workers"]]
    assert all(served) and sum(served) >= len(prompts), f"every decode worker served: {served}"
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(str(smollm2_dir)))
    [dtype] = {w["dtype"] for pool in now["pools"].values() for w in pool["workers"]}
    token_bytes = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * DTYPE_BYTES[dtype]
    assert shipped_bytes(now) - received_before == sum(map(len, prompts)) * token_bytes


def shipped_bytes(now: dict) -> int:
    """KV bytes the decode workers received, over every transport."""
    return sum(int(t["bytes"]) for w in now["pools"]["decode"]["workers"] for t in w["stats"].get("transfers", [])
               if t["direction"] == "receive")


def test_n_choices_are_the_seeds_in_turn(sim_service, offline):
    _, url = sim_service
    [prompt] = random_prompts(1, seed=6)
    code, out, _ = post(url + "/v1/completions", {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 12, "n": 3,
                                                  "seed": 40, "temperature": 1.0, "ignore_eos": True,
                                                  "return_token_ids": True})
    assert code == 200, out
    choices = [c["token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    expected = [o.outputs[0].token_ids for o in offline.generate(
        [prompt] * 3, [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=40 + i) for i in range(3)])]
    assert choices == expected and len({tuple(c) for c in choices}) == 3


def test_a_simulated_worker_costs_little(sim_service):
    """Each worker's resident memory (well under its KV budget: the cache's pages are never
    touched but where KV arrives), and its CPU while idle under the router's and the
    controller's polling."""
    controller, _ = sim_service
    workers = [w for pool in status(controller)["pools"].values() for w in pool["workers"]]
    processes = [psutil.Process(w["pid"]) for w in workers]
    before, started = [p.cpu_times() for p in processes], time.monotonic()
    time.sleep(5)
    elapsed = time.monotonic() - started
    idle = [(a.user + a.system - b.user - b.system) / elapsed
            for a, b in zip((p.cpu_times() for p in processes), before, strict=True)]
    rss = [p.memory_info().rss for p in processes]
    print(f"simulated workers: RSS {min(rss) / 2**20:.0f}-{max(rss) / 2**20:.0f} MiB, idle CPU "
          f"{100 * min(idle):.1f}-{100 * max(idle):.1f}% of a core")
    assert max(rss) < KV_BUDGET_BYTES / 2
    assert max(idle) < 0.05


def test_a_stream_migrated_off_a_killed_decode_worker_continues_token_exact(sim_service, offline):
    """Last here: it kills a decode worker (the controller replaces it)."""
    import ray

    controller, url = sim_service
    [prompt] = random_prompts(1, seed=7)
    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 123}
    [expected] = offline.generate([prompt], SamplingParams(max_tokens=200, ignore_eos=True, **sampling))
    migrated_before = metric(url, MIGRATED)

    async def stream_and_kill():
        body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True,
                "return_token_ids": True, **sampling}
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(stream(session, url + "/v1/completions", body))
            victim = await asyncio.to_thread(serving_decode_worker, controller)
            ray.kill(ray.get(controller.handle_of.remote(victim)))
            return await task

    events, done = asyncio.run(stream_and_kill())
    assert done and [t for e in events for t in e["choices"][0]["token_ids"]] == expected.outputs[0].token_ids
    assert metric(url, MIGRATED) == migrated_before + 1


def serving_decode_worker(controller, timeout_s: float = 30) -> str:
    """The id of the decode worker running a request, once one is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for w in status(controller)["pools"]["decode"]["workers"]:
            if (w["stats"] or {}).get("num_running"):
                return w["worker_id"]
        time.sleep(0.1)
    raise TimeoutError("no decode worker is running the request")
