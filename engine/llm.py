"""The offline API, shaped like vLLM's `LLM`."""

from __future__ import annotations

import itertools

from tqdm.auto import tqdm

from pdserve.engine.config import DEFAULT_MODEL, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import apply_chat_template

Prompt = str | list[int] | dict


class LLM:
    """Batch generation on one engine.

    >>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]}).

        Outputs come back in the order of `prompts`. All prompts are validated before any
        runs, so a bad one raises ValueError and nothing is left queued.
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.engine.tokenizer, c) for c in conversations]
        return self._run(prompts, _per_prompt(sampling_params, len(prompts)), use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool):
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(request_ids, prompts, params, strict=True):
                self.engine.add_request(request_id, prompt, p)
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]  # a single token-id prompt
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompts must be a non-empty string, token-id list, or list of those")
    return [_unwrap(p) for p in prompts]


def _unwrap(prompt):
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"]
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)
