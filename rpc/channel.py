"""The gRPC settings both ends of every pdserve RPC share, and the two ways to use them.

Message limits leave room for a KV chunk plus protobuf framing. Keepalive pings a connection
that has been silent for 10 s and gives up after 5 s without an answer, so a peer that is hung
(SIGSTOPped, wedged) or vanished without closing its socket (a powered-off host, a dropped
route) fails its streams within ~15 s instead of hanging them, and the router resumes them
elsewhere; servers accept those pings (by default gRPC servers punish pings more often than
every 5 minutes with GOAWAY).
"""

from __future__ import annotations

import grpc

from pdserve.rpc import tracing
from pdserve.rpc.security import Security, TokenCheck, client_interceptors

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


def open_channel(address: str, security: Security) -> grpc.aio.Channel:
    """An asyncio channel to a pdserve process at host:port; every call carries the cluster
    token, over TLS when `security` has certificates."""
    interceptors = client_interceptors(security.cluster_token)
    if security.tls:
        return grpc.aio.secure_channel(address, security.channel_credentials(), options=CHANNEL_OPTIONS,
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)


def new_server(security: Security) -> grpc.aio.Server:
    """An asyncio server for a pdserve service that refuses calls without the cluster token
    (and traces Generate and Prefill calls when tracing is on)."""
    interceptors = [TokenCheck(security.cluster_token), *tracing.server_interceptors()]
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)


def add_port(server: grpc.aio.Server, address: str, security: Security) -> int:
    """Listen on host:port (TLS when configured); returns the bound port, 0 on failure."""
    if security.tls:
        return server.add_secure_port(address, security.server_credentials())
    return server.add_insecure_port(address)
