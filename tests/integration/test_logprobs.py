"""Log-probabilities: the engine's against HF transformers' log-softmax (greedy) and against
a reference implementation of temperature + top-p (sampled); then served through the router
over real workers, on every path (remote prefill over both transports, and prefill on the
decode worker), streamed and not, in OpenAI's shapes as the `openai` client's own models
read them, with the offline engine's values."""

import math

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testkit.workers import SERVING_PATHS, serving_path, stats_of
from tests.e2e.http import post

PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def fp32_engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=64 << 20)


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_greedy_logprobs_are_the_models_log_softmax(fp32_engine, tiny_llama_dir):
    [out] = fp32_engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True))
    logprobs = out.outputs[0].logprobs
    assert [lp.token_id for lp in logprobs] == out.token_ids
    reference = torch.log_softmax(_hf_logits(tiny_llama_dir, PROMPT + out.token_ids), dim=-1)
    for i, lp in enumerate(logprobs):
        row = reference[len(PROMPT) - 1 + i]
        assert abs(row[lp.token_id].item() - lp.logprob) < 1e-4, i
        top = row.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top.values.tolist(), strict=True)) < 1e-4
        assert lp.top[0][0] == lp.token_id, "greedy picks the most likely token"


@pytest.mark.parametrize("budget", [2048, 7], ids=["one-chunk", "chunks-of-7"])
def test_prompt_logprobs_are_the_models_log_softmax(tiny_llama_dir, budget):
    """Each prompt token's logprob given the tokens before it, chunked or not, and again
    when the prompt is in the prefix cache (a scoring request computes it all again)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=64 << 20, max_num_batched_tokens=budget)
    reference = torch.log_softmax(_hf_logits(tiny_llama_dir, PROMPT), dim=-1)
    for _ in range(2):
        [out] = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))
        scored = out.prompt_logprobs
        assert scored[0] is None and len(scored) == len(PROMPT)
        for i, lp in enumerate(scored[1:], start=1):
            row = reference[i - 1]
            assert lp.token_id == PROMPT[i] and abs(lp.logprob - row[PROMPT[i]].item()) < 1e-4, i
            assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
    [cached] = llm.generate([PROMPT], SamplingParams(max_tokens=1))
    assert cached.num_cached_tokens > 0 and cached.prompt_logprobs is None, "the prompt was cached after all"


def _reference_sampled(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The formula, written out: softmax(logits / T); keep the most likely tokens until their
    mass reaches top_p (the one crossing it included); renormalise; log."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[mass_before < top_p]] = True
    filtered = torch.where(kept, probs, torch.zeros_like(probs))
    return torch.log(filtered / filtered.sum())


def test_sampled_logprobs_are_of_the_distribution_sampled_from(fp32_engine, tiny_llama_dir):
    params = SamplingParams(max_tokens=6, temperature=0.7, top_p=0.5, seed=11, logprobs=4, ignore_eos=True)
    [out] = fp32_engine.generate([PROMPT], params)
    logits = _hf_logits(tiny_llama_dir, PROMPT + out.token_ids)
    for i, lp in enumerate(out.outputs[0].logprobs):
        reference = _reference_sampled(logits[len(PROMPT) - 1 + i], 0.7, 0.5)
        assert abs(reference[lp.token_id].item() - lp.logprob) < 1e-4, i
        for token, value in lp.top:
            expected = reference[token].item()
            assert (value == expected == -math.inf) or abs(value - expected) < 1e-4, (i, token, value, expected)


def test_requests_without_logprobs_get_none_and_the_same_tokens(fp32_engine):
    plain = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    asked = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, logprobs=0)
    [a, b] = fp32_engine.generate([PROMPT, PROMPT], [plain, asked])
    assert a.outputs[0].logprobs is None
    assert a.token_ids == b.token_ids and all(lp.top == () for lp in b.outputs[0].logprobs)


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_out_of_range_logprobs_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        SamplingParams(logprobs=bad)


# ------------------------------------------------------------------ through the router

@pytest.fixture(scope="module", params=sorted(SERVING_PATHS))
def served(request, tiny_llama_dir):
    with serving_path(str(tiny_llama_dir), request.param) as served:
        yield served


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    """The engine in the workers' dtype (auto on both), for the values they must serve."""
    return LLM(str(tiny_llama_dir), kv_cache_bytes=64 << 20)


SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.9, "top_p": 0.8, "seed": 21}}


def _offline_logprobs(offline, sampling: dict, k: int, prompt=PROMPT, max_tokens: int = 8):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=k, **sampling)
    [out] = offline.generate([prompt], params)
    return out.token_ids, out.outputs[0].logprobs


