"""Log-probabilities in OpenAI's response shapes (engine.outputs.TokenLogprob in, JSON out).

Chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...], "refusal": null}`.
Completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}`; with `echo`, the prompt's tokens come first, the first of them with `null`
logprob and alternatives (nothing precedes it), as OpenAI's legacy API and vLLM answer.
A token's string is its own decoding; a logprob of -inf (a token that top-k or top-p
excluded) is written as -9999.0, as vLLM writes it, since JSON has no infinity.
"""

from __future__ import annotations

import math

from pdserve.engine.outputs import TokenLogprob

_FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def _token(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _token(tokenizer, token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


def completion_logprobs(tokenizer, logprobs: list[TokenLogprob], text_offset: int) -> tuple[dict, int]:
    """The completions shape for `logprobs`, whose first token starts at `text_offset` of
    the completion's text; returns it and the offset after the last token."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(text_offset)
        tokens.append(_token(tokenizer, lp.token_id))
        text_offset += len(tokens[-1])
    top = [{_token(tokenizer, t): _finite(v) for t, v in lp.top} for lp in logprobs]
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs], "top_logprobs": top,
            "text_offset": offsets}, text_offset


def echo_logprobs(tokenizer, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob]) -> tuple[dict, int]:
    """The completions shape for an echoed prompt (`prompt_logprobs`: one per prompt token
    after the first); returns it and the offset after the prompt's last token, where the
    completion's tokens start."""
    first = _token(tokenizer, prompt_ids[0])
    rest, offset = completion_logprobs(tokenizer, prompt_logprobs, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}, offset


def joined(first: dict, second: dict) -> dict:
    """Two consecutive runs of completions-shaped logprobs as one."""
    return {key: first[key] + second[key] for key in first}
