"""The OpenAI-compatible HTTP front end (FastAPI under uvicorn).

Validation happens here, at the edge, before anything is routed: a body that is not JSON
(400), wrong types (422), out-of-range or unsupported values (400), a prompt longer than
the model allows (400), an unknown model (404), a body over `max_body_bytes` (413), more
than `max_inflight_requests` open (429, Retry-After), no workers (503). Every error is an
OpenAI error object naming the field; none of them changes any state.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import apply_chat_template, encode_prompt
from pdserve.router import protocol, responses
from pdserve.router.admin import install_admin
from pdserve.router.auth import APIKeyMiddleware
from pdserve.router.cache_index import PromptKeys
from pdserve.router.dashboard import install_dashboard
from pdserve.router.errors import APIError, check_model, install_handlers, validation_message
from pdserve.router.generation import Generation
from pdserve.router.sampling import request_sampling
from pdserve.router.state import Router
from pdserve.router.tokenize import install_tokenize
from pdserve.rpc import tracing

logger = logging.getLogger("router")
_CHOICE_SEEDS = random.SystemRandom()  # base seeds of n > 1 requests that brought none


def build_app(router: Router) -> FastAPI:
    """The router's app. `app.state.replicas` is None in a bare router; among router replicas
    the RouterActor sets it to an async callable, `(window_s=0.0) -> list[router.metrics.Replica]`
    (every replica, this one included, with its requests finished in the last `window_s`),
    through which /metrics and /dashboard show every replica."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.registry.stop()

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    app.state.router = router
    app.state.replicas = None
    config = router.config
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, protect_metrics=config.metrics_require_key)
    install_handlers(app)
    install_admin(app, router)
    install_dashboard(app, router)
    install_tokenize(app, router, lambda request, model: _read_body(request, model, config.max_body_bytes))
    _install_status(app, router)
    _install_completions(app, router)
    return app


def _install_status(app: FastAPI, router: Router) -> None:
    """`GET /health` (200 once a decode worker is routable and the model known, else 503),
    `GET /v1/models` and `GET /metrics`."""

    @app.get("/health")
    async def health():
        ready = bool(router.registry.workers("decode")) and router.registry.model.ready.is_set()
        body = {"status": "ok" if ready else "starting", "decode_workers": len(router.registry.workers("decode")),
                "prefill_workers": len(router.registry.workers("prefill"))}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": router.config.served_model_name, "object": "model",
                                            "created": router.created, "owned_by": "pdserve",
                                            "max_model_len": router.registry.model.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        replicas = app.state.replicas
        body, content_type = router.metrics.render(await replicas() if replicas else None)
        return Response(body, media_type=content_type)


def _install_completions(app: FastAPI, router: Router) -> None:
    """`POST /v1/completions` and `POST /v1/chat/completions`."""
    config = router.config

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _read_body(request, protocol.CompletionRequest, config.max_body_bytes)
        ids = _completion_prompt(router, body.prompt)
        return await _serve(request, router, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_body(request, protocol.ChatCompletionRequest, config.max_body_bytes)
        if router.tokenizer is None or not getattr(router.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        try:
            messages = protocol.template_messages(body.messages)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        ids = apply_chat_template(router.tokenizer, messages)
        return await _serve(request, router, body, ids, chat=True)


async def _read_body(request: Request, model, max_bytes: int):
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(422, message, param) from None


def _completion_prompt(router: Router, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, "prompt: batches are not supported; send one prompt per request", "prompt")
        prompt = prompt[0]
    try:
        return encode_prompt(router.tokenizer, prompt, router.registry.model.vocab_size or None)
    except ValueError as exc:
        raise APIError(400, str(exc), "prompt") from None


async def _serve(request: Request, router: Router, body, ids: list[int], chat: bool):
    check_model(body.model, router.config.served_model_name)
    if not router.registry.model.ready.is_set():
        raise APIError(503, "no decode worker is ready yet; retry shortly", headers={"Retry-After": "1"})
    params = request_sampling(body, router.registry.model, len(ids))
    if router.inflight >= router.config.max_inflight_requests:
        router.metrics.rejected.inc()
        raise APIError(429, f"server busy: {router.inflight} requests in flight (limit "
                            f"{router.config.max_inflight_requests}); retry later", headers={"Retry-After": "1"})
    prompt = PromptKeys(ids)
    route = router.route_request(prompt, body.user)
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    tracing.annotate(request_id=rid)  # on the request's HTTP span
    replica = {} if router.config.replica is None else {"x-pdserve-replica": str(router.config.replica)}
    generations = []
    # 503 now, before a stream starts, if there is no decode worker; every choice goes to the
    # same one, where they share the prompt's KV through its prefix cache (responses.merged_deltas)
    decode = router.pick_decode(route)
    for index, choice_params in enumerate(_choice_params(params, body.n)):
        worker_rid = rid if index == 0 else f"{rid}-{index}"
        decode.note_routed(worker_rid)
        generations.append(Generation(router, worker_rid, prompt, choice_params, route, decode))
    if body.stream:
        options = body.stream_options or protocol.StreamOptions()
        stream = responses.sse(router, rid, generations, body.model, chat, options, body.return_token_ids,
                               _echo_text(router, body, ids))
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **replica})
    responses.begin(router)
    try:
        collected = await responses.collect(request, generations)
    finally:
        responses.end(router, generations)
    return JSONResponse(responses.json_body(router, rid, body.model, chat, generations, collected,
                                            body.return_token_ids, _echo_text(router, body, ids)), headers=replica)


def _echo_text(router: Router, body, ids: list[int]) -> str | None:
    """The prompt as completions' `echo` answers it (as sent when it was text), or None."""
    if not getattr(body, "echo", False):
        return None
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str) \
        else body.prompt
    if isinstance(prompt, str):
        return prompt
    return router.tokenizer.decode(ids) if router.tokenizer is not None else ""


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each of `n` choices' params: seeds seed, seed+1, ... (a drawn seed when the request
    brought none; one choice keeps the request's, resolved by its Generation)."""
    if n == 1:
        return [params]
    base = params.seed if params.seed is not None else _CHOICE_SEEDS.getrandbits(63)
    return [dataclasses.replace(params, seed=(base + i) % (1 << 63)) for i in range(n)]