def _close(a: float, b: float) -> bool:
    b = -9999.0 if b == -math.inf else b
    return abs(a - b) < 1e-5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_completions_logprobs_on_every_path(served, offline, sampling, stream):
    from openai.types import Completion
    from openai.types.completion_choice import Logprobs

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "logprobs": 2,
            "return_token_ids": True, "stream": stream, **SAMPLINGS[sampling]}
    status, out, _ = post(served["url"] + "/v1/completions", body)
    assert status == 200, out
    # a stream chunk has no finish_reason until the last, which the client's Completion model
    # (used there without validation) does not allow: validate each chunk's logprobs instead
    choices = [e["choices"][0] for e in out["events"]] if stream \
        else [Completion.model_validate(out).choices[0].model_dump()]
    ids = [t for c in choices for t in c["token_ids"]]
    parsed = [Logprobs.model_validate(c["logprobs"]) for c in choices if c["logprobs"]]
    token_logprobs = [v for lp in parsed for v in lp.token_logprobs]
    tops = [t for lp in parsed for t in lp.top_logprobs]
    tokens = [t for lp in parsed for t in lp.tokens]
    offsets = [o for lp in parsed for o in lp.text_offset]
    reference_ids, reference = _offline_logprobs(offline, SAMPLINGS[sampling], 2)
    assert ids == reference_ids
    assert len(token_logprobs) == len(tops) == len(tokens) == 8
    assert all(_close(v, lp.logprob) for v, lp in zip(token_logprobs, reference, strict=True)), served["path"]
    tokenizer = offline.get_tokenizer()
    for top, lp in zip(tops, reference, strict=True):
        expected = {tokenizer.decode([t]): v for t, v in lp.top}
        assert top.keys() == expected.keys() and all(_close(top[k], expected[k]) for k in top)
    assert tokens == [tokenizer.decode([t]) for t in ids]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_on_every_path(served, offline, stream):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "ignore_eos": True, "temperature": 0.0,
            "logprobs": True, "top_logprobs": 3, "return_token_ids": True, "stream": stream}
    status, out, _ = post(served["url"] + "/v1/chat/completions", body)
    assert status == 200, out
    if stream:
        choices = [ChatCompletionChunk.model_validate(e).choices[0] for e in out["events"]]
    else:
        choices = [ChatCompletion.model_validate(out).choices[0]]
    content = [c for choice in choices if choice.logprobs for c in choice.logprobs.content]
    ids = [t for choice in choices for t in (choice.model_extra.get("token_ids") or [])]
    tokenizer = offline.get_tokenizer()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
    reference_ids, reference = _offline_logprobs(offline, {"temperature": 0.0}, 3, list(prompt), 6)
    assert ids == reference_ids and len(content) == 6
    for entry, lp in zip(content, reference, strict=True):
        assert entry.token == tokenizer.decode([lp.token_id]) and entry.bytes == list(entry.token.encode())
        assert _close(entry.logprob, lp.logprob)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t, _ in lp.top]
        assert all(_close(t.logprob, v) for t, (_, v) in zip(entry.top_logprobs, lp.top, strict=True))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_returns_the_prompt_and_its_logprobs_on_every_path(served, offline, stream):
    """Completions `echo` with `logprobs` (what evaluation harnesses score with): the text
    starts with the prompt, and the logprobs with the prompt's tokens, the first null (as
    OpenAI answers; the openai client's Logprobs model, which types them as floats, is
    built without validation, as in the client test below)."""
    prompt = "The quick brown fox jumps over the lazy dog"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 1, "echo": True,
            "temperature": 0.0, "stream": stream}
    status, out, _ = post(served["url"] + "/v1/completions", body)
    assert status == 200, out
    choices = [e["choices"][0] for e in out["events"]] if stream else [out["choices"][0]]
    parsed = [c["logprobs"] for c in choices if c["logprobs"]]
    token_logprobs = [v for lp in parsed for v in lp["token_logprobs"]]
    tops = [t for lp in parsed for t in lp["top_logprobs"]]
    tokens = [t for lp in parsed for t in lp["tokens"]]
    offsets = [o for lp in parsed for o in lp["text_offset"]]
    tokenizer = offline.get_tokenizer()
    ids = tokenizer.encode(prompt)
    [reference] = offline.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0,
                                                            logprobs=1, prompt_logprobs=1))
    expected = reference.prompt_logprobs[1:] + reference.outputs[0].logprobs
    assert "".join(c["text"] for c in choices) == prompt + reference.text
    assert tokens == [tokenizer.decode([t]) for t in ids + reference.token_ids]
    assert token_logprobs[0] is None and tops[0] is None and len(token_logprobs) == len(ids) + 3
    assert all(_close(v, lp.logprob) for v, lp in zip(token_logprobs[1:], expected, strict=True)), served["path"]
    for top, lp in zip(tops[1:], expected, strict=True):
        assert list(top) == [tokenizer.decode([t]) for t, _ in lp.top]
        assert _close(next(iter(top.values())), lp.top[0][1])
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_echo_without_logprobs_and_through_the_openai_client(served):
    from openai import OpenAI

    client = OpenAI(base_url=served["url"] + "/v1", api_key="unused")
    plain = client.completions.create(model="tiny", prompt="Hello there", max_tokens=2, echo=True)
    assert plain.choices[0].text.startswith("Hello there") and plain.choices[0].logprobs is None
    scored = client.completions.create(model="tiny", prompt="Hello there", max_tokens=1, echo=True, logprobs=0)
    assert scored.choices[0].logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in scored.choices[0].logprobs.token_logprobs[1:])


