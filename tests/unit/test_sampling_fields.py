"""Every SamplingParams field survives HTTP -> router -> protobuf bytes -> worker, with the
real request models and real serialization; the fields are enumerated, so a new one is
covered without editing this test. A field declared on one side of the wire only fails
loudly (never silently dropped)."""

import dataclasses
import json
import subprocess
import sys
import types
import typing

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos import pdserve_pb2 as pb
from pdserve.protos.convert import sampling_from_proto, sampling_to_proto, wire_fields
from pdserve.router.errors import APIError
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.registry import ModelInfo
from pdserve.router.sampling import request_sampling

FIELDS = dataclasses.fields(SamplingParams)
DEFAULTS = SamplingParams()
ROUTER_ONLY = {f.name for f in FIELDS if not f.metadata.get("wire", True)}
MODEL = ModelInfo(max_model_len=64, vocab_size=100)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
# The request fields for the SamplingParams fields that OpenAI names or means differently
# (router/sampling.py maps them), and the value each arrives as; every other field is sent
# under its own name, with a non-default value of its type (`_non_default`).
OPENAI_FORMS = {
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
                    json.dumps(SCHEMA)),
    "prompt_logprobs": ({"echo": True, "logprobs": 2}, 2),
    "logit_bias": ({"logit_bias": {"7": 1.5, "5": -2.0}}, ((5, -2.0), (7, 1.5))),
}
# set by the router itself, not by a request field: a resumed leg's first_position; the
# detokenizer's skip_special_tokens
NOT_OVER_HTTP = {"first_position", "skip_special_tokens"}
CANDIDATES = {int: (3, 1), float: (0.5, 1.5), bool: (True, False), str: ("zz",)}  # exact in float32


def _non_default(field: dataclasses.Field):
    """A value of `field`'s type that SamplingParams accepts and that is not its default."""
    hint = typing.get_type_hints(SamplingParams)[field.name]
    if isinstance(hint, types.UnionType):
        (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
    wrap = (lambda value: (value,)) if typing.get_origin(hint) is tuple else (lambda value: value)
    element = typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else hint
    for candidate in map(wrap, CANDIDATES.get(element, ())):
        if candidate != getattr(DEFAULTS, field.name):
            try:
                return getattr(SamplingParams(**{field.name: candidate}), field.name)
            except ValueError:
                continue
    pytest.fail(f"no non-default value for SamplingParams.{field.name}: add its request form to OPENAI_FORMS")


def _router_side(field: dataclasses.Field) -> tuple[SamplingParams, object]:
    """The router's SamplingParams for a completions request that sets `field` (through the
    request when a request field carries it, else directly), and the value it should hold."""
    if field.name in OPENAI_FORMS:
        request, expected = OPENAI_FORMS[field.name]
    else:
        expected = _non_default(field)
        carried = field.name not in NOT_OVER_HTTP
        assert not carried or field.name in CompletionRequest.model_fields, \
            f"SamplingParams.{field.name}: declare it on the request model (router/protocol.py) or in NOT_OVER_HTTP"
        request = {field.name: list(expected) if isinstance(expected, tuple) else expected} if carried else {}
    body = CompletionRequest.model_validate_json(json.dumps({"model": "m", "prompt": "hi", **request}))
    params = request_sampling(body, MODEL, num_prompt_tokens=2)
    if not request:
        params = dataclasses.replace(params, **{field.name: expected})
    return params, expected


def _over_the_wire(params: SamplingParams) -> SamplingParams:
    """What a worker decodes from the bytes the router sends for `params`."""
    return sampling_from_proto(pb.SamplingOptions.FromString(sampling_to_proto(params).SerializeToString()))


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_sampling_field_survives_http_router_proto_and_worker(field):
    params, expected = _router_side(field)
    assert getattr(params, field.name) == expected != getattr(DEFAULTS, field.name)
    worker = _over_the_wire(params)
    # a ROUTER_ONLY field (stop strings, skip_special_tokens) is applied by the router's own
    # detokenizer; the worker gets its default; every other field arrives as the router set it
    assert worker == dataclasses.replace(params, **{name: getattr(DEFAULTS, name) for name in ROUTER_ONLY})
    assert (getattr(worker, field.name) == expected) == (field.name not in ROUTER_ONLY)


@pytest.mark.parametrize(("request_fields", "expected"), [
    ({"max_completion_tokens": 5}, {"max_tokens": 5}),
    ({"max_tokens": 100}, {"max_tokens": 62}),  # clamped to the context left after the prompt
    ({"top_k": -1}, {"top_k": 0}),
    ({"stop": "end"}, {"stop": ("end",)}),
    ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
    ({"logprobs": True}, {"logprobs": 0}),
    ({"response_format": {"type": "json_object"}}, {"json_schema": '{"type": "object"}'}),
    ({"response_format": {"type": "text"}}, {"json_schema": None}),
])
def test_chat_fields_that_openai_names_differently_are_mapped(request_fields, expected):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **request_fields})
    params = request_sampling(body, MODEL, num_prompt_tokens=2)
    assert {name: getattr(params, name) for name in expected} == expected
    assert _over_the_wire(params) == dataclasses.replace(params, stop=())


