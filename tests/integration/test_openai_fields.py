"""The OpenAI fields real clients send, over the bare router, real workers and real HTTP:
chat `content` as a list of text parts, `stream_options.continuous_usage_stats` (vLLM's
extension that benchmark clients such as guidellm send), `n` choices, clear 400s for tools,
`GET /v1/models`, and vLLM's `/tokenize` and `/detokenize`."""

import time

import pytest

from pdserve.testkit.workers import RouterProcess, WorkerProcess
from tests.e2e.http import get, post

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    model = str(tiny_llama_dir)
    started = int(time.time())
    with WorkerProcess("prefill", model) as p, WorkerProcess("decode", model) as d, \
            RouterProcess(model, [p.address], [d.address]) as router:
        yield {"url": router.url, "model": model, "started": started, "prefill": p, "decode": d}


def _greedy_chat(url: str, content, **fields) -> tuple[int, dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **fields}
    status, out, _ = post(url + CHAT, body)
    return status, out


def test_text_parts_are_served_as_their_newline_joined_text(served):
    status, parts = _greedy_chat(served["url"], [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}])
    assert status == 200, parts
    status, joined = _greedy_chat(served["url"], "Hello\nthere")
    assert status == 200, joined
    assert parts["usage"]["prompt_tokens"] == joined["usage"]["prompt_tokens"]
    assert parts["choices"][0]["token_ids"] == joined["choices"][0]["token_ids"]
    status, other = _greedy_chat(served["url"], "Hello there")
    assert other["usage"]["prompt_tokens"] != joined["usage"]["prompt_tokens"] or \
        other["choices"][0]["token_ids"] != joined["choices"][0]["token_ids"], "the parts' text reached the model"


