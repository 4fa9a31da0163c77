"""Per-request sampling and stopping options, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most alternatives per token, as OpenAI's top_logprobs

# Field metadata declaring how a field travels from the router to a worker (protos/convert.py
# converts every other field by name, with no per-field code):
ROUTER_ONLY = {"wire": False}  # the router applies it itself (stop strings, detokenizing); never sent
ZERO_IS_DEFAULT = {"zero_is_default": True}  # 0 is invalid, so a 0 on the wire (proto3's unset) means the default


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    `temperature == 0` is greedy. `top_k <= 0` and `top_p == 1` disable those filters.
    With a `seed`, the token at output position i is a function of (seed, i, logits) only;
    without one, the engine draws a seed for the request. `first_position` is the output
    position of the first token this request samples: 0, or for a request resumed elsewhere
    (its prompt then ends with the tokens already generated) the number generated before, so
    that it continues with exactly the tokens an unbroken run would have sampled.
    `logprobs=None` returns no log-probabilities; `logprobs=k` (0..MAX_LOGPROBS) returns each
    sampled token's and the k most likely tokens' (`engine.outputs.TokenLogprob`).

    Logit adjustments (`engine.logits`), applied before temperature, top-k and top-p, and
    functions of the request's own tokens only: `presence_penalty` and `frequency_penalty`
    (OpenAI's, in [-2, 2]) subtract `presence * (count > 0) + frequency * count` over the
    tokens generated so far; `repetition_penalty` (> 0; 1 disables; HF's and vLLM's) divides
    positive logits and multiplies negative ones of every token in the prompt or output;
    `logit_bias` adds a bias in [-100, 100] to the listed token ids; `min_tokens` forbids EOS
    and `stop_token_ids` until that many tokens were generated (counted from the request's
    start, as `first_position` is).

    `json_schema` (JSON text; `engine.guided.ANY_OBJECT` for any object) constrains the
    output to compact JSON that validates against it; the request stops when the JSON is
    complete. `prompt_logprobs=k` returns the logprob of every prompt token after the first
    given the tokens before it, with k alternatives: the model's own log-softmax (no
    adjustments, temperature or filters, since nothing was sampled). Such a request computes
    its whole prompt (the prefix cache is not used for it).

    Every field not marked ROUTER_ONLY has a field of the same name in the .proto's
    SamplingOptions (protos/convert.py checks that on import); a request body's field of the
    same name sets it (router/sampling.py), unless the router maps it from OpenAI's fields.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = field(default=1.0, metadata=ZERO_IS_DEFAULT)
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple, metadata=ROUTER_ONLY)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = field(default=True, metadata=ROUTER_ONLY)
    first_position: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = field(default=1.0, metadata=ZERO_IS_DEFAULT)
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # or a dict {token id: bias}
    json_schema: str | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _require_int("max_tokens", self.max_tokens, "an integer >= 1", low=1)
        _require_int("top_k", self.top_k, "an integer (<= 0 disables it)")
        _require_int("first_position", self.first_position, "an integer >= 0", low=0)
        if self.logprobs is not None:
            _require_int("logprobs", self.logprobs, f"an integer in [0, {MAX_LOGPROBS}]", low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _require_int("prompt_logprobs", self.prompt_logprobs, f"an integer in [0, {MAX_LOGPROBS}]", low=0,
                         high=MAX_LOGPROBS)
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError(f"json_schema must be a JSON schema as JSON text, got {type(self.json_schema).__name__}")
        if self.seed is not None:
            _require_int("seed", self.seed, "an integer in [0, 2**63)", low=0, high=2**63 - 1)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for token_id in self.stop_token_ids:
            _require_int("stop_token_ids", token_id, "non-negative integers", low=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise ValueError(f"repetition_penalty must be a number in (0, 100] (1 disables it), "
                             f"got {self.repetition_penalty!r}")
        # counted from the request's start, like first_position (a resumed leg's max_tokens is what remains)
        _require_int("min_tokens", self.min_tokens, f"an integer in [0, max_tokens={self.max_tokens}]",
                     low=0, high=self.first_position + self.max_tokens)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        for token_id, value in pairs:
            _require_int("logit_bias", token_id, "keyed by non-negative token ids", low=0)
            if not _is_number(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {token_id}")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(v)) for t, v in pairs)))

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logit adjustment (penalties, bias, min_tokens) is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _require_int(name: str, value: object, allowed: str, low: int | None = None,
                 high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
