"""Settings of a worker process (prefill or decode) beyond its engine."""

from __future__ import annotations

import argparse
import uuid
from dataclasses import dataclass, field

from pdserve.rpc.security import Security, add_security_args, security_from_args
from pdserve.rpc.tracing import add_tracing_args


@dataclass(frozen=True)
class WorkerConfig:
    security: Security  # the cluster token every RPC to and from this worker carries; TLS files
    host: str = "127.0.0.1"  # where the gRPC server and the KV rendezvous listen
    port: int = 0  # 0: any free port (the bound address is reported when ready)
    kv_transfer_timeout_s: float = 60.0  # deadline of one prefill leg, KV included
    kv_send_deadline_s: float = 5.0  # prefill: a peer that takes no KV piece for this long fails the leg
    local_prefill_max_tokens: int = 256  # decode: prefill here when the cache lacks at most this many
    # past this many requests waiting (decode: for blocks or a batch slot) or open (prefill), refuse
    max_queued_requests: int = 1024
    prefill_profile: str | None = None  # decode: `pdserve profile` JSON for the where-to-prefill model
    ready_file: str | None = None  # write "host:port" here once serving
    otlp_traces_endpoint: str | None = None  # export OpenTelemetry traces here (rpc.tracing); None: off
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.local_prefill_max_tokens <= 1 << 24:
            raise ValueError(f"local_prefill_max_tokens must be in [0, 2^24], got {self.local_prefill_max_tokens}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if not self.kv_send_deadline_s > 0:
            raise ValueError(f"kv_send_deadline_s must be > 0, got {self.kv_send_deadline_s}")


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("worker")
    group.add_argument("--host", default="127.0.0.1", help="listen address (default: %(default)s)")
    group.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one")
    group.add_argument("--kv-transfer-timeout-s", type=float, default=60.0,
                       help="deadline of one prefill leg including its KV transfer (default: %(default)s)")
    group.add_argument("--kv-send-deadline-s", type=float, default=5.0,
                       help="prefill worker: when a decode worker takes none of a request's KV pieces for this "
                            "long (it stopped reading), that request's leg fails and the engine moves on "
                            "(default: %(default)s)")
    group.add_argument("--ready-file", default=None, help="write host:port here once serving")
    group.add_argument("--local-prefill-max-tokens", type=int, default=256,
                       help="decode worker: prefill a request here, not on a prefill worker, when its "
                            "prefix cache lacks at most this many prompt tokens (default: %(default)s)")
    group.add_argument("--max-queued-requests", type=int, default=1024,
                       help="past this many requests waiting (decode worker: for KV blocks or a batch "
                            "slot; prefill worker: open legs), new ones are refused (RESOURCE_EXHAUSTED: "
                            "the router retries another decode worker, then answers 429; a decode worker tries "
                            "another prefill worker, then prefills itself) (default: %(default)s)")
    group.add_argument("--prefill-profile", default=None,
                       help="decode worker: a `pdserve profile` JSON; with it, longer uncached tails are "
                            "also prefilled here when the latency model predicts that is faster than the "
                            "prefill worker's queue plus its prefill plus the KV transfer")
    add_security_args(parser)
    add_tracing_args(parser)



def worker_config_from_args(args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(security=security_from_args(args), host=args.host, port=args.port,
                        kv_transfer_timeout_s=args.kv_transfer_timeout_s,
                        kv_send_deadline_s=args.kv_send_deadline_s, ready_file=args.ready_file,
                        local_prefill_max_tokens=args.local_prefill_max_tokens, prefill_profile=args.prefill_profile,
                        max_queued_requests=args.max_queued_requests,
                        otlp_traces_endpoint=args.otlp_traces_endpoint)