def test_the_openai_client_sends_content_parts(served):
    from openai import OpenAI

    client = OpenAI(base_url=served["url"] + "/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tiny", max_tokens=5, temperature=0.0,
        messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens >= 1


@pytest.mark.parametrize(("content", "message"), [
    ([{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
     "messages[0].content[1]: only text parts are supported, got type 'image_url'"),
    ([{"type": "text"}], "messages[0].content[0]: a text part needs a 'text' string"),
])
def test_a_part_that_is_not_text_is_a_400_naming_it(served, content, message):
    status, out = _greedy_chat(served["url"], content)
    assert status == 400, out
    assert out["error"]["message"] == message and out["error"]["param"] == "messages"


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tools"),
])
def test_unsupported_chat_features_are_a_clear_400(served, fields, param):
    status, out = _greedy_chat(served["url"], "Hi", **fields)
    assert status == 400, out
    assert out["error"]["param"] == param and "not supported" in out["error"]["message"], out


@pytest.mark.parametrize("fields", [{"tool_choice": "none"}, {"response_format": {"type": "text"}},
                                    {"tools": [], "parallel_tool_calls": False}])
def test_neutral_values_of_those_fields_are_served(served, fields):
    status, out = _greedy_chat(served["url"], "Hi", **fields)
    assert status == 200 and out["usage"]["completion_tokens"] == 8, out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(served, chat):
    body = {"model": "tiny", "max_tokens": 12, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": [5, 6, 7]})
    status, out, _ = post(served["url"] + (CHAT if chat else "/v1/completions"), body)
    assert status == 200 and out["done"], out
    *chunks, last = out["events"]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12
    delivered = 0
    for chunk in chunks:
        delivered += len(chunk["choices"][0].get("token_ids") or [])
        usage = chunk["usage"]
        assert usage["completion_tokens"] == delivered, (chunk, delivered)
        assert usage["prompt_tokens"] == last["usage"]["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + delivered
    assert delivered == 12


def test_without_continuous_usage_only_the_last_chunk_has_usage(served):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    status, out, _ = post(served["url"] + "/v1/completions", body)
    assert status == 200 and out["done"], out
    assert [e for e in out["events"] if "usage" in e] == [out["events"][-1]]


def test_models_reports_created_and_max_model_len(served):
    import json

    from transformers import AutoConfig

    status, text = get(served["url"] + "/v1/models")
    [entry] = json.loads(text)["data"]
    assert status == 200 and entry["id"] == "tiny"
    assert served["started"] - 1 <= entry["created"] <= int(time.time())
    assert entry["max_model_len"] == AutoConfig.from_pretrained(served["model"]).max_position_embeddings


def test_tokenize_and_detokenize_match_the_models_tokenizer(served):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(served["model"])
    url, text = served["url"], "The printing press changed Europe."
    status, out, _ = post(url + "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert status == 200, out
    assert out["tokens"] == tokenizer(text).input_ids and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert out["max_model_len"] >= out["count"]
    status, back, _ = post(url + "/detokenize", {"model": "tiny", "tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(out["tokens"])}


def test_tokenize_messages_counts_what_a_chat_request_is_charged(served):
    url = served["url"]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    status, out, _ = post(url + "/tokenize", {"messages": messages})
    assert status == 200, out
    status, chat, _ = post(url + CHAT, {"model": "tiny", "messages": messages, "max_tokens": 1})
    assert status == 200 and chat["usage"]["prompt_tokens"] == out["count"], (out, chat)
    status, bare, _ = post(url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and bare["count"] < out["count"] and out["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt", "exactly one"),
    ("/tokenize", {}, 400, "prompt", "exactly one"),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ("/tokenize", {"prompt": 5}, 422, "prompt", "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "tokens must be integers in [0, 49152)"),
    ("/detokenize", {"tokens": "abc"}, 422, "tokens", "tokens"),
])
def test_tokenize_bad_input_names_the_field(served, path, body, status, param, message):
    got, out, _ = post(served["url"] + path, body)
    assert got == status, out
    assert out["error"]["param"] == param and message in out["error"]["message"], out


def test_api_keys_cover_tokenize_and_detokenize(served):
    with RouterProcess(served["model"], [served["prefill"].address], [served["decode"].address],
                       env={"PDSERVE_API_KEY": "sk-test"}) as keyed:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            status, out, _ = post(keyed.url + path, body)
            assert status == 401 and out["error"]["code"] == "invalid_api_key", out
            status, out, _ = post(keyed.url + path, body, headers={"Authorization": "Bearer sk-test"})
            assert status == 200, out


def _completion(url: str, **fields) -> dict:
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 10, "ignore_eos": True, "temperature": 1.0,
            "return_token_ids": True, **fields}
    status, out, _ = post(url + "/v1/completions", body)
    assert status == 200, out
    return out


def test_n_choices_are_the_requests_with_seeds_seed_plus_i(served):
    url = served["url"]
    many = _completion(url, n=3, seed=40, logprobs=0)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    singles = [_completion(url, seed=40 + i, logprobs=0)["choices"][0] for i in range(3)]
    for choice, single in zip(many["choices"], singles, strict=True):
        assert choice["token_ids"] == single["token_ids"] and choice["text"] == single["text"]
        assert choice["logprobs"]["token_logprobs"] == single["logprobs"]["token_logprobs"]
    assert len({tuple(c["token_ids"]) for c in many["choices"]}) == 3, "each choice has its own seed"
    assert many["usage"]["prompt_tokens"] == 4 and many["usage"]["completion_tokens"] == 30
    again = _completion(url, n=3, seed=40, logprobs=0)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in many["choices"]]


def test_unseeded_choices_differ(served):
    out = _completion(served["url"], n=4)
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) == 4 and out["usage"]["completion_tokens"] == 40


def test_choices_share_the_prompts_kv_through_the_prefix_caches(served):
    """The first choice computes the prompt; the others start once it has its first token
    and find the prompt's full blocks cached on the decode worker and the prefill worker, so
    each computes only the tail after them."""
    import asyncio

    from pdserve.kv_transfer.layout import KVLayout
    from pdserve.protos import pdserve_pb2 as pb
    from pdserve.testkit.workers import decode_stub, stats_of

    async def block_size() -> int:
        channel, stub = decode_stub(served["decode"].address)
        async with channel:
            return KVLayout.from_proto((await stub.Info(pb.InfoRequest())).layout).block_size

    def stats():
        return (asyncio.run(stats_of(served["decode"].address, "decode")),
                asyncio.run(stats_of(served["prefill"].address, "prefill")))

    size, prompt = asyncio.run(block_size()), list(range(3000, 3080))  # a prompt no other test sends
    cached = (len(prompt) - 1) // size * size  # full blocks short of the last token
    decode_before, prefill_before = stats()
    out = _completion(served["url"], prompt=prompt, n=3, max_tokens=4)
    assert [c["finish_reason"] for c in out["choices"]] == ["length"] * 3
    decode_after, prefill_after = stats()
    assert decode_after.prefix_cache_hit_tokens - decode_before.prefix_cache_hit_tokens == 2 * cached
    computed = prefill_after.prefill_tokens_computed - prefill_before.prefill_tokens_computed
    assert computed == len(prompt) + 2 * (len(prompt) - cached), computed


def test_streamed_choices_carry_their_index(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "ignore_eos": True,
            "seed": 9, "n": 2, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    status, out, _ = post(served["url"] + CHAT, body)
    assert status == 200 and out["done"], out
    *chunks, last = out["events"]
    by_index = {0: [], 1: []}
    for chunk in chunks:
        [choice] = chunk["choices"]
        by_index[choice["index"]].append(choice)
    for index, choices in by_index.items():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["length"]
        ids = [t for c in choices for t in c.get("token_ids") or []]
        status, single, _ = post(served["url"] + CHAT, {**body, "n": 1, "stream": False, "seed": 9 + index})
        assert ids == single["choices"][0]["token_ids"], index
    assert last["usage"]["completion_tokens"] == 12
