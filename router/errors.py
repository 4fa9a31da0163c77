"""OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "invalid_request_error", 422: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error for the client: HTTP status, a message naming what was wrong, the field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def check_model(name: str | None, served: str) -> None:
    """APIError 404 naming the served model unless `name` is it (None: not given, accepted)."""
    if name is not None and name != served:
        raise APIError(404, f"model {name!r} does not exist; this server serves {served!r} (GET /v1/models)",
                       "model", "model_not_found")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """One line naming each bad field, and the first field's name."""
    parts, first = [], None
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        first = first or loc or None
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts[:5]), first


def install_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return JSONResponse(error_body(422, message, param), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        import logging

        logging.getLogger("router").exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)
