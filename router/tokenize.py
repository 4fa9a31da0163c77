"""`POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.

/tokenize takes a `prompt` (text) or chat `messages` (rendered with the chat template and
its generation prompt, as /v1/chat/completions renders them) and answers `{"count",
"max_model_len", "tokens"}` (and `token_strs` when `return_token_strs` is true).
/detokenize takes `tokens` and answers `{"prompt"}`. Both are under the API keys when the
router has them, like /v1/*.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from pdserve.engine.tokenizer import apply_chat_template, check_token_ids
from pdserve.router.errors import APIError, check_model
from pdserve.router.protocol import ChatMessage, template_messages

if TYPE_CHECKING:
    from pdserve.router.state import Router


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def install_tokenize(app: FastAPI, router: Router,
                     read_body: Callable[[Request, type[BaseModel]], Awaitable[BaseModel]]) -> None:
    """Add the two endpoints; `read_body(request, model)` parses and validates a body."""

    def tokenizer_for(name: str | None) -> object:
        check_model(name, router.config.served_model_name)
        if router.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return router.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request, TokenizeRequest)
        tokenizer = tokenizer_for(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' (text) and 'messages' (a conversation)", "prompt")
        try:
            if body.messages is not None:
                ids = apply_chat_template(tokenizer, template_messages(body.messages), body.add_generation_prompt)
            else:
                ids = list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages" if body.messages is not None else "prompt") from None
        answer = {"count": len(ids), "max_model_len": router.registry.model.max_model_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
        return answer

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request, DetokenizeRequest)
        tokenizer = tokenizer_for(body.model)
        vocab = router.registry.model.vocab_size or None
        try:
            ids = check_token_ids(body.tokens, vocab) if body.tokens else []
        except ValueError as exc:
            raise APIError(400, str(exc).replace("prompt token ids", "tokens"), "tokens") from None
        return {"prompt": tokenizer.decode(ids)}