@pytest.mark.parametrize(("request_fields", "param"), [
    ({"logit_bias": {"100": 1.0}}, "logit_bias"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"suffix": "x"}, "suffix"),
])
def test_an_invalid_sampling_field_is_a_400_naming_it(request_fields, param):
    body = CompletionRequest.model_validate({"model": "m", "prompt": "hi", **request_fields})
    with pytest.raises(APIError) as raised:
        request_sampling(body, MODEL, num_prompt_tokens=2)
    assert raised.value.status == 400 and raised.value.param == param


def test_zero_on_the_wire_means_the_default_where_zero_is_invalid_or_the_default_none():
    """proto3 cannot tell an unset number from 0: an otherwise empty message decodes to the
    defaults, but for max_tokens and temperature, which are taken as sent."""
    assert sampling_from_proto(pb.SamplingOptions(max_tokens=4)) == SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        sampling_from_proto(pb.SamplingOptions())


def test_a_sampling_field_missing_from_the_proto_fails_loudly():
    extended = dataclasses.make_dataclass("Extended", [("top_a", float, dataclasses.field(default=0.0))],
                                          bases=(SamplingParams,), frozen=True)
    with pytest.raises(TypeError, match=r"SamplingOptions lacks \['top_a'\]"):
        wire_fields(extended, pb.SamplingOptions.DESCRIPTOR)
    # and so does importing the converters once SamplingParams has such a field
    code = ("import dataclasses, pdserve.engine.sampling_params as sp\n"
            "sp.SamplingParams = dataclasses.make_dataclass('SamplingParams', [('top_a', float, 0.0)],"
            " bases=(sp.SamplingParams,), frozen=True)\n"
            "import pdserve.protos.convert\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "SamplingOptions lacks ['top_a']" in result.stderr, result.stderr


def test_a_proto_field_missing_from_sampling_params_fails_loudly():
    fewer = dataclasses.make_dataclass("Fewer", [(f.name, f.type, dataclasses.field(
        default=f.default, default_factory=f.default_factory, metadata=f.metadata))
        for f in FIELDS if f.name != "min_tokens"], frozen=True)
    with pytest.raises(TypeError, match=r"Fewer lacks \['min_tokens'\]"):
        wire_fields(fewer, pb.SamplingOptions.DESCRIPTOR)


def test_a_none_default_needs_proto3_optional_to_travel():
    """A None default on a number without presence could not carry 0 (KVLayout.num_layers
    stands in for such a field)."""
    names = [f.name for f in pb.KVLayout.DESCRIPTOR.fields]
    layout = dataclasses.make_dataclass("Layout", [(name, object, None) for name in names])
    with pytest.raises(TypeError, match="num_layers: its default is None"):
        wire_fields(layout, pb.KVLayout.DESCRIPTOR)
