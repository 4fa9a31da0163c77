"""End to end through HTTP: router + Ray-managed prefill and decode pools (tiny model)."""

import asyncio
import json
import random

import aiohttp
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from pdserve.engine import LLM, SamplingParams
from tests.e2e.http import ABORTED, get, metric, post, stream


def prompts(n: int, seed: int):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 200))] for _ in range(n)]


@pytest.fixture(scope="module")
def offline(service):
    return LLM(service["model"], max_model_len=1024)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_token_identity_with_the_offline_engine_streaming_and_not(service, offline, sampled):
    url = service["url"]
    ps = prompts(6, seed=11 if sampled else 12)
    extra = {"temperature": 0.7, "top_p": 0.9} if sampled else {"temperature": 0.0}
    expected = [o.token_ids for o in offline.generate(ps, [
        SamplingParams(max_tokens=12, ignore_eos=True, seed=i if sampled else None, **extra)
        for i in range(len(ps))])]

    for i, (p, want) in enumerate(zip(ps, expected, strict=True)):
        body = {"model": "tiny", "prompt": p, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True,
                **({"seed": i} if sampled else {}), **extra}
        status, out, _ = post(url + "/v1/completions", body)
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want
        assert_usage(out["usage"], len(p), 12)

    async def streamed():
        async with aiohttp.ClientSession() as session:
            results = []
            for i, p in enumerate(ps):
                body = {"model": "tiny", "prompt": p, "max_tokens": 12, "ignore_eos": True, "stream": True,
                        "return_token_ids": True, **({"seed": i} if sampled else {}), **extra}
                events, done = await stream(session, url + "/v1/completions", body)
                assert done
                results.append([t for e in events for t in e["choices"][0]["token_ids"]])
            return results

    assert asyncio.run(streamed()) == expected


