"""Between protobuf messages and engine objects, validating on the way in."""

from __future__ import annotations

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protos import pdserve_pb2 as pb


def sampling_from_proto(message: pb.SamplingOptions) -> SamplingParams:
    """SamplingParams from the wire; raises ValueError naming a bad field.

    proto3 cannot tell an unset float from 0: `top_p == 0` and `repetition_penalty == 0`
    mean unset (1.0). `max_tokens` and `temperature` are taken as sent (0 max_tokens is an
    error, 0 temperature greedy).
    """
    return SamplingParams(
        max_tokens=int(message.max_tokens),
        temperature=float(message.temperature),
        top_p=float(message.top_p) if message.top_p != 0 else 1.0,
        top_k=int(message.top_k),
        seed=int(message.seed) if message.HasField("seed") else None,
        stop_token_ids=tuple(int(t) for t in message.stop_token_ids),
        ignore_eos=bool(message.ignore_eos),
        first_position=int(message.first_position),
        logprobs=int(message.logprobs) if message.HasField("logprobs") else None,
        presence_penalty=float(message.presence_penalty),
        frequency_penalty=float(message.frequency_penalty),
        repetition_penalty=float(message.repetition_penalty) if message.repetition_penalty != 0 else 1.0,
        min_tokens=int(message.min_tokens),
        logit_bias={int(t): float(b) for t, b in message.logit_bias.items()},
        json_schema=message.json_schema or None,
        prompt_logprobs=int(message.prompt_logprobs) if message.HasField("prompt_logprobs") else None,
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    message = pb.SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        first_position=params.first_position, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, repetition_penalty=params.repetition_penalty,
        min_tokens=params.min_tokens, logit_bias=dict(params.logit_bias), json_schema=params.json_schema or "",
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    return message


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
    def value(v):
        if isinstance(v, int | float | str | bool | bytes):
            return v
        if hasattr(v, "DESCRIPTOR"):
            return message_dict(v)
        if hasattr(v, "items"):
            return {k: value(x) for k, x in v.items()}
        return [value(x) for x in v]

    return {f.name: value(getattr(message, f.name)) for f in message.DESCRIPTOR.fields}
