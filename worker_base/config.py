"""Settings of a worker process (prefill or decode) beyond its engine, each declared once
with its default, type, bounds and help.

`WorkerSettings` is what a deployment sets for all of its workers (cluster.config.ServeConfig
carries these fields at its top level); `WorkerConfig` is what one worker process runs with:
those settings, where it listens and its credentials. The flags of `python -m
pdserve.{prefill,decode}_worker` are derived from WorkerConfig's fields (engine.arg_utils);
the cluster token, TLS and tracing flags are the rpc layer's."""

from __future__ import annotations

import argparse
import uuid

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.arg_utils import add_config_args, config_from_args
from pdserve.rpc.security import Security, add_security_args, security_from_args
from pdserve.rpc.tracing import add_tracing_args


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kv_transfer_timeout_s: float = Field(60.0, gt=0, description="deadline of one prefill leg including its KV "
                                                                 "transfer")
    kv_send_deadline_s: float = Field(5.0, gt=0, description="prefill worker: when a decode worker takes none of a "
                                      "request's KV pieces for this long (it stopped reading), that request's leg "
                                      "fails and the engine moves on")
    local_prefill_max_tokens: int = Field(256, ge=0, le=1 << 24, description="decode worker: prefill a request "
                                          "here, not on a prefill worker, when the prompt tokens its prefix cache "
                                          "lacks, with those this worker has yet to compute, are at most this many")
    max_queued_requests: int = Field(1024, ge=1, description="past this many requests waiting (decode worker: for "
                                     "KV blocks or a batch slot; prefill worker: open legs), new ones are refused "
                                     "(RESOURCE_EXHAUSTED: the router retries another decode worker, then answers "
                                     "429; a decode worker tries another prefill worker, then prefills itself)")
    prefill_profile: str | None = Field(None, description="decode worker: a `pdserve profile` JSON; with it, "
                                        "longer uncached tails are also prefilled here when the latency model "
                                        "predicts that is faster than the prefill worker's queue plus its prefill "
                                        "plus the KV transfer")


class WorkerConfig(WorkerSettings):
    model_config = ConfigDict(extra="forbid", frozen=True)
    security: Security = Field(description="the cluster token every RPC to and from this worker carries; TLS files")
    host: str = Field("127.0.0.1", description="listen address (of the gRPC server and the KV rendezvous)")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one (the bound address is "
                                                     "reported when ready)")
    ready_file: str | None = Field(None, description="write host:port here once serving")
    otlp_traces_endpoint: str | None = Field(None, description="export OpenTelemetry traces here (rpc.tracing); "
                                                               "None: off")
    worker_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])


_NOT_FLAGS = ("security", "otlp_traces_endpoint", "worker_id")  # the rpc layer's flags; a fresh id


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser.add_argument_group("worker"), WorkerConfig, exclude=_NOT_FLAGS)
    add_security_args(parser)
    add_tracing_args(parser)


def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """ValueError naming the flag of a bad value, or saying that no cluster token is set."""
    return config_from_args(WorkerConfig, args, exclude=_NOT_FLAGS, security=security_from_args(args),
                            otlp_traces_endpoint=args.otlp_traces_endpoint)
