"""End to end through HTTP: router + Ray-managed prefill and decode pools (tiny model)."""

import asyncio
import json
import random

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from tests.e2e.http import get, metric, post, stream


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
        assert out["usage"] == {"prompt_tokens": len(p), "completion_tokens": 12, "total_tokens": len(p) + 12}

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
        assert events[-1]["usage"] == {"prompt_tokens": len(p), "completion_tokens": n, "total_tokens": len(p) + n}
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
    ({"model": "tiny", "prompt": "x", "n": 2}, 400, "only n=1"),
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
          "seed": JSON, "stop": JSON, "stream": st.booleans() | JSON, "messages": JSON, "n": JSON}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.fixed_dictionaries({}, optional=FIELDS), JSON, st.binary(max_size=64)),
       chat=st.booleans())
def test_fuzzed_bodies_never_get_a_500(service, body, chat):
    """Malformed: a 4xx with an OpenAI error object (never 5xx: not 500, not 502/503 either).
    Valid: 200 and a complete response (a JSON completion, or an SSE stream when asked)."""
    raw = body if isinstance(body, bytes) else json.dumps(body)
    status, out, headers = post(service["url"] + ("/v1/chat/completions" if chat else "/v1/completions"), raw)
    if status != 200:
        assert 400 <= status < 500, (status, out)
        assert isinstance(out.get("error"), dict) and isinstance(out["error"]["message"], str), out
        assert out["error"]["message"], out
        return
    kind = "chat.completion" if chat else "text_completion"
    if isinstance(body, dict) and body.get("stream") is True:
        assert headers["Content-Type"].startswith("text/event-stream"), headers
        assert out["done"] and out["events"], out
        assert not [e for e in out["events"] if "error" in e], out
        assert {e["object"] for e in out["events"]} == {kind + ".chunk" if chat else kind}
        finishes = [c["finish_reason"] for e in out["events"] for c in e["choices"] if c["finish_reason"]]
        assert len(finishes) == 1 and finishes[0] in ("stop", "length"), out
    else:
        assert out["object"] == kind and out["choices"][0]["finish_reason"] in ("stop", "length"), out
        assert out["usage"]["completion_tokens"] >= 1


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


def test_admin_endpoints_need_the_token(service):
    url = service["url"]
    assert get(url + "/admin/status")[0] == 401
    assert get(url + "/admin/status", {"Authorization": "Bearer wrong"})[0] == 401
    status, text = get(url + "/admin/status", {"Authorization": "Bearer secret-token"})
    assert status == 200 and json.loads(text)["pools"]["decode"]["target"] == 1
    status, out, _ = post(url + "/admin/scale", {"decode": 0}, {"Authorization": "Bearer secret-token"})
    assert status == 422 and "decode" in out["error"]["message"]
