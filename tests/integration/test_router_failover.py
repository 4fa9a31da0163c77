"""Token-exact stream migration, over real worker processes, real gRPC and real HTTP: a
decode worker SIGKILLed mid-stream, or leaving the router's membership (the registry closes
its channel, which cancels the open calls), and the request goes on on another decode
worker with exactly the tokens an unbroken run gives; past `max_migrations` the client gets
an error, never a cut stream."""

import asyncio
import dataclasses

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.cache_index import PromptKeys
from pdserve.router.config import RouterConfig
from pdserve.router.generation import Generation, GenerationError
from pdserve.router.registry import WorkerRegistry
from pdserve.router.state import Router
from pdserve.testkit.workers import SECURITY, RouterProcess, WorkerProcess, wait_idle_at
from tests.e2e.http import metric
from tests.integration.streaming import serving_worker, stream_ids

PROMPT = list(range(7, 47))
MAX_TOKENS = 600


@pytest.fixture(scope="module")
def killable(tiny_llama_dir):
    """A bare router over one prefill and five decode workers; each test kills one (four
    tests: one survivor is left for the last test's resumed stream)."""
    model = str(tiny_llama_dir)
    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model) as d1, \
            WorkerProcess("decode", model) as d2, WorkerProcess("decode", model) as d3, \
            WorkerProcess("decode", model) as d4, WorkerProcess("decode", model) as d5, \
            RouterProcess(model, [p.address], [d.address for d in (d1, d2, d3, d4, d5)]) as r:
        yield r, [d1, d2, d3, d4, d5]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.95, "seed": 1234}],
                         ids=["greedy", "seeded-sampled"])
def test_a_decode_worker_killed_mid_stream_is_resumed_token_exact(killable, sampling):
    router, decode = killable
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}
    reference, _, _, _, _ = asyncio.run(stream_ids(router.url, body))
    migrations_before = metric(router.url, 'pdserve_migrations_total{reason="unavailable"}')
    killed = []

    async def kill_the_serving_worker():
        victim = await serving_worker(decode)
        victim.kill()
        killed.append(victim)

    ids, finishes, usage, errors, done = asyncio.run(stream_ids(router.url, body, 20, kill_the_serving_worker))
    assert len(reference) == MAX_TOKENS
    assert not errors and done and finishes == ["length"], (errors, finishes)
    assert ids == reference, "the resumed stream differs from an unbroken run"
    assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] == len(PROMPT)
    assert metric(router.url, 'pdserve_migrations_total{reason="unavailable"}') == migrations_before + 1
    for survivor in [d for d in decode if d.proc.poll() is None]:
        idle = asyncio.run(wait_idle_at(survivor.address, "decode"))
        assert idle.num_free_blocks == idle.num_total_blocks


def test_a_resumed_stream_carries_the_unbroken_runs_logprobs_and_penalties(killable):
    """Logprobs and penalties across a migration: the tokens before the kill come from the
    first decode worker, the rest from the one it resumed on, whose penalties count the
    tokens the first one generated; all equal an unbroken run's. With `echo`, the prompt's
    logprobs come once, from the first leg (the resumed one does not score it again)."""
    router, decode = killable
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 120, "ignore_eos": True, "temperature": 0.9,
            "top_p": 0.9, "seed": 77, "logprobs": 2, "frequency_penalty": 0.6, "presence_penalty": 0.3,
            "repetition_penalty": 1.1, "echo": True}
    reference_logprobs, logprobs = [], []
    reference, *_ = asyncio.run(stream_ids(router.url, body, logprobs=reference_logprobs))
    migrations_before = metric(router.url, 'pdserve_migrations_total{reason="unavailable"}')

    async def kill_the_serving_worker():
        (await serving_worker(decode)).kill()

    ids, finishes, _, errors, done = asyncio.run(stream_ids(router.url, body, 20, kill_the_serving_worker,
                                                             logprobs=logprobs))
    assert not errors and done and finishes == ["length"], (errors, finishes)
    assert metric(router.url, 'pdserve_migrations_total{reason="unavailable"}') == migrations_before + 1
    assert ids == reference and len(logprobs) == len(reference_logprobs) == len(PROMPT) + 120
    assert logprobs[0] == reference_logprobs[0] == (None, None)  # the first prompt token's
    for (value, top), (expected, expected_top) in zip(logprobs[1:], reference_logprobs[1:], strict=True):
        assert abs(value - expected) < 1e-5 and top.keys() == expected_top.keys()
        assert all(abs(top[k] - expected_top[k]) < 1e-5 for k in top)


