"""API keys on the OpenAI endpoints, as vLLM's `--api-key`: with keys configured, `/v1/*`,
`/tokenize`, `/detokenize` (and `/metrics` and `/dashboard/data` if asked) need `Authorization: Bearer <key>`;
anything else gets 401 with an OpenAI error object before the body is read. `/health` stays
open. Keys are compared in constant time."""

from __future__ import annotations

import hmac
import os

from fastapi import Request
from fastapi.responses import JSONResponse

from pdserve.router.errors import error_body

API_KEY_ENV = "PDSERVE_API_KEY"


def api_keys_from(given: list[str] | None) -> tuple[str, ...]:
    """The configured keys, else `$PDSERVE_API_KEY` (comma-separated), else none (open)."""
    keys = given if given else [k for k in os.environ.get(API_KEY_ENV, "").split(",")]
    return tuple(k.strip() for k in keys if k and k.strip())


def bearer_matches(authorization: str | bytes, secrets: tuple[str, ...]) -> bool:
    """Whether an Authorization header is `Bearer <one of secrets>` (every key compared)."""
    given = authorization.encode() if isinstance(authorization, str) else authorization
    matched = False
    for secret in secrets:
        matched |= hmac.compare_digest(given, f"Bearer {secret}".encode())
    return matched


def request_authorization(request: Request) -> str:
    return request.headers.get("authorization", "")


class APIKeyMiddleware:
    """Plain ASGI (no wrapping of streamed responses): refuses unauthorised requests to
    protected paths before routing, so no body is read and no state changes."""

    def __init__(self, app, keys: tuple[str, ...], protect_metrics: bool) -> None:
        self.app, self.keys, self.protect_metrics = app, keys, protect_metrics

    def _protected(self, path: str) -> bool:
        return (path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
                or (self.protect_metrics and path in ("/metrics", "/dashboard/data")))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self._protected(scope["path"]):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not bearer_matches(given, self.keys):
                body = error_body(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                  code="invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
