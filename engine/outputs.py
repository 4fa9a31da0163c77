"""What the engine hands back per request, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability, and the `top` most likely tokens `(id, logprob)`
    in descending order, all in the distribution the token was drawn from: the model's
    log-softmax for greedy requests; after temperature, top-k and top-p otherwise (a token
    those filters exclude has logprob -inf)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked


@dataclass
class RequestOutput:
    """A request's state after a step. `new_token_ids`/`new_text` are the step's delta."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache, not computed
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # of new_token_ids, when asked
    # when the request asked for prompt_logprobs: None for the first prompt token (nothing
    # precedes it), then each prompt token's (the model's log-softmax given the tokens before)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.outputs[0].finish_reason is not None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