def test_a_resumed_stream_keeps_to_its_json_schema(killable, tiny_llama_dir):
    """Structured output across a migration: the worker it resumes on brings its grammar up
    to the tokens generated before the kill, and the stream equals an unbroken run's."""
    import json

    import jsonschema

    router, decode = killable
    schema = {"type": "object", "required": ["words"], "additionalProperties": False,
              "properties": {"words": {"type": "array", "minItems": 12, "maxItems": 12,
                                       "items": {"type": "string", "minLength": 4, "maxLength": 8}}}}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "seed": 9,
            "response_format": {"type": "json_schema", "json_schema": {"name": "words", "schema": schema}}}
    reference, finishes, *_ = asyncio.run(stream_ids(router.url, body))
    assert finishes == ["stop"] and len(reference) > 30, reference
    migrations_before = metric(router.url, 'pdserve_migrations_total{reason="unavailable"}')

    async def kill_the_serving_worker():
        (await serving_worker(decode)).kill()

    ids, finishes, _, errors, done = asyncio.run(stream_ids(router.url, body, 10, kill_the_serving_worker))
    assert not errors and done and finishes == ["stop"], (errors, finishes)
    assert metric(router.url, 'pdserve_migrations_total{reason="unavailable"}') == migrations_before + 1
    assert ids == reference
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(tiny_llama_dir).decode(ids)
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    model = str(tiny_llama_dir)
    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model) as d1, \
            WorkerProcess("decode", model) as d2:
        yield p, d1, d2


def _leave_mid_stream(workers, tiny_llama_dir, params: SamplingParams, others: int, max_migrations: int = 2,
                      migration_wait_s: float = 1.0, joins_after_s: float | None = None):
    """Run one request through an in-process router whose membership drops the serving
    decode worker after 3 tokens; `others`: how many other decode workers stay listed;
    `joins_after_s`: the other decode worker joins the pool this long after the drop.
    Returns (token ids, the error if it failed, the router's resolved seed)."""
    prefill, *decode = workers
    members = [{"role": "prefill", "worker_id": "p", "address": prefill.address, "state": "ready"}]
    members += [{"role": "decode", "worker_id": f"d{i}", "address": d.address, "state": "ready"}
                for i, d in enumerate(decode[:1 + others])]
    joiner = {"role": "decode", "worker_id": "joiner", "address": decode[-1].address, "state": "ready"}

    async def source():
        return list(members)

    async def scenario():
        config = RouterConfig(model=str(tiny_llama_dir), served_model_name="tiny", security=SECURITY,
                              max_migrations=max_migrations, migration_wait_s=migration_wait_s)
        router = Router(config, WorkerRegistry(source, SECURITY))
        await router.start()
        prompt = PromptKeys(PROMPT)
        generation = Generation(router, "leaves", prompt, params, router.route_request(prompt, None))
        received, error, left = [], None, False
        try:
            async for delta in generation.deltas():
                received.extend(delta.token_ids)
                if len(received) >= 3 and not left:
                    left = True
                    members[:] = [m for m in members if m["worker_id"] != generation.result.decode_worker]
                    await router.registry.refresh()  # the serving decode worker leaves the pool
                    if joins_after_s is not None:
                        asyncio.get_running_loop().call_later(joins_after_s, members.append, joiner)
        except GenerationError as exc:
            error = exc
        finally:
            await router.registry.stop()
        return received, error, generation.params.seed

    return asyncio.run(scenario())


def test_a_decode_worker_leaving_the_pool_mid_stream_is_resumed_elsewhere_even_unseeded(workers, tiny_llama_dir):
    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True)  # no seed: the router picks one
    ids, error, seed = _leave_mid_stream(workers, tiny_llama_dir, params, others=1)
    assert error is None and len(ids) == 200
    from pdserve.engine import LLM  # the unbroken run, offline, with the seed the router resolved

    [out] = LLM(str(tiny_llama_dir)).generate([PROMPT], dataclasses.replace(params, seed=seed))
    assert ids == out.outputs[0].token_ids


def test_a_decode_worker_leaving_with_no_other_fails_the_request_cleanly(workers, tiny_llama_dir):
    ids, error, _ = _leave_mid_stream(workers, tiny_llama_dir, SamplingParams(max_tokens=400, ignore_eos=True),
                                      others=0)
    assert 3 <= len(ids) < 400
    assert isinstance(error, GenerationError) and "decode worker" in str(error)


