"""A request as the engine tracks it.

Lifecycle in one engine (docs/design.md, "Request lifecycle"):

    WAITING ──schedule──► RUNNING ──stop token / EOS──► FINISHED_STOPPED
       ▲                    │  │ ──max_tokens / max_model_len──► FINISHED_LENGTH
       └──preempt (blocks───┘  └─abort──► FINISHED_ABORTED   (also from WAITING)
          freed, recompute)

There is no separate prefill phase: `num_computed_tokens` catches up with `num_tokens`
(prompt plus outputs so far), a chunk at a time; once it has caught up, each step computes
one token and samples the next.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.guided import Guide


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)  # when sampling_params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (prompt_logprobs)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in a prefix cache instead of computed
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    guide: Guide | None = None  # when the params ask for JSON output (engine.guided)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """The request asked for prompt logprobs and has not had them all yet."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, first_position: int, logprobs: list[TokenLogprob]) -> None:
        """Record prompt tokens' logprobs, the first for the token at `first_position`; those
        already recorded (a chunk recomputed after preemption) are skipped."""
        skip = len(self.prompt_logprobs) + 1 - first_position
        if skip >= 0:
            self.prompt_logprobs.extend(logprobs[skip:])

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs, without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token implies, or None to continue."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if self.guide is not None:
            self.guide.sync(self.history().generated())
            if self.guide.finished:  # the JSON is complete
                return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def history(self) -> TokenHistory:
        return TokenHistory(self.prompt_token_ids, self.output_token_ids, self.sampling_params.first_position,
                            self.eos_token_ids)


@dataclass(frozen=True)
class TokenHistory:
    """What a request has seen: its prompt and outputs (read, not copied, during a step)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_generated_in_prompt: int  # the resumed request's first_position: generated before, now prompt
    eos_token_ids: frozenset[int]

    def generated(self) -> list[int]:
        tail = self.prompt_token_ids[len(self.prompt_token_ids) - self.num_generated_in_prompt:] \
            if self.num_generated_in_prompt else []
        return tail + self.output_token_ids
