"""Run the router under uvicorn, bare (`python -m router`) or inside a Ray actor."""

from __future__ import annotations

import argparse
import asyncio
import os

import uvicorn

from engine.logs import setup_logging
from router.app import Router, RouterConfig, build_app
from router.policies import POLICIES
from router.registry import MembershipSource, WorkerRegistry, static_source


def make_server(config: RouterConfig, source: MembershipSource, controller=None) -> uvicorn.Server:
    app = build_app(Router(config, WorkerRegistry(source), controller))
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                               timeout_graceful_shutdown=5, access_log=False)
    return uvicorn.Server(uv_config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router", description="pdserve router over bare workers")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model (for the tokenizer)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument("--routing", default="least-loaded", choices=sorted(POLICIES),
                        help="how to pick workers (default: least-loaded)")
    parser.add_argument("--prefill", action="append", default=[], help="prefill worker host:port (repeatable)")
    parser.add_argument("--decode", action="append", default=[], help="decode worker host:port (repeatable)")
    parser.add_argument("--max-inflight-requests", type=int, default=256,
                        help="past this many open requests new ones get 429 with Retry-After (default: 256)")
    parser.add_argument("--kv-transport", default="torch", choices=["torch", "grpc"],
                        help="how prefill workers ship KV to decode workers (default: torch)")
    args = parser.parse_args(argv)
    if not args.decode:
        parser.error("at least one --decode worker is required")
    setup_logging("router")
    config = RouterConfig(model=args.model, served_model_name=args.served_model_name or args.model,
                          host=args.host, port=args.port, routing=args.routing,
                          max_inflight_requests=args.max_inflight_requests, kv_transport=args.kv_transport,
                          admin_token=os.environ.get("PDSERVE_ADMIN_TOKEN"))
    server = make_server(config, static_source(args.prefill, args.decode))
    asyncio.run(server.serve())
    return 0
