"""Run the router under uvicorn, bare (`python -m router`) or inside a Ray actor."""

from __future__ import annotations

import argparse
import asyncio
import os

import uvicorn

from pdserve.engine.logs import setup_logging
from pdserve.router.app import Router, RouterConfig, build_app
from pdserve.router.auth import API_KEY_ENV, api_keys_from
from pdserve.router.policies import DEFAULT_POLICY, POLICIES, CacheAwareWeights
from pdserve.router.registry import MembershipSource, WorkerRegistry, static_source
from pdserve.rpc import tracing
from pdserve.rpc.security import add_security_args, security_from_args


def make_server(config: RouterConfig, source: MembershipSource, controller=None) -> uvicorn.Server:
    """A uvicorn server for the router; `.router` is the Router (for its actor's queries)."""
    router = Router(config, WorkerRegistry(source, config.security), controller)
    app = build_app(router)
    if tracing.configure("router", config.otlp_traces_endpoint, f"{config.host}:{config.port}"):
        tracing.instrument_app(app)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                               timeout_graceful_shutdown=5, access_log=False,
                               ssl_certfile=config.https_cert_file, ssl_keyfile=config.https_key_file)
    server = uvicorn.Server(uv_config)
    server.router = router
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description="pdserve router over bare workers")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model (for the tokenizer)")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    parser.add_argument("--routing", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                        help=f"how to pick workers (default: {DEFAULT_POLICY}: where the prompt's KV is "
                             "cached, traded against load)")
    parser.add_argument("--cache-aware-request-tokens", type=int, default=CacheAwareWeights.request_tokens,
                        help="cache-aware: prompt tokens one open request on a decode worker is worth "
                             f"(default: {CacheAwareWeights.request_tokens})")
    parser.add_argument("--cache-aware-kv-tokens", type=int, default=CacheAwareWeights.kv_tokens,
                        help="cache-aware: prompt tokens a full KV cache is worth "
                             f"(default: {CacheAwareWeights.kv_tokens})")
    parser.add_argument("--prefill", action="append", default=[], help="prefill worker host:port (repeatable)")
    parser.add_argument("--decode", action="append", default=[], help="decode worker host:port (repeatable)")
    parser.add_argument("--max-inflight-requests", type=int, default=256,
                        help="past this many open requests new ones get 429 with Retry-After (default: 256)")
    parser.add_argument("--kv-transport", default="torch", choices=["torch", "grpc"],
                        help="how prefill workers ship KV to decode workers (default: torch)")
    parser.add_argument("--max-migrations", type=int, default=2,
                        help="times a request whose decode worker fails mid-stream is resumed on another, "
                             "token-exact (default: 2; 0: the client gets the error)")
    parser.add_argument("--migration-wait-s", type=float, default=30.0,
                        help="how long a request whose decode worker failed waits for another to become "
                             "routable (a replacement starting) before the client gets the error (default: 30)")
    parser.add_argument("--api-key", action="append", default=None,
                        help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize "
                             f"(repeatable; default: ${API_KEY_ENV})")
    parser.add_argument("--https-cert", default=None, help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--https-key", default=None, help="the HTTPS certificate's private key (PEM)")
    parser.add_argument("--ttft-slo-s", type=float, default=None,
                        help="TTFT SLO in seconds: exports pdserve_slo_ttft_seconds and goodput (with --tpot-slo-s)")
    parser.add_argument("--tpot-slo-s", type=float, default=None, help="TPOT SLO in seconds (see --ttft-slo-s)")
    add_security_args(parser)
    tracing.add_tracing_args(parser)
    args = parser.parse_args(argv)
    if not args.decode:
        parser.error("at least one --decode worker is required")
    try:
        security = security_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging("router")
    config = RouterConfig(model=args.model, served_model_name=args.served_model_name or args.model,
                          host=args.host, port=args.port, routing=args.routing,
                          cache_aware=CacheAwareWeights(args.cache_aware_request_tokens, args.cache_aware_kv_tokens),
                          max_inflight_requests=args.max_inflight_requests, kv_transport=args.kv_transport,
                          max_migrations=args.max_migrations, migration_wait_s=args.migration_wait_s,
                          admin_token=os.environ.get("PDSERVE_ADMIN_TOKEN"), security=security,
                          api_keys=api_keys_from(args.api_key), https_cert_file=args.https_cert,
                          https_key_file=args.https_key, ttft_slo_s=args.ttft_slo_s, tpot_slo_s=args.tpot_slo_s,
                          otlp_traces_endpoint=args.otlp_traces_endpoint)
    server = make_server(config, static_source(args.prefill, args.decode, security))
    asyncio.run(server.serve())
    return 0
