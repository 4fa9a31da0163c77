"""The OpenAI-compatible HTTP front end (FastAPI under uvicorn).

Validation happens here, at the edge, before anything is routed: a body that is not JSON
(400), wrong types (422), out-of-range or unsupported values (400), a prompt longer than
the model allows (400), an unknown model (404), a body over `max_body_bytes` (413), more
than `max_inflight_requests` open (429, Retry-After), no workers (503). Every error is an
OpenAI error object naming the field; none of them changes any state.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pdserve.engine import stats
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import apply_chat_template, encode_prompt
from pdserve.router import protocol, responses
from pdserve.router.admin import install_admin
from pdserve.router.auth import APIKeyMiddleware
from pdserve.router.cache_index import PromptKeys
from pdserve.router.dashboard import install_dashboard
from pdserve.router.errors import APIError, check_model, install_handlers, validation_message
from pdserve.router.generation import Generation
from pdserve.router.metrics import RouterMetrics
from pdserve.router.policies import DEFAULT_POLICY, CacheAwareWeights, RouteRequest, decode_busy, make_policy
from pdserve.router.registry import WorkerRegistry
from pdserve.router.tokenize import install_tokenize
from pdserve.rpc import tracing
from pdserve.rpc.security import Security

logger = logging.getLogger("router")
_CHOICE_SEEDS = random.SystemRandom()  # base seeds of n > 1 requests that brought none


@dataclass(frozen=True)
class RouterConfig:
    model: str  # what the tokenizer is loaded from (name or path, as for the engine)
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    routing: str = DEFAULT_POLICY
    cache_aware: CacheAwareWeights = CacheAwareWeights()
    max_inflight_requests: int = 256
    max_body_bytes: int = 4 * 1024 * 1024
    admin_token: str | None = None
    kv_transport: str = "torch"
    request_timeout_s: float = 600.0
    max_migrations: int = 2  # times one request's failed decode leg is resumed on another worker
    migration_wait_s: float = 30.0  # how long a failed leg waits for another decode worker to be routable
    security: Security | None = None  # cluster token (and TLS) for the router's RPCs to workers
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: /v1 is open
    metrics_require_key: bool = False  # /metrics needs an API key too
    https_cert_file: str | None = None
    https_key_file: str | None = None
    ttft_slo_s: float | None = None  # the SLOs, for /metrics' goodput and SLO lines (None: not exported)
    tpot_slo_s: float | None = None
    otlp_traces_endpoint: str | None = None  # export OpenTelemetry traces here (rpc.tracing); None: off

    def __post_init__(self) -> None:
        if self.security is None:
            raise ValueError("the router needs the cluster token (security) to call its workers")
        if self.max_migrations < 0 or self.migration_wait_s < 0:
            raise ValueError("max_migrations and migration_wait_s must be >= 0")
        if bool(self.https_cert_file) != bool(self.https_key_file):
            raise ValueError("HTTPS needs both a certificate file and a key file")


class Router:
    """Shared state of one router process: config, tokenizer, registry, policy, metrics."""

    def __init__(self, config: RouterConfig, registry: WorkerRegistry, controller=None) -> None:
        self.config, self.registry, self.controller = config, registry, controller
        self.policy = make_policy(config.routing, config.cache_aware)
        self.metrics = RouterMetrics(registry, config.ttft_slo_s, config.tpot_slo_s)
        self.tokenizer = None
        self.created = int(time.time())  # GET /v1/models
        self.inflight = 0
        # (end, prompt, completion tokens, ttft, tpot, cached, arrival); end and arrival: time.monotonic()
        self.finished: deque = deque(maxlen=20000)

    def observations(self, window_s: float, percentile: float = 90.0) -> dict:
        """What the autoscaler needs from the last `window_s` seconds of finished requests: count,
        rate, TTFT/TPOT percentiles, prefix-cache hit rate, and the latest 500 requests' lengths
        (prompt, completion, cached tokens) with their arrival times (monotonic seconds)."""
        now = time.monotonic()
        recent = [r for r in self.finished if now - r[0] <= window_s]
        ttft = [r[3] for r in recent if r[3] is not None]
        tpot = [r[4] for r in recent if r[4] is not None]
        prompt_tokens = sum(r[1] for r in recent)
        latest = recent[-500:]
        return {"count": len(recent), "rate": len(recent) / window_s, "ttft_p": stats.percentile(ttft, percentile),
                "tpot_p": stats.percentile(tpot, percentile),
                "hit_rate": sum(r[5] for r in recent) / prompt_tokens if prompt_tokens else 0.0,
                "lengths": [(r[1], max(1, r[2]), r[5]) for r in latest], "arrivals": [r[6] for r in latest],
                "inflight": self.inflight}

    async def start(self) -> None:
        from pdserve.engine.model_source import resolve_model
        from pdserve.engine.tokenizer import load_tokenizer

        model_dir = await asyncio.to_thread(resolve_model, self.config.model, True)
        self.tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        await self.registry.start()

    def routing_summary(self) -> dict:
        """The policy and its cache index at a glance (`pdserve status`): per worker, the
        blocks the index holds for it (reported, expected); the requests the router counts
        on each decode worker; overall, the cached prompt tokens the index predicted vs
        those the workers found."""
        index = self.registry.cache_index
        workers = {w: dict(zip(("held", "expected"), index.size(w), strict=True)) for w in index.worker_ids()}
        load = {v.worker_id: decode_busy(v) for v in self.registry.workers("decode", routable=False)}
        return {"policy": self.policy.name, "index": workers, "decode_load": load,
                "expected_cached_tokens": self.metrics.cached_tokens["expected"],
                "actual_cached_tokens": self.metrics.cached_tokens["actual"]}

    def route_request(self, prompt: PromptKeys, session: str | None) -> RouteRequest:
        """What the policy knows of a request: its length, session, and the leading prompt
        tokens each routable worker is expected to have cached."""
        index = self.registry.cache_index
        matched = {v.worker_id: index.matched_tokens(v.worker_id, prompt)
                   for role in ("decode", "prefill") for v in self.registry.workers(role)}
        return RouteRequest(len(prompt.token_ids), session, matched)

    def pick_decode(self, route: RouteRequest, exclude: set[str] = frozenset()):
        workers = [w for w in self.registry.workers("decode") if w.worker_id not in exclude]
        if not workers:
            raise APIError(503, "no decode worker is available; retry later", headers={"Retry-After": "1"})
        return self.policy.pick_decode(workers, route)

    def order_prefill(self, route: RouteRequest, decode):
        return self.policy.order_prefill(self.registry.workers("prefill"), route, decode)


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.registry.stop()

    app = FastAPI(title="pdserve", version="0.1.0", lifespan=lifespan)
    app.state.router = router
    config = router.config
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=config.api_keys, protect_metrics=config.metrics_require_key)
    install_handlers(app)
    install_admin(app, router)
    install_dashboard(app, router)
    install_tokenize(app, router, lambda request, model: _read_body(request, model, config.max_body_bytes))

    @app.get("/health")
    async def health():
        ready = bool(router.registry.workers("decode")) and router.registry.model.ready.is_set()
        body = {"status": "ok" if ready else "starting", "decode_workers": len(router.registry.workers("decode")),
                "prefill_workers": len(router.registry.workers("prefill"))}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model",
                                            "created": router.created, "owned_by": "pdserve",
                                            "max_model_len": router.registry.model.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        body, content_type = router.metrics.render()
        return Response(body, media_type=content_type)

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

    return app


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


def _sampling(body, router: Router, num_prompt_tokens: int) -> SamplingParams:
    unsupported = body.unsupported()
    if unsupported:
        raise APIError(400, unsupported, unsupported.split(":")[0])
    if getattr(body, "suffix", None):
        raise APIError(400, "suffix: not supported", "suffix")
    max_len = router.registry.model.max_model_len
    if max_len and num_prompt_tokens >= max_len:
        raise APIError(400, f"prompt has {num_prompt_tokens} tokens but the model's maximum context length "
                            f"is {max_len}; shorten the prompt", "prompt", "context_length_exceeded")
    max_tokens = body.requested_max_tokens
    if max_len:
        max_tokens = min(max_tokens, max_len - num_prompt_tokens)
    try:
        bias = body.logit_bias_ids(router.registry.model.vocab_size or None)
    except ValueError as exc:
        raise APIError(400, str(exc), "logit_bias") from None
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    try:
        json_schema = body.json_schema()
    except ValueError as exc:
        raise APIError(400, str(exc), "response_format") from None
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=max(0, body.top_k), seed=body.seed, stop=tuple(body.stop_list()),
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                              logprobs=body.num_logprobs(), presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                              min_tokens=body.min_tokens, logit_bias=bias, json_schema=json_schema,
                              prompt_logprobs=body.num_logprobs() if getattr(body, "echo", False) else None)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ")[0]) from None


async def _serve(request: Request, router: Router, body, ids: list[int], chat: bool):
    check_model(body.model, router.config.served_model_name)
    if not router.registry.model.ready.is_set():
        raise APIError(503, "no decode worker is ready yet; retry shortly", headers={"Retry-After": "1"})
    params = _sampling(body, router, len(ids))
    if router.inflight >= router.config.max_inflight_requests:
        router.metrics.rejected.inc()
        raise APIError(429, f"server busy: {router.inflight} requests in flight (limit "
                            f"{router.config.max_inflight_requests}); retry later", headers={"Retry-After": "1"})
    prompt = PromptKeys(ids)
    route = router.route_request(prompt, body.user)
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    tracing.annotate(request_id=rid)  # on the request's HTTP span
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
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    responses.begin(router)
    try:
        collected = await responses.collect(request, generations)
    finally:
        responses.end(router, generations)
    return JSONResponse(responses.json_body(router, rid, body.model, chat, generations, collected,
                                            body.return_token_ids, _echo_text(router, body, ids)))


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
