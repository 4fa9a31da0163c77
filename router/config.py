"""The router's settings, each declared once with its default, type, bounds and help.

`RouterSettings` is what a deployment sets for its router (the `router:` section of the
YAML, `cluster.config.ServeConfig.router`); `RouterConfig` is what one router process runs
with: those settings plus what the deployment supplies (the model, the cluster's
credentials, the KV transport, the SLOs, the trace collector). The bare router's flags
(`python -m pdserve.router --help`) are derived from RouterConfig's fields
(engine.arg_utils); a field whose flag is not its name says so (`json_schema_extra`).
`KVTransport`, `ModelName` and `ServedModelName` are the field types the deployment's
config shares with RouterConfig."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.engine.config import DEFAULT_MODEL
from pdserve.protos import DEFAULT_KV_TRANSPORT, KV_TRANSPORTS
from pdserve.router.policies import DEFAULT_POLICY, POLICIES, CacheAwareWeights
from pdserve.rpc.security import Security

ADMIN_TOKEN_ENV = "PDSERVE_ADMIN_TOKEN"

KVTransport = Annotated[Literal[KV_TRANSPORTS], Field(
    description="how prefill workers ship KV to decode workers: torch (gloo on CPU, NCCL on GPU) or grpc")]
ModelName = Annotated[str, Field(description="model name, checkpoint dir, .gguf, or cached hub id (the router "
                                             "loads its tokenizer, the workers the model)")]
ServedModelName = Annotated[str | None, Field(description="the name clients send (default: the model)")]
RoutingPolicyName = Literal[tuple(POLICIES)]


class RouterSettings(BaseModel):
    """The router's own settings. `admin_token` and `api_keys` left unset fall back to the
    environment when the router is configured (`RouterConfig.with_environment`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    host: str | None = Field("127.0.0.1", description="address to listen on; null: the address of the node each "
                                                     "replica runs on (replicas on several nodes: `resources`)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    replicas: int = Field(1, ge=1, json_schema_extra={"flag": "--routers"},
                          description="router processes serving the one host:port, each binding it with "
                                      "SO_REUSEPORT (Linux spreads new connections over them); 1: one router "
                                      "binding the port as usual")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each replica needs, e.g. {router: 1} with nodes offering `router: 1` "
                    "(deploy/nodes.yaml): a replica per labelled node, behind a load balancer "
                    "(deploy/nginx-router.conf); {}: every replica on the head node")
    routing: RoutingPolicyName = Field(DEFAULT_POLICY, description="how to pick workers; cache-aware: where the "
                                       "prompt's KV is cached, traded against load")
    cache_aware: CacheAwareWeights = Field(default_factory=CacheAwareWeights,
                                           description="the cache-aware policy's exchange rates, in prompt tokens")
    max_inflight_requests: int = Field(256, ge=1, description="past this many open requests new ones get 429 "
                                                              "with Retry-After")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger request bodies get 413")
    admin_token: str | None = Field(None, repr=False, description="bearer token /admin/* requires (default: "
                                    f"${ADMIN_TOKEN_ENV}; neither: /admin is disabled)")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of one decode worker's part of a request")
    max_migrations: int = Field(2, ge=0, description="times a request whose decode worker fails mid-stream is "
                                "resumed on another, token-exact (0: the client gets the error)")
    migration_wait_s: float = Field(30.0, ge=0, description="how long a request whose decode worker failed waits "
                                    "for another to become routable (a replacement starting) before the client "
                                    "gets the error")
    api_keys: tuple[str, ...] | None = Field(
        None, repr=False, json_schema_extra={"flag": "--api-key"},
        description="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (repeatable; "
                    "default: $PDSERVE_API_KEY, comma-separated; neither: open)")
    metrics_require_key: bool = Field(False, description="/metrics requires an API key too")
    https_cert_file: str | None = Field(None, json_schema_extra={"flag": "--https-cert"},
                                        description="serve HTTPS with this certificate (PEM)")
    https_key_file: str | None = Field(None, json_schema_extra={"flag": "--https-key"},
                                       description="the HTTPS certificate's private key (PEM)")

    @model_validator(mode="after")
    def _https_needs_both_files(self):
        if bool(self.https_cert_file) != bool(self.https_key_file):
            raise ValueError("HTTPS needs both a certificate file and a key file")
        return self

    @model_validator(mode="after")
    def _replicas_share_a_fixed_port(self):
        if self.replicas > 1 and self.port == 0:
            raise ValueError("router replicas share one port: give a port other than 0 (each replica would get "
                             "its own)")
        return self


class RouterConfig(RouterSettings):
    """What one router process runs with: its settings, taken as they are (see
    `with_environment`), and the deployment's part. `served_model_name` defaults to `model`."""

    model: ModelName = DEFAULT_MODEL
    served_model_name: ServedModelName = None
    kv_transport: KVTransport = DEFAULT_KV_TRANSPORT
    security: Security = Field(description="cluster token (and TLS) of the router's RPCs to workers")
    ttft_slo_s: float | None = Field(None, gt=0, description="TTFT SLO in seconds: exports "
                                     "pdserve_slo_ttft_seconds and goodput (with --tpot-slo-s)")
    tpot_slo_s: float | None = Field(None, gt=0, description="TPOT SLO in seconds (see --ttft-slo-s)")
    otlp_traces_endpoint: str | None = Field(None, description="export OpenTelemetry traces here (rpc.tracing); "
                                                               "None: off")
    replica: int | None = Field(None, ge=0, description="which router replica this process is (set by the "
                                "controller; answers name it in their x-pdserve-replica header); None: not a replica")

    @model_validator(mode="before")
    @classmethod
    def _served_name_defaults_to_model(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("served_model_name"):
            return {**data, "served_model_name": data.get("model", cls.model_fields["model"].default)}
        return data

    def with_environment(self) -> RouterConfig:
        """This config with the environment's fallbacks: `admin_token` from $PDSERVE_ADMIN_TOKEN,
        `api_keys` from $PDSERVE_API_KEY (none: /v1 is open)."""
        from pdserve.router.auth import api_keys_from

        return self.model_copy(update={"admin_token": self.admin_token or os.environ.get(ADMIN_TOKEN_ENV),
                                       "api_keys": api_keys_from(self.api_keys)})
