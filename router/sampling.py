"""The SamplingParams an OpenAI request body asks for, or a 400 naming the field.

A SamplingParams field takes the request's field of the same name as it is (temperature,
top_p, seed, stop, stop_token_ids, the penalties, ...): adding a sampling field is declaring
it on SamplingParams, the .proto and the request model, with no code here. Only the fields
whose OpenAI name or meaning differs are mapped, in `_openai_fields`: `max_tokens` (or
`max_completion_tokens`, clamped to the context), `top_k` (-1 disables), `logprobs`
(completions' count, chat's flag with `top_logprobs`), `logit_bias` (string keys),
`response_format` (-> json_schema) and completions' `echo` (-> prompt_logprobs). `n`
choices are the caller's (one SamplingParams per choice).
"""

from __future__ import annotations

from dataclasses import fields

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.errors import APIError


def request_sampling(body, model, num_prompt_tokens: int) -> SamplingParams:
    """The SamplingParams of `body` (a `protocol` request) for a prompt of `num_prompt_tokens`
    on `model` (`max_model_len`, `vocab_size`; 0: unknown). APIError 400 naming the field
    when the request is one pdserve does not serve or its values are invalid."""
    _refuse_unsupported(body)
    max_tokens = _max_tokens(body, model.max_model_len, num_prompt_tokens)
    mapped = _openai_fields(body, max_tokens, model.vocab_size or None)
    same_named = {f.name: getattr(body, f.name) for f in fields(SamplingParams)
                  if f.name in type(body).model_fields and f.name not in mapped}
    try:
        return SamplingParams(**same_named, **mapped)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ")[0]) from None


def _refuse_unsupported(body) -> None:
    """APIError 400 naming a field whose value pdserve does not implement."""
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, unsupported, unsupported.split(":")[0])
    if getattr(body, "suffix", None):
        raise APIError(400, "suffix: not supported", "suffix")


def _max_tokens(body, max_len: int, num_prompt_tokens: int) -> int:
    """The tokens to generate: as requested, at most what the context (`max_len`, 0:
    unbounded) leaves after the prompt; APIError 400 when the prompt fills it."""
    if max_len and num_prompt_tokens >= max_len:
        raise APIError(400, f"prompt has {num_prompt_tokens} tokens but the model's maximum context length "
                            f"is {max_len}; shorten the prompt", "prompt", "context_length_exceeded")
    max_tokens = body.requested_max_tokens
    return min(max_tokens, max_len - num_prompt_tokens) if max_len else max_tokens


def _openai_fields(body, max_tokens: int, vocab_size: int | None) -> dict:
    """The SamplingParams fields that OpenAI names or means differently, by SamplingParams
    name; APIError 400 naming the request's field that is invalid."""
    try:
        bias = body.logit_bias_ids(vocab_size)
    except ValueError as exc:
        raise APIError(400, str(exc), "logit_bias") from None
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    try:
        json_schema = body.json_schema()
    except ValueError as exc:
        raise APIError(400, str(exc), "response_format") from None
    return {"max_tokens": max_tokens, "top_k": max(0, body.top_k), "logprobs": body.num_logprobs(),
            "logit_bias": bias, "json_schema": json_schema,
            "prompt_logprobs": body.num_logprobs() if getattr(body, "echo", False) else None}
