"""The simulated engine (`model: sim`, engine.sim) keeps the real engine but its forward
pass: the scheduler's and block manager's invariants hold after every step under chunked
prefill, prefix caching and preemption; tokens are a function of the request's tokens, seed
and positions (the same alone or batched, after preemption, and resumed on another engine
as the router resumes a migrated stream); each step lasts what the profile's latency model
predicts for its shape; the layer hook sees K/V of the real shape, layer by layer."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch

from pdserve.engine.config import SIM_MODEL, EngineConfig, SimConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import kv_block_bytes
from pdserve.engine.model.llama import ModelShape
from pdserve.engine.profile import Profile
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sim import DEFAULT_PROFILE, SimModel
from pdserve.protos.convert import sampling_from_proto, sampling_to_proto

FAST = SimConfig(speed=1000.0)  # steps of about a millisecond: for tests of bookkeeping and tokens
TOLERANCE = 0.10  # step times within 10% of the profile's


@pytest.fixture(scope="module")
def shape(smollm2_dir) -> ModelShape:
    """The default model's shapes, read from its config.json: what `sim.like` gives by default."""
    from transformers import AutoConfig

    return ModelShape.from_hf_config(AutoConfig.from_pretrained(str(smollm2_dir)))


def sim_engine(**kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=SIM_MODEL, dtype="float32", **{"sim": FAST, **kwargs}))


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], after_step=None) -> dict:
    """Add every request, step until all finish (`after_step()` after each step); each
    request's (token ids, logprobs)."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                done[output.request_id] = (completion.token_ids, completion.logprobs)
        if after_step is not None:
            after_step()
    return done


def workload() -> dict[str, tuple[list[int], SamplingParams]]:
    """Three groups of four prompts sharing a 48-token prefix, in four ways of sampling."""
    samplings = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}, {"temperature": 0.8, "top_p": 0.9,
                 "seed": 9, "logprobs": 2}, {"temperature": 0.0, "frequency_penalty": 0.5, "logprobs": 1}]
    requests = {}
    for group in range(3):
        prefix = list(range(1000 * (group + 1), 1000 * (group + 1) + 48))
        for i, sampling in enumerate(samplings):
            tail = list(range(20000 + 100 * i + group, 20000 + 100 * i + group + 30 + 10 * i))
            requests[f"g{group}-{i}"] = (prefix + tail, SamplingParams(max_tokens=40, ignore_eos=True, **sampling))
    return requests


def test_the_invariants_hold_after_every_step_and_tokens_do_not_depend_on_the_batch(shape):
    """A cache of 24 blocks (less than the workload's twelve requests need at once) and a
    64-token budget: prompts are chunked, share cached prefixes and are preempted."""
    block_bytes = kv_block_bytes(shape, 16, torch.float32)
    engine = sim_engine(kv_cache_bytes=24 * block_bytes, max_num_batched_tokens=64, max_model_len=256)
    manager, steps = engine.block_manager, []
    assert manager.num_blocks == 24

    def check() -> None:
        manager.check_integrity()
        steps.append(engine.last_step_shape)

    batched = run(engine, workload(), after_step=check)
    load = engine.load()
    assert load.num_preemptions > 0, "the cache was meant to be too small for the batch"
    assert load.prefix_cache_hit_tokens > 0 and manager.cache_events(0).stored, "shared prefixes were cached"
    assert any(0 < s.prefill_cached for s in steps), "a prompt was chunked (a chunk over its earlier chunks)"
    assert manager.num_free_blocks == manager.num_blocks, "every block is free or cached-evictable at the end"
    alone = {}
    for request_id, request in workload().items():  # each on a roomy engine of its own, never batched
        alone |= run(sim_engine(max_model_len=256), {request_id: request})
    assert batched == alone


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 50, "seed": 77}],
                         ids=["greedy", "seeded-sampled"])
def test_a_request_resumed_on_another_engine_continues_the_unbroken_run(sampling):
    """As the router resumes a stream whose decode worker failed: on another worker, the
    prompt plus the tokens already sent, `first_position` continuing the sampling positions."""
    prompt = list(range(300, 380))
    params = SamplingParams(max_tokens=60, ignore_eos=True, **sampling)
    [(unbroken, _)] = run(sim_engine(), {"whole": (prompt, params)}).values()
    other_worker = sim_engine()
    for done in (1, 23, 59):
        resumed = sampling_from_proto(sampling_to_proto(dataclasses.replace(params, max_tokens=60 - done,
                                                                            first_position=done)))
        [(tail, _)] = run(other_worker, {f"resumed-{done}": (prompt + unbroken[:done], resumed)}).values()
        assert unbroken[:done] + tail == unbroken, f"resumed after {done} tokens"


def test_tokens_depend_on_the_prompt_and_the_seed_as_with_a_model():
    engine = sim_engine()
    sampled = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=seed) for seed in (3, 4)]
    greedy = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)
    out = run(engine, {"s3": (list(range(50, 90)), sampled[0]), "s4": (list(range(50, 90)), sampled[1]),
                       "g1": (list(range(50, 90)), greedy), "g2": (list(range(51, 91)), greedy)})
    assert out["s3"][0] != out["s4"][0], "n choices (seeds s, s+1) differ where a model's would"
    assert out["g1"][0] != out["g2"][0], "another prompt, another continuation"
    assert run(sim_engine(), {"again": (list(range(50, 90)), sampled[0])})["again"] == out["s3"]


def measure_steps(engine: LLMEngine, requests: dict, profile: Profile, speed: float) -> list[tuple[str, float]]:
    """(kind, measured / predicted - 1) of every step that runs `requests`, the prediction
    derived here from each step's requests: prompts of distinct tokens, one step each."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    lengths = [len(prompt) for prompt, _ in requests.values()]
    errors, generated = [], 0
    while engine.has_unfinished_requests():
        started = time.monotonic()
        engine.step()
        seconds = time.monotonic() - started
        if generated == 0:  # every prompt at once: T tokens, attention Q = sum of n^2
            kind, predicted = "prefill", profile.step_s(sum(lengths), sum(n * n for n in lengths), 0, 0)
        else:  # each row computes its latest token, attending over prompt + generated
            kind, predicted = "decode", profile.step_s(0, 0, len(lengths), sum(n + generated for n in lengths))
        errors.append((kind, seconds / (predicted / speed) - 1))
        generated += 1
    return errors


@pytest.mark.parametrize(("speed", "batch", "prompt_len"), [(1.0, 1, 512), (1.0, 4, 128), (1.0, 16, 64),
                                                           (4.0, 2, 512)])
def test_step_times_follow_the_profile(speed, batch, prompt_len):
    profile = Profile.load(DEFAULT_PROFILE)
    engine = sim_engine(sim=SimConfig(speed=speed))
    run(engine, {"warm-up": ([1, 2, 3], SamplingParams(max_tokens=2))})
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    requests = {f"r{i}": (list(range(5000 + 1000 * i, 5000 + 1000 * i + prompt_len)), params) for i in range(batch)}
    errors = measure_steps(engine, requests, profile, speed)
    prefill = [e for kind, e in errors if kind == "prefill"]
    decode = [e for kind, e in errors if kind == "decode"]
    assert len(prefill) == 1 and len(decode) == params.max_tokens - 1
    print(f"speed {speed} batch {batch} x {prompt_len}: prefill {prefill[0]:+.1%}, decode median "
          f"{statistics.median(decode):+.1%} (max {max(decode, key=abs):+.1%})")
    assert abs(prefill[0]) < TOLERANCE
    assert abs(statistics.median(decode)) < TOLERANCE


def test_the_layer_hook_sees_each_layer_of_the_real_shape_paced_over_the_step(shape):
    # the profile's own speed: a step of ~0.1 s, so that 10% of it outlasts the OS's wake-up
    # latency on a busy machine (at speed 4, 10% was 2.7 ms and a loaded CI host woke 3-5 ms late)
    engine = sim_engine(sim=SimConfig(speed=1.0))
    assert isinstance(engine.loaded.model, SimModel), "no weights are loaded"
    seen = []
    engine.kv_connector.worker_side.set_layer_hook(
        lambda request_id, layer, start, k, v: seen.append((time.monotonic(), request_id, layer, start, k.shape,
                                                            v.shape)))
    engine.add_request("a", list(range(100, 300)), SamplingParams(max_tokens=1))
    planned = {}  # when the runner's step began (at most this late) and the time it paces it to
    execute = engine.runner.execute

    def timed_execute(output):
        planned.update(started=time.monotonic(), step_s=engine.runner.step_seconds(output.chunks))
        return execute(output)

    engine.runner.execute = timed_execute
    engine.step()
    cache = engine.kv_connector.worker_side.cache_tensor
    assert cache.shape[0] == shape.num_layers and cache.shape[4:] == (shape.num_kv_heads, shape.head_dim)
    assert [(rid, layer, start) for _, rid, layer, start, _, _ in seen] == [("a", i, 0) for i in
                                                                           range(shape.num_layers)]
    assert {(k, v) for *_, k, v in seen} == {((200, shape.num_kv_heads, shape.head_dim),) * 2}
    step_s = planned["step_s"]
    assert step_s > 0
    for t, _, layer, *_ in seen:  # layer i is handed over at (i + 1) / layers of the step: never before, and
        due = planned["started"] + step_s * (layer + 1) / shape.num_layers  # late by a thread's wake-up only
        assert due <= t < due + TOLERANCE * step_s, (layer, t - due, step_s)


def test_without_kv_bytes_the_cache_and_the_shipped_kv_are_a_stand_in(shape):
    engine = sim_engine(sim=SimConfig(speed=1000.0, kv_bytes=False))
    seen = []
    engine.kv_connector.worker_side.set_layer_hook(lambda request_id, layer, start, k, v: seen.append(k.shape))
    engine.add_request("a", list(range(100, 150)), SamplingParams(max_tokens=1))
    engine.step()
    cache = engine.kv_connector.worker_side.cache_tensor
    assert cache.shape[:4] == (shape.num_layers, 2, engine.block_manager.num_blocks, 16)
    assert cache.shape[4:] == (1, 1) and set(seen) == {(50, 1, 1)}
    roomy = sim_engine()  # the same budget holds as many blocks as the real cache
    assert engine.block_manager.num_blocks == roomy.block_manager.num_blocks
