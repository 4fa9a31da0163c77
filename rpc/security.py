"""Who may call a pdserve process: the cluster token on every internal RPC, optional TLS.

Every internal RPC (router -> decode, decode -> prefill, the router's Info/Stats polls)
carries the deployment's shared secret in the `x-pdserve-cluster-token` metadata. A server
interceptor compares it in constant time before any handler runs or any request byte is
parsed; a missing or wrong token gets UNAUTHENTICATED and changes nothing. The token comes
from the config or `PDSERVE_CLUSTER_TOKEN`; `pdserve up` generates one when none is given.
It never appears in a repr, a log line or `pdserve status`.

With certificate and key files, servers listen with TLS and clients verify them against
the CA file (default: the certificate itself, for a self-signed deployment certificate).
"""

from __future__ import annotations

import argparse
import hmac
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import grpc

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_METADATA_KEY = "x-pdserve-cluster-token"
MIN_TOKEN_CHARS = 16


def new_token() -> str:
    """A fresh random cluster token (256 bits)."""
    return secrets.token_urlsafe(32)


def resolve_token(given: str | None) -> str:
    """`given`, else `$PDSERVE_CLUSTER_TOKEN`; ValueError saying how to set one if neither."""
    token = given or os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(
            f"no cluster token: pass --cluster-token or set {TOKEN_ENV} to the same secret on every "
            f"worker and the router, e.g. export {TOKEN_ENV}=$(python -c 'import secrets; "
            f"print(secrets.token_urlsafe(32))')"
        )
    return token


@dataclass(frozen=True)
class Security:
    """A process's credentials for internal RPCs: the cluster token, optional TLS files."""

    cluster_token: str = field(repr=False)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None  # verifies peers' certificates; default: tls_cert_file

    def __post_init__(self) -> None:
        if not isinstance(self.cluster_token, str) or len(self.cluster_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the cluster token must be a string of at least {MIN_TOKEN_CHARS} characters")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both a certificate file and a key file")
        for name in ("tls_cert_file", "tls_key_file", "tls_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name} {path} is not a readable file")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(Path(self.tls_key_file).read_bytes(), Path(self.tls_cert_file).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(Path(self.tls_ca_file or self.tls_cert_file).read_bytes())


def add_security_args(parser: argparse.ArgumentParser) -> None:
    """--cluster-token and the TLS files, for every process that speaks internal gRPC."""
    group = parser.add_argument_group("security")
    group.add_argument("--cluster-token", default=None,
                       help=f"shared secret of the deployment's internal RPCs (default: ${TOKEN_ENV}; required)")
    group.add_argument("--tls-cert", default=None, help="serve gRPC over TLS with this certificate (PEM)")
    group.add_argument("--tls-key", default=None, help="the certificate's private key (PEM)")
    group.add_argument("--tls-ca", default=None,
                       help="CA certificate that signed the peers' certificates (default: --tls-cert)")


def security_from_args(args: argparse.Namespace) -> Security:
    return Security(resolve_token(args.cluster_token), args.tls_cert, args.tls_key, args.tls_ca)


class _WithToken:
    def __init__(self, token: str) -> None:
        self._token = token

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
        metadata.add(TOKEN_METADATA_KEY, self._token)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _UnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _StreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


class _StreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._with_token(details), request_iterator)


def client_interceptors(token: str) -> list:
    """Interceptors that add the cluster token to every call on a channel (one per call kind:
    grpc.aio files an interceptor under the first kind it implements only)."""
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call whose token is missing or wrong, before its handler sees it."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        given = b""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else value
        handler = await continuation(details)
        if hmac.compare_digest(given, self._expected) or handler is None:
            return handler
        return _refusal(handler)


async def _deny(request_or_iterator, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong pdserve cluster token")


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that aborts at once; the request is never deserialized."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny)
    return grpc.unary_unary_rpc_method_handler(_deny)
