"""Process bootstrap shared by the prefill and decode workers: flags, logging, the gRPC
server, readiness reporting and clean shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable

from pdserve.engine.arg_utils import add_engine_args, engine_config_from_args
from pdserve.engine.logs import setup_logging
from pdserve.rpc import tracing
from pdserve.rpc.channel import add_port, new_server
from pdserve.worker_base.config import WorkerConfig, add_worker_args, worker_config_from_args

logger = logging.getLogger(__name__)


def run_worker(role: str, argv: list[str] | None, make_service: Callable) -> int:
    """Parse flags, load the engine, serve until signalled. `make_service(engine, config)`
    returns an object with `add_to(server)`, `async start()` and `async stop()`."""
    parser = argparse.ArgumentParser(prog=f"python -m pdserve.{role}_worker",
                                     description=f"pdserve {role} worker (gRPC server)")
    add_worker_args(parser)
    add_engine_args(parser)
    args = parser.parse_args(argv)
    setup_logging(role)
    try:
        engine_config = engine_config_from_args(args)
        config = worker_config_from_args(args)
        from pdserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(engine_config, serving=True)
    except ValueError as exc:
        print(f"{role} worker: error: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve(role, engine, config, make_service))
    return 0


async def start_service(engine, config: WorkerConfig, make_service: Callable):
    """Build the service, serve it over gRPC; returns (service, server, "host:port")."""
    service = make_service(engine, config)
    tracing.configure(service.role, config.otlp_traces_endpoint, config.worker_id)  # before the server's interceptors
    server = new_server(config.security)
    service.add_to(server)
    port = add_port(server, f"{config.host}:{config.port}", config.security)
    if port == 0:
        raise ValueError(f"cannot listen on {config.host}:{config.port}")
    await server.start()
    await service.start()
    address = f"{config.host}:{port}"
    logger.info("serving address=%s worker_id=%s", address, config.worker_id)
    return service, server, address


async def _serve(role: str, engine, config: WorkerConfig, make_service: Callable) -> None:
    service, server, address = await start_service(engine, config, make_service)
    print(f"READY {role} {address} {config.worker_id}", flush=True)
    if config.ready_file:
        tmp = config.ready_file + ".tmp"
        with open(tmp, "w") as handle:
            handle.write(address)
        os.replace(tmp, config.ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down")
    await service.stop_serving(server, grace_s=2)