ADJUSTED = {"presence_penalty": 0.4, "frequency_penalty": 0.8, "repetition_penalty": 1.2, "min_tokens": 3}


@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_penalties_and_bias_on_every_path(served, offline, sampling):
    """The logit adjustments reach whichever worker samples (the prefill worker samples the
    first token on the remote paths): tokens and logprobs equal the offline engine's."""
    bias = {"9": 12.0, "12": -100.0}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "logprobs": 0, "return_token_ids": True,
            "logit_bias": bias, **ADJUSTED, **SAMPLINGS[sampling]}
    status, out, _ = post(served["url"] + "/v1/completions", body)
    assert status == 200, out
    params = SamplingParams(max_tokens=10, logprobs=0, logit_bias={int(k): v for k, v in bias.items()},
                            **ADJUSTED, **SAMPLINGS[sampling])
    [reference] = offline.generate([PROMPT], params)
    choice = out["choices"][0]
    assert choice["token_ids"] == reference.token_ids and 12 not in choice["token_ids"]
    served_values = choice["logprobs"]["token_logprobs"]
    assert all(_close(v, lp.logprob) for v, lp in zip(served_values, reference.outputs[0].logprobs, strict=True))
    plain = offline.generate([PROMPT], SamplingParams(max_tokens=10, **SAMPLINGS[sampling]))[0].token_ids
    assert plain != reference.token_ids, "the adjustments changed the output"


def test_min_tokens_on_every_path(served, offline):
    """EOS, biased to be the argmax, is held back for min_tokens tokens, the first of which
    the prefill worker samples on the remote paths."""
    eos = min(offline.engine.loaded.eos_token_ids)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0.0, "return_token_ids": True,
            "logit_bias": {str(eos): 100.0}, "min_tokens": 4}
    status, out, _ = post(served["url"] + "/v1/completions", body)
    assert status == 200, out
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == 5 and eos not in ids[:4] and ids[4] == eos and out["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(("fields", "status", "param", "message"), [
    ({"logit_bias": {"abc": 1.0}}, 400, "logit_bias", "keys must be token ids in [0, 49152), got 'abc'"),
    ({"logit_bias": {"49152": 1.0}}, 400, "logit_bias", "keys must be token ids in [0, 49152), got '49152'"),
    ({"logit_bias": {"5": 101.0}}, 400, "logit_bias", "values must be in [-100, 100]"),
    ({"min_tokens": 9, "max_tokens": 4}, 400, "min_tokens", "min_tokens (9) exceeds max_tokens (4)"),
    ({"presence_penalty": 2.5}, 422, "presence_penalty", "presence_penalty"),
    ({"repetition_penalty": 0.0}, 422, "repetition_penalty", "repetition_penalty"),
])
def test_bad_adjustments_name_the_field(served, fields, status, param, message):
    got, out, _ = post(served["url"] + "/v1/completions", {"model": "tiny", "prompt": [5, 6], **fields})
    assert got == status and out["error"]["param"] == param and message in out["error"]["message"], out


def test_the_openai_client_reads_chat_logprobs(served):
    from openai import OpenAI

    client = OpenAI(base_url=served["url"] + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0.0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob for c in content)


@pytest.mark.parametrize(("fields", "message"), [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": "2"}, "logprobs"),
])
def test_bad_completions_logprobs_name_the_field(served, fields, message):
    status, out, _ = post(served["url"] + "/v1/completions", {"model": "tiny", "prompt": [5, 6], **fields})
    assert status == 422 and message in out["error"]["message"], out


def test_top_logprobs_without_logprobs_is_a_400(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}
    status, out, _ = post(served["url"] + "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "top_logprobs" and "needs logprobs: true" in \
        out["error"]["message"], out


def test_every_request_took_its_path(served):
    """Run after the tests above on each path: a remote prefill that failed would have fallen
    back to prefilling on the decode worker (and still served the same values)."""
    import asyncio

    stats = asyncio.run(stats_of(served["decode"].address, "decode"))
    decisions = dict(stats.prefill_decisions)
    where = "local" if served["path"] == "local" else "remote"
    assert stats.num_failed_transfers == 0, (decisions, served["decode"].log()[-3000:])
    served_here = 4 + 2 + 2 + 2 + 2 + 1 + 1  # completions, echo, echo+client, chat, penalties, min_tokens, client
    assert sum(decisions.values()) == served_here and all(k.startswith(where + "/") for k in decisions), decisions