def test_a_request_whose_worker_left_waits_for_a_replacement_and_resumes_token_exact(workers, tiny_llama_dir):
    """No other decode worker is routable when the serving one leaves; one joins 3 s later
    (as the controller's replacement would): within `migration_wait_s` the request resumes
    there, with the unbroken run's tokens."""
    params = SamplingParams(max_tokens=120, temperature=0.9, seed=5, ignore_eos=True)
    ids, error, _ = _leave_mid_stream(workers, tiny_llama_dir, params, others=0, migration_wait_s=30,
                                      joins_after_s=3)
    from pdserve.engine import LLM

    [out] = LLM(str(tiny_llama_dir)).generate([PROMPT], params)
    assert error is None and ids == out.outputs[0].token_ids


def test_past_max_migrations_the_request_fails_with_the_legs_error(workers, tiny_llama_dir):
    ids, error, _ = _leave_mid_stream(workers, tiny_llama_dir, SamplingParams(max_tokens=400, ignore_eos=True),
                                      others=1, max_migrations=0)
    assert 3 <= len(ids) < 400
    assert isinstance(error, GenerationError) and "left the pool mid-request" in str(error)


def test_a_hung_decode_worker_is_routed_around_and_its_stream_resumed_token_exact(tiny_llama_dir):
    """SIGSTOP (not kill) the decode worker serving a seeded sampled stream: the process keeps
    its sockets, so only gRPC keepalive (a ping unanswered for 5 s on a connection silent for
    10 s) fails the leg; the stream resumes on the other worker with the unbroken run's tokens.
    The router's health check (Stats unanswered 3 polls in a row) takes the hung worker out of
    routing, so new requests are served by the other one, and puts it back once it answers."""
    import signal
    import time

    model = str(tiny_llama_dir)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 1.0, "top_p": 0.95, "seed": 99}
    routable = 'pdserve_pool_workers{pool="decode"}'

    def wait_routable(url: str, count: int) -> None:
        deadline = time.monotonic() + 60
        while metric(url, routable) != count:
            assert time.monotonic() < deadline, f"the router never saw {count} routable decode workers"
            time.sleep(0.2)

    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model) as d1, \
            WorkerProcess("decode", model) as d2, RouterProcess(model, [p.address], [d1.address, d2.address]) as r:
        wait_routable(r.url, 2)
        reference, _, _, _, _ = asyncio.run(stream_ids(r.url, body))
        stopped = []

        async def hang_the_serving_worker():
            victim = await serving_worker([d1, d2])
            victim.proc.send_signal(signal.SIGSTOP)
            stopped.append(victim)

        try:
            ids, finishes, usage, errors, done = asyncio.run(stream_ids(r.url, body, 20, hang_the_serving_worker))
            wait_routable(r.url, 1)
            others = [asyncio.run(stream_ids(r.url, {**body, "max_tokens": 8, "seed": s})) for s in range(4)]
            stopped[0].proc.send_signal(signal.SIGCONT)
            wait_routable(r.url, 2)
        finally:
            for victim in stopped:
                victim.proc.send_signal(signal.SIGCONT)
    assert not errors and done and finishes == ["length"], (errors, finishes)
    assert ids == reference, "the resumed stream differs from an unbroken run"
    assert usage["completion_tokens"] == MAX_TOKENS
    assert all(not o[3] and o[1] == ["length"] and len(o[0]) == 8 for o in others), others


def test_the_real_smollm2_killed_mid_stream_resumes_with_the_offline_tokens(smollm2_dir):
    """The same migration on the real SmolLM2-135M weights: the serving decode worker is
    SIGKILLed after 20 tokens of a seeded sampled stream; the client's tokens equal the engine's
    offline run of the same request."""
    from pdserve.engine import LLM

    model = str(smollm2_dir)
    llm = LLM(model)
    prompt = llm.get_tokenizer().encode("The history of the printing press begins")
    max_tokens, seed = 80, 7
    reference = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95,
                                                             seed=seed, ignore_eos=True))[0].token_ids
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.8, "top_p": 0.95, "seed": seed}
    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model) as d1, \
            WorkerProcess("decode", model) as d2, \
            RouterProcess(model, [p.address], [d1.address, d2.address], served_model_name="smollm2") as r:

        async def kill_the_serving_worker():
            (await serving_worker([d1, d2])).kill()

        ids, finishes, usage, errors, done = asyncio.run(stream_ids(r.url, body, 20, kill_the_serving_worker))
        killed = [d for d in (d1, d2) if d.proc.poll() is not None]
    assert len(killed) == 1, "exactly the serving worker was killed mid-stream"
    assert not errors and done and finishes == ["length"], (errors, finishes)
    assert ids == reference, "the resumed stream differs from the offline run"
    assert usage["completion_tokens"] == max_tokens
