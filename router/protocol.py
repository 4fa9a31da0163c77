"""OpenAI-compatible request bodies (validated with pydantic at the edge) and response shapes."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from pdserve.engine.guided import ANY_OBJECT, schema_error
from pdserve.engine.sampling_params import MAX_LOGPROBS

NonNegInt = Annotated[StrictInt, Field(ge=0)]
MAX_CHOICES = 16  # most choices (`n`) in one request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    # vLLM's extension, sent by benchmark clients (guidellm): with include_usage, every chunk
    # carries the usage so far, not only the final one
    continuous_usage_stats: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are rejected, except a few that OpenAI
    clients send with neutral values (checked in `unsupported`). A field named as a
    SamplingParams field sets it as it is (router/sampling.py maps the others)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="served model name (GET /v1/models)")
    max_tokens: StrictInt | None = Field(default=None, ge=1, description="tokens to generate (default 16)")
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=-1, description="-1 or 0 disables")
    seed: NonNegInt | None = None
    stop: str | list[str] | None = Field(default=None, description="up to 4 stop strings")
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES, description="choices, with seeds seed, seed+1, ...")
    user: str | None = None
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0, le=100.0, description="vLLM's; 1 disables")
    min_tokens: NonNegInt = Field(default=0, description="vLLM's: no EOS or stop token before this many")
    logit_bias: dict[str, StrictFloat] | None = Field(default=None, description="token id (a string) -> bias")
    return_token_ids: StrictBool = Field(False, description="pdserve extension: add the generated token ids")
    response_format: dict | None = Field(default=None, description=(
        "{'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', 'json_schema': {'name', 'schema'}}"))

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return stops

    def unsupported(self) -> str | None:
        """A message naming a field whose value pdserve does not implement, or None."""
        if len(self.stop_list()) > 4 or any(not s for s in self.stop_list()):
            return "stop: at most 4 non-empty strings"
        return None

    def json_schema(self) -> str | None:
        """The JSON schema (JSON text) that `response_format` asks the output to follow, or
        None for free text; ValueError naming what is wrong with the field."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return ANY_OBJECT
        if fmt.get("type") != "json_schema":
            raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                             f"got {fmt.get('type')!r}")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema: needs an object with a 'schema' object "
                             "(and a 'name'), as OpenAI's structured outputs take it")
        schema = json.dumps(spec["schema"])
        error = schema_error(schema)
        if error:
            raise ValueError(f"response_format.json_schema.schema: {error}")
        return schema

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens or self.max_completion_tokens or 16

    def num_logprobs(self) -> int | None:
        """How many alternatives to return with each token's logprob; None: no logprobs."""
        return None

    def logit_bias_ids(self, vocab_size: int | None) -> dict[int, float]:
        """`logit_bias` keyed by token id; ValueError naming a key that is not one."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or (vocab_size and int(key) >= vocab_size):
                raise ValueError(f"logit_bias: keys must be token ids in [0, {vocab_size}), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias: values must be in [-100, 100], got {value} for {key}")
            bias[int(key)] = value
        return bias


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(
        description="text, token ids, or a list holding exactly one of those")
    echo: StrictBool = False
    suffix: str | None = None
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                       description="each token's logprob and this many alternatives")

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    """One part of a message's `content` list. Only text parts are served; any other type
    (image_url, input_audio, file) is refused by `ChatMessage.text` with a 400."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self, where: str) -> str:
        """The message's text: a string as is, a list's text parts joined by newlines (as vLLM
        joins them); ValueError naming the part (`where` is e.g. "messages[1]") otherwise."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise ValueError(f"{where}.content[{j}]: only text parts are supported, got type {part.type!r}")
            if part.text is None:
                raise ValueError(f"{where}.content[{j}]: a text part needs a 'text' string")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None

    def unsupported(self) -> str | None:
        if self.tools or self.tool_choice not in (None, "none"):
            return "tools: tool calling is not supported yet; send the request without tools/tool_choice"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs: needs logprobs: true"
        return super().unsupported()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens reused from a prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, kind: str, usage_object: dict) -> dict:
    """The stream's last chunk before `[DONE]` under `stream_options.include_usage`."""
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage_object}


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """A conversation as the chat template takes it (string contents); ValueError names a
    message part pdserve cannot serve."""
    out = []
    for i, message in enumerate(messages):
        entry = {"role": message.role, "content": message.text(f"messages[{i}]")}
        if message.name is not None:
            entry["name"] = message.name
        out.append(entry)
    return out
