"""Between protobuf messages and engine objects, validating on the way in."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from protos import pdserve_pb2 as pb


def sampling_from_proto(message: pb.SamplingOptions) -> SamplingParams:
    """SamplingParams from the wire; raises ValueError naming a bad field.

    proto3 cannot tell an unset float from 0: `top_p == 0` means unset (1.0). `max_tokens`
    and `temperature` are taken as sent (0 max_tokens is an error, 0 temperature greedy).
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
    )


def sampling_to_proto(params: SamplingParams) -> pb.SamplingOptions:
    message = pb.SamplingOptions(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        first_position=params.first_position,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message

