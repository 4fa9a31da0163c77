"""Structured output (`response_format`, `SamplingParams.json_schema`): output that parses
and validates against the schema (checked with `jsonschema`), from a random-weights model
that on its own writes no JSON at all; the same tokens as the offline engine on every
serving path (remote prefill over both transports, where the prefill worker samples the
first token under the mask, and prefill on the decode worker), streamed and not; the
`openai` client's own structured-output call; clear 400s for bad formats and schemas."""

import json

import jsonschema
import pytest

from pdserve.engine import LLM
from pdserve.engine.guided import ANY_OBJECT, GuideFactory
from pdserve.engine.sampling_params import SamplingParams
from pdserve.testkit.workers import SERVING_PATHS, serving_path, stats_of
from tests.e2e.http import post

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet", "flags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "fish"]},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
PROMPT = list(range(5, 30))
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "seed": 5}}


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    """The engine in the workers' dtype, for the tokens they must serve."""
    return LLM(str(tiny_llama_dir), kv_cache_bytes=64 << 20)


def _generate(llm, schema: str | None, max_tokens: int = 150, **sampling):
    params = SamplingParams(max_tokens=max_tokens, json_schema=schema, **sampling)
    [out] = llm.generate([PROMPT], params)
    return out.outputs[0]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}] + [{"temperature": 1.0, "seed": s} for s in range(4)],
                         ids=["greedy"] + [f"seed{s}" for s in range(4)])
def test_output_parses_and_validates_against_the_schema(offline, sampling):
    out = _generate(offline, json.dumps(SCHEMA), **sampling)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_the_model_alone_writes_no_json(offline):
    """What the tests above would see without the constraint."""
    for seed in range(3):
        text = _generate(offline, None, max_tokens=40, temperature=1.0, seed=seed).text
        with pytest.raises(ValueError):
            json.loads(text)


def test_json_object_is_any_object(offline):
    for seed in range(3):
        out = _generate(offline, ANY_OBJECT, max_tokens=300, temperature=1.0, seed=seed)
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict), out.text
        else:  # an unbounded object may run to max_tokens; what there is must be a valid prefix
            assert out.text.startswith("{"), out.text


def test_the_request_ends_when_the_json_is_complete(offline):
    """It stops at the closing brace, without waiting for the model to choose EOS."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    out = _generate(offline, json.dumps(schema), ignore_eos=True, temperature=1.0, seed=3)
    assert out.finish_reason == "stop" and json.loads(out.text) in ({"ok": True}, {"ok": False}), out.text


def test_a_guide_rolled_back_masks_as_a_fresh_one(offline, tiny_llama_dir):
    """`Guide.sync` is a function of the tokens generated: brought to a sequence by way of
    another (a different last token, as a resumed or recomputed request may), its mask is
    that of a guide that only ever saw the sequence."""
    factory = GuideFactory(offline.engine.tokenizer, offline.engine.loaded.shape.vocab_size)
    tokens = offline.engine.tokenizer.encode('{"name":"ab","age":1', add_special_tokens=False)
    moved, fresh = factory.new(json.dumps(SCHEMA)), factory.new(json.dumps(SCHEMA))
    moved.sync(tokens[:-1] + offline.engine.tokenizer.encode("x", add_special_tokens=False))
    moved.sync(tokens)
    fresh.sync(tokens)
    eos = frozenset({0})
    assert (moved.allowed(eos) == fresh.allowed(eos)).all() and not moved.finished


@pytest.mark.parametrize("schema", ['{"type": "objectx"}', "[1, 2]", "{not json"])
def test_a_bad_schema_is_refused_naming_it(offline, schema):
    with pytest.raises(ValueError, match="json_schema: "):
        _generate(offline, schema)


# ------------------------------------------------------------------ through the router

@pytest.fixture(scope="module", params=sorted(SERVING_PATHS))
def served(request, tiny_llama_dir):
    with serving_path(str(tiny_llama_dir), request.param) as served:
        yield served


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def _streamed_text(out: dict, chat: bool) -> tuple[str, list[int]]:
    text, ids = "", []
    for event in out["events"]:
        for choice in event["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            ids += choice.get("token_ids") or []
    return text, ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_completions_on_every_path_give_the_offline_tokens(served, offline, sampling, stream):
    expected = _generate(offline, json.dumps(SCHEMA), **SAMPLINGS[sampling])
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 150, "return_token_ids": True, "stream": stream,
            "response_format": _schema_format(SCHEMA), **SAMPLINGS[sampling]}
    status, out, _ = post(served["url"] + "/v1/completions", body)
    assert status == 200, out
    if stream:
        text, ids = _streamed_text(out, chat=False)
    else:
        text, ids = out["choices"][0]["text"], out["choices"][0]["token_ids"]
    assert ids == expected.token_ids and text == expected.text
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_json_object_on_every_path(served, stream):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Describe a cat as JSON."}],
            "max_tokens": 400, "temperature": 1.0, "seed": 1, "stream": stream,
            "response_format": {"type": "json_object"}}
    status, out, _ = post(served["url"] + "/v1/chat/completions", body)
    assert status == 200, out
    text = _streamed_text(out, chat=True)[0] if stream else out["choices"][0]["message"]["content"]
    assert isinstance(json.loads(text), dict), text


def test_the_openai_client_parses_into_its_model(served):
    """The openai client's structured-output call, with a pydantic model as the schema."""
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        kind: Literal["cat", "dog"]
        legs: int = Field(ge=0, le=8)

    client = OpenAI(base_url=served["url"] + "/v1", api_key="unused")
    completion = client.chat.completions.parse(model="tiny", response_format=Pet, max_tokens=100, temperature=0.0,
                                               messages=[{"role": "user", "content": "A pet, please."}])
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("response_format", "message"), [
    ({"type": "yaml"}, "response_format.type must be 'text', 'json_object' or 'json_schema', got 'yaml'"),
    ({"type": "json_schema"}, "response_format.json_schema: needs an object with a 'schema' object"),
    (_schema_format({"type": "objectx"}), "response_format.json_schema.schema: Invalid type: objectx"),
    (_schema_format({"type": "integer", "minimum": "x"}), "response_format.json_schema.schema: "),
])
def test_a_bad_response_format_is_a_400_naming_it(served, response_format, message):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "response_format": response_format}
    status, out, _ = post(served["url"] + "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == "response_format", out
    assert out["error"]["message"].startswith(message), out


def test_every_request_took_its_path(served):
    """Run after the tests above on each path: a remote prefill that failed would have fallen
    back to prefilling on the decode worker, whose mask would hide a prefill worker's bug."""
    import asyncio

    stats = asyncio.run(stats_of(served["decode"].address, "decode"))
    decisions = dict(stats.prefill_decisions)
    where = "local" if served["path"] == "local" else "remote"
    assert stats.num_failed_transfers == 0, (decisions, served["decode"].log()[-3000:])
    served_here = 4 + 2 + 1  # the completions, chat and openai-client tests' requests
    assert sum(decisions.values()) == served_here and all(k.startswith(where + "/") for k in decisions), decisions