def test_openai_client_works_unchanged(service):
    from openai import OpenAI

    client = OpenAI(base_url=service["url"] + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    completion = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=6, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def assert_usage(usage: dict, prompt_tokens: int, completion_tokens: int) -> None:
    """OpenAI's usage object; cached prompt tokens are whole KV blocks, short of the prompt."""
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
    assert 0 <= cached < prompt_tokens and cached % 16 == 0


def test_64_concurrent_streams_complete_with_correct_usage(service):
    url = service["url"]
    ps = prompts(64, seed=5)
    lengths = [random.Random(i).randint(4, 24) for i in range(64)]

    async def run():
        async with aiohttp.ClientSession() as session:
            calls = [stream(session, url + "/v1/completions", {
                "model": "tiny", "prompt": p, "max_tokens": n, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.5, "seed": i})
                for i, (p, n) in enumerate(zip(ps, lengths, strict=True))]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    for (events, done), p, n in zip(results, ps, lengths, strict=True):
        assert done
        assert_usage(events[-1]["usage"], len(p), n)
        assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_end_the_request(service):
    status, out, _ = post(service["url"] + "/v1/completions",
                          {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True,
                           "temperature": 0})
    text = out["choices"][0]["text"]
    assert status == 200 and len(text) > 6
    stop = text[3:6]
    status, out, _ = post(service["url"] + "/v1/completions",
                          {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True,
                           "temperature": 0, "stop": [stop]})
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == text[: text.find(stop)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_strings_end_a_streaming_request(service, chat):
    path, key = ("/v1/chat/completions", "messages") if chat else ("/v1/completions", "prompt")
    body = {"model": "tiny", key: [{"role": "user", "content": "Hi"}] if chat else [5, 6, 7], "max_tokens": 40,
            "ignore_eos": True, "temperature": 0, "stream": True}

    def streamed_text(extra: dict) -> tuple[str, list[str]]:
        status, out, _ = post(service["url"] + path, {**body, **extra})
        assert status == 200 and out["done"], out
        choices = [e["choices"][0] for e in out["events"] if e["choices"]]
        text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
        return text, [c["finish_reason"] for c in choices if c["finish_reason"]]

    full, finishes = streamed_text({})
    assert finishes == ["length"] and len(full) > 8
    stop = full[4:7]
    text, finishes = streamed_text({"stop": [stop]})
    assert finishes == ["stop"]
    assert text == full[: full.find(stop)] and stop not in text


BAD_INPUTS = [
    ("not json", 400, "not valid JSON"),
    ("[1, 2]", 400, "must be a JSON object"),
    ({"prompt": "x"}, 422, "model: Field required"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, 422, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 422, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 422, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, 422, "top_p"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, 422, "stream"),
    ({"model": "tiny", "prompt": "x", "bogus": 1}, 422, "bogus"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt must not be empty"),
    ({"model": "tiny", "prompt": [1, 99999999]}, 400, "token ids must be integers in [0, 49152)"),
    ({"model": "tiny", "prompt": list(range(3, 1100))}, 400, "maximum context length is 1024"),
    ({"model": "tiny", "prompt": "x", "n": 17}, 422, "n: Input should be less than or equal to 16"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 422, "n: Input should be greater than or equal to 1"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny", "messages": []}, 422, "messages"),
]


@pytest.mark.parametrize(("body", "status", "message"), BAD_INPUTS)
def test_bad_input_gets_its_error(service, body, status, message):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    got, out, _ = post(service["url"] + path, body)
    assert got == status, out
    assert message in out["error"]["message"]
    assert set(out["error"]) == {"message", "type", "param", "code"}


def test_oversized_body_is_413(service):
    import socket
    from urllib.parse import urlparse

    url = urlparse(service["url"])
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        # announce 6 MB but send only the start: the router must answer before reading it all
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 6000000\r\n\r\n" + b'{"model": "tiny", "prompt": "' + b"x" * 1000)
        response = b""
        while b"\r\n\r\n" not in response or not response.rstrip().endswith(b"}"):
            part = sock.recv(65536)
            if not part:
                break
            response += part
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert "exceeds the limit" in json.loads(body)["error"]["message"]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8),
                                                                                       children, max_size=4),
                    max_leaves=10)
FIELDS = {"model": st.sampled_from(["tiny", "other", ""]) | JSON, "prompt": JSON | st.lists(st.integers(), max_size=5),
          "max_tokens": st.integers(-5, 3) | JSON, "temperature": JSON, "top_p": JSON, "top_k": JSON,
          "seed": JSON, "stop": JSON, "stream": st.booleans() | JSON, "messages": JSON, "n": JSON,
          "echo": st.booleans() | JSON, "logprobs": st.integers(-1, 3) | JSON,
          "response_format": JSON | st.fixed_dictionaries(
              {"type": st.sampled_from(["text", "json_object", "json_schema", "yaml"])},
              optional={"json_schema": JSON | st.fixed_dictionaries({"schema": JSON})})}


def _answer(url: str, body, chat: bool) -> tuple[int, dict]:
    """POST a body; assert the answer is well-formed for its status: 200 with a complete
    completion (an SSE stream when the body asked to stream), or a 4xx with an OpenAI error
    object (never a 5xx: not 500, not 502/503 either)."""
    raw = body if isinstance(body, bytes) else json.dumps(body)
    status, out, _ = post(url + ("/v1/chat/completions" if chat else "/v1/completions"), raw)
    event(f"HTTP {status}")
    if status != 200:
        assert 400 <= status < 500, (status, out)
        assert isinstance(out.get("error"), dict) and isinstance(out["error"]["message"], str), out
        assert out["error"]["message"], out
        return status, out
    kind = "chat.completion" if chat else "text_completion"
    if isinstance(body, dict) and body.get("stream") is True:
        assert "events" in out, out  # what `post` makes of a text/event-stream answer
        assert out["done"] and out["events"], out
        assert not [e for e in out["events"] if "error" in e], out
        assert {e["object"] for e in out["events"]} == {kind + ".chunk" if chat else kind}
        finishes = [c["finish_reason"] for e in out["events"] for c in e["choices"] if c["finish_reason"]]
        n = body.get("n", 1)  # a valid body's n: one finish per choice
        assert len(finishes) == n and set(finishes) <= {"stop", "length"}, out
    else:
        assert out["object"] == kind and len(out["choices"]) == body.get("n", 1), out
        assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"]), out
        assert out["usage"]["completion_tokens"] >= 1
    return status, out


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.fixed_dictionaries({}, optional=FIELDS), JSON, st.binary(max_size=64)),
       chat=st.booleans())
@example(body={"model": "tiny", "stream": True, "prompt": [0]}, chat=False)  # once read as JSON by mistake
@example(body={"model": "tiny", "stream": True, "messages": [{"role": "user", "content": ""}]}, chat=True)
def test_fuzzed_bodies_never_get_a_500(service, body, chat):
    _answer(service["url"], body, chat)


