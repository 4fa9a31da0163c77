"""Operator endpoints: `GET /admin/status`, `POST /admin/scale`, `POST /admin/drain`. They need
`Authorization: Bearer <token>` with the token from the config or `PDSERVE_ADMIN_TOKEN`;
without a configured token they are disabled."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from pdserve.router.auth import bearer_matches, request_authorization
from pdserve.router.errors import APIError, validation_message

if TYPE_CHECKING:
    from pdserve.router.state import Router


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: StrictInt | None = Field(default=None, ge=0, le=1024)
    decode: StrictInt | None = Field(default=None, ge=1, le=1024)


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker_id: StrictStr = Field(min_length=1, max_length=256)


async def _parse(request: Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise APIError(422, message, param) from None


def install_admin(app: FastAPI, router: Router) -> None:
    def authorize(request: Request) -> None:
        """Before anything of the request is read: its body is parsed only once this passed."""
        token = router.config.admin_token
        if not token:
            raise APIError(403, "admin endpoints are disabled: set admin_token in the config or PDSERVE_ADMIN_TOKEN")
        if not bearer_matches(request_authorization(request), (token,)):
            raise APIError(401, "missing or wrong bearer token for /admin")
        if router.controller is None:
            raise APIError(503, "this router runs without a cluster controller")

    @app.get("/admin/status")
    async def admin_status(request: Request):
        authorize(request)
        return await router.controller.status.remote()

    @app.post("/admin/scale")
    async def admin_scale(request: Request):
        authorize(request)
        body = await _parse(request, ScaleRequest)
        return await router.controller.scale.remote(prefill=body.prefill, decode=body.decode)

    @app.post("/admin/drain")
    async def admin_drain(request: Request):
        """Drain one worker; the controller starts a replacement (the pool keeps its target)."""
        authorize(request)
        body = await _parse(request, DrainRequest)
        drained = await router.controller.drain.remote(body.worker_id)
        if drained is None:
            raise APIError(404, f"no ready worker {body.worker_id!r}", "worker_id")
        return drained
