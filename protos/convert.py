"""Between protobuf messages and engine objects, validating on the way in.

SamplingParams and SamplingOptions convert field by field, by name, with no per-field code:
every SamplingParams field but the ROUTER_ONLY ones has a SamplingOptions field of its name,
and every SamplingOptions field a SamplingParams one (checked on import: a field declared on
one side only is a TypeError, never dropped). Wire conventions, declared once: a proto3
`optional` field left unset means the SamplingParams default (None for seed, logprobs);
without presence, 0 / "" means the default for a field whose default is None (json_schema)
or that is marked ZERO_IS_DEFAULT (top_p, repetition_penalty); maps travel as dicts,
repeated fields as tuples.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos import pdserve_pb2 as pb


class WireField(NamedTuple):
    """One SamplingParams field as it travels: `zero_is_default`: a zero value on the wire
    (0, "", empty) means `default`; `presence`: a proto3 `optional` field, unset means `default`."""

    name: str
    default: object
    presence: bool
    is_map: bool
    zero_is_default: bool


def wire_fields(params_type: type, descriptor) -> tuple[WireField, ...]:
    """The fields of dataclass `params_type` that travel in message `descriptor`, paired by
    name. TypeError naming a field that one side declares and the other lacks, and a field
    whose None default the wire could not carry (it needs proto3 `optional`, or a string)."""
    sent = [f for f in dataclasses.fields(params_type) if f.metadata.get("wire", True)]
    by_name = descriptor.fields_by_name
    missing = [f.name for f in sent if f.name not in by_name]
    extra = sorted(set(by_name) - {f.name for f in sent})
    if missing or extra:
        raise TypeError(f"{params_type.__name__} and {descriptor.name} (protos/pdserve.proto) must declare the "
                        f"same fields (or mark one ROUTER_ONLY): {descriptor.name} lacks {missing}, "
                        f"{params_type.__name__} lacks {extra}")
    out = []
    for f in sent:
        proto = by_name[f.name]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if default is None and not proto.has_presence and proto.type != proto.TYPE_STRING:
            raise TypeError(f"{descriptor.name}.{f.name}: its default is None, so the field needs "
                            f"proto3 `optional` to carry 0")
        is_map = proto.message_type is not None and proto.message_type.GetOptions().map_entry
        out.append(WireField(f.name, default, proto.has_presence, is_map,
                             default is None or bool(f.metadata.get("zero_is_default"))))
    return tuple(out)


_SAMPLING = wire_fields(SamplingParams, pb.SamplingOptions.DESCRIPTOR)


def sampling_from_proto(message: pb.SamplingOptions) -> SamplingParams:
    """SamplingParams from the wire (the conventions above); raises ValueError naming a bad
    field. `max_tokens` and `temperature` are taken as sent (0 max_tokens is an error, 0
    temperature greedy)."""
    values = {}
    for f in _SAMPLING:
        value = _plain(getattr(message, f.name))
        if f.presence:
            unset = not message.HasField(f.name)
        else:
            unset = f.zero_is_default and not value
        values[f.name] = f.default if unset else tuple(value) if isinstance(value, list) else value
    return SamplingParams(**values)


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    """The SamplingOptions that `sampling_from_proto` turns back into `params` (but for its
    ROUTER_ONLY fields, which keep their defaults)."""
    values = {f.name: getattr(params, f.name) for f in _SAMPLING}
    return pb.SamplingOptions(**{f.name: dict(values[f.name]) if f.is_map else values[f.name]
                                 for f in _SAMPLING if values[f.name] is not None})


def logprob_to_proto(logprob: TokenLogprob) -> pb.TokenLogprob:
    ids, values = zip(*logprob.top, strict=True) if logprob.top else ((), ())
    return pb.TokenLogprob(logprob=logprob.logprob, top_token_ids=ids, top_logprobs=values)


def logprob_from_proto(token_id: int, message: pb.TokenLogprob, vocab_size: int | None,
                       want: int) -> TokenLogprob:
    """The TokenLogprob of `token_id` from the wire; ValueError unless it carries exactly
    `want` alternatives, with ids in the vocabulary (`vocab_size=None`: any) and logprobs
    that are <= 0 and not NaN."""
    ids, values = list(message.top_token_ids), [float(v) for v in message.top_logprobs]
    if len(ids) != want or len(values) != want:
        raise ValueError(f"a token's logprobs carry {len(ids)} ids and {len(values)} values, expected {want}")
    if vocab_size is not None and any(t >= vocab_size for t in ids):
        raise ValueError(f"a top-logprob token id is outside the vocabulary of {vocab_size}")
    if any(not v <= 0 for v in (message.logprob, *values)):  # also refuses NaN
        raise ValueError("a logprob is positive or NaN")
    return TokenLogprob(token_id, float(message.logprob), tuple(zip(ids, values, strict=True)))


def message_dict(message) -> dict:
    """A message as plain Python values (for Ray and JSON): scalars as they are (uint64
    stays an int, unlike json_format), maps as dicts, repeated fields as lists, nested
    messages as dicts, every field present."""
    return {f.name: _plain(getattr(message, f.name)) for f in message.DESCRIPTOR.fields}


def _plain(v):
    """A field's value as plain Python: scalars as they are, maps as dicts, repeated fields
    as lists, nested messages as `message_dict`s."""
    if isinstance(v, int | float | str | bool | bytes):
        return v
    if hasattr(v, "DESCRIPTOR"):
        return message_dict(v)
    if hasattr(v, "items"):
        return {k: _plain(x) for k, x in v.items()}
    return [_plain(x) for x in v]
