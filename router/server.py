"""Run the router under uvicorn, bare (`python -m pdserve.router`) or inside a Ray actor."""

from __future__ import annotations

import argparse
import asyncio
import socket

import uvicorn

from pdserve.engine.arg_utils import add_config_args, config_from_args
from pdserve.engine.logs import setup_logging
from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig
from pdserve.router.registry import MembershipSource, WorkerRegistry, static_source
from pdserve.router.state import Router
from pdserve.rpc import tracing
from pdserve.rpc.security import add_security_args, security_from_args


def shared_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on host:port that other processes can bind too: SO_REUSEPORT,
    with which Linux spreads new connections over every socket bound so (by a hash of each
    connection's addresses). Every one of them must set it, as the router replicas do; a
    process that binds the port without it is refused, as it would be anyway. OSError when the
    port is taken otherwise; RuntimeError where the platform has no SO_REUSEPORT."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise RuntimeError("router replicas need SO_REUSEPORT, which this platform lacks; set router.replicas: 1")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def ensure_port_free(host: str, port: int) -> None:
    """RuntimeError unless host:port can be bound now (a plain bind, which any socket on the
    port refuses, shared or not): how a service whose replicas share their port still fails
    its start on a port something else holds."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise RuntimeError(f"the router's port {host}:{port} is in use ({exc.strerror}): stop what holds it "
                               f"or set router.port") from None


class RouterServer(uvicorn.Server):
    """uvicorn's server for one router process. A replica of a service (`config.replica` set
    by the controller, which can add replicas at any time) or a bare router told of others
    (`replicas` > 1) binds its host:port itself, shared (`shared_socket`); a lone bare router
    binds as uvicorn does (a port in use fails the start). HTTPS is the same either way
    (uvicorn wraps the connections of the sockets it is given)."""

    router: Router

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.router.config
        if sockets is None and (config.replicas > 1 or config.replica is not None):
            sockets = [shared_socket(config.host, config.port, self.config.backlog)]
        await super().serve(sockets=sockets)


def make_server(config: RouterConfig, source: MembershipSource, controller=None) -> RouterServer:
    """A uvicorn server for the router; `.router` is the Router (for its actor's queries)."""
    router = Router(config, WorkerRegistry(source, config.security), controller)
    app = build_app(router)
    if tracing.configure("router", config.otlp_traces_endpoint, f"{config.host}:{config.port}"):
        tracing.instrument_app(app)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                               timeout_graceful_shutdown=5, access_log=False,
                               ssl_certfile=config.https_cert_file, ssl_keyfile=config.https_key_file)
    server = RouterServer(uv_config)
    server.router = router
    return server


_FROM_RPC = ("security", "otlp_traces_endpoint")  # their flags are the rpc layer's (security, tracing)
_BARE_EXCLUDED = (*_FROM_RPC, "resources")  # resources: where Ray places replicas, nothing to a bare router
_BARE_HELPS = {"host": "address to listen on",
               "replicas": "router replicas sharing --host/--port: a bare router starts no others, but with N > 1 "
                           "it binds its port with SO_REUSEPORT, so N bare routers started alike serve it together"}


def build_parser() -> argparse.ArgumentParser:
    """The flags of `python -m pdserve.router`: RouterConfig's fields (engine.arg_utils), the
    workers to route to, the cluster token and TLS files, the trace collector."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.router", description="pdserve router over bare workers")
    add_config_args(parser, RouterConfig, exclude=_BARE_EXCLUDED, helps=_BARE_HELPS)
    parser.add_argument("--prefill", action="append", default=[], help="prefill worker host:port (repeatable)")
    parser.add_argument("--decode", action="append", default=[], help="decode worker host:port (repeatable)")
    add_security_args(parser)
    tracing.add_tracing_args(parser)
    return parser


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's config from `build_parser()`'s flags and the environment's fallbacks
    (RouterConfig.with_environment); ValueError naming the flag of a bad value, or saying
    that no cluster token is set."""
    return config_from_args(RouterConfig, args, exclude=_BARE_EXCLUDED, security=security_from_args(args),
                            otlp_traces_endpoint=args.otlp_traces_endpoint).with_environment()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.decode:
        parser.error("at least one --decode worker is required")
    try:
        config = router_config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging("router")
    server = make_server(config, static_source(args.prefill, args.decode, config.security))
    asyncio.run(server.serve())
    return 0