# Bodies one or two fields away from valid ones, with what the API documents as valid for each.
NEAR = {"max_tokens": (st.integers(-1, 4), lambda v: v >= 1),
        "temperature": (st.floats(-0.5, 2.5), lambda v: 0 <= v <= 2),
        "top_p": (st.floats(0, 1.5), lambda v: 0 < v <= 1),
        "seed": (st.integers(-1, 3), lambda v: v >= 0),
        "stop": (st.lists(st.text(max_size=3), max_size=5), lambda v: len(v) <= 4 and all(v)),
        "ignore_eos": (st.booleans(), lambda v: True),
        "stream": (st.booleans(), lambda v: True),
        "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), lambda v: True)}
ROLES = st.sampled_from(["user", "system", "assistant", "robot"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(chat=st.booleans(), fields=st.fixed_dictionaries({}, optional={k: s for k, (s, _) in NEAR.items()}),
       prompt=st.lists(st.integers(0, 49151), min_size=1, max_size=5) | st.text(min_size=1, max_size=20),
       messages=st.lists(st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=10)}), max_size=2))
@example(chat=False, fields={"stream": True}, prompt=[0], messages=[])
def test_near_valid_bodies_get_a_200_exactly_when_valid(service, chat, fields, prompt, messages):
    body = {"model": "tiny", **fields, **({"messages": messages} if chat else {"prompt": prompt})}
    wrong = [k for k, v in fields.items() if not NEAR[k][1](v)]
    if chat and (not messages or any(m["role"] == "robot" for m in messages)):
        wrong.append("messages")
    status, out = _answer(service["url"], body, chat)
    if wrong:
        assert status in (400, 422) and any(k in out["error"]["message"] for k in wrong), (wrong, out)
    else:
        assert status == 200, out


def test_still_serving_and_idle_after_everything(service):
    import ray

    status, out, _ = post(service["url"] + "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3})
    assert status == 200
    assert _wait_all_idle(service["controller"], ray)


def _wait_all_idle(controller, ray, timeout_s: float = 20) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = ray.get(controller.status.remote())
        stats = [w["stats"] for pool in status["pools"].values() for w in pool["workers"]]
        if all(s and s["num_free_blocks"] == s["num_total_blocks"] and not s["num_running"] and not s["num_waiting"]
               for s in stats):
            return True
        time.sleep(0.2)
    return False


def _decode_finished(controller, ray) -> int:
    workers = ray.get(controller.status.remote())["pools"]["decode"]["workers"]
    return sum(w["stats"]["num_finished"] for w in workers)


def test_client_disconnect_aborts_on_both_workers(service):
    """The request could run ~1000 tokens: it ends because the client left, not by itself
    (the decode worker counts no finished request), and its KV blocks are freed."""
    import ray

    url, controller = service["url"], service["controller"]
    assert _wait_all_idle(controller, ray)
    aborted, finished = metric(url, ABORTED), _decode_finished(controller, ray)

    async def run():
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5000, "ignore_eos": True,
                    "stream": True}) as response:
                async for _ in response.content:
                    break  # read one event, then hang up

    asyncio.run(run())
    assert _wait_all_idle(controller, ray)
    assert metric(url, ABORTED) == aborted + 1
    assert _decode_finished(controller, ray) == finished, "the request ran to its end instead of being aborted"


def test_health_models_metrics(service):
    url = service["url"]
    assert get(url + "/health")[0] == 200
    counted = ('pdserve_requests_total{finish_reason="length"}', "pdserve_ttft_seconds_count",
               "pdserve_tpot_seconds_count", "pdserve_e2e_seconds_count")
    before = {name: metric(url, name) for name in counted + ("pdserve_generation_tokens_total",)}
    for i in range(3):  # its own traffic: this test does not lean on earlier ones
        status, out, _ = post(url + "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7 + i], "max_tokens": 4,
                                                        "ignore_eos": True})
        assert status == 200 and out["choices"][0]["finish_reason"] == "length", out
    for name in counted:
        assert metric(url, name) == before[name] + 3, name
    assert metric(url, "pdserve_generation_tokens_total") == before["pdserve_generation_tokens_total"] + 12
    status, text = get(url + "/metrics")
    assert status == 200
    for name in ("pdserve_ttft_seconds_bucket", 'pdserve_pool_kv_usage{pool="decode"}',
                 'pdserve_pool_queue_depth{pool="prefill"}', 'pdserve_pool_workers{pool="decode"}'):
        assert name in text
