"""The deployment config (YAML, validated with pydantic at this edge) and what each
component's frozen config is built from. A bad field is reported by its dotted path.

The defaults live here and describe one machine (workers on loopback); `pdserve up` with no
`--config` uses them. `deploy/local.yaml` is a documented copy of them (a test keeps it
equal), and `deploy/cluster-serve.yaml` is the starting point for a multi-node cluster."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pdserve.engine.config import DEFAULT_MODEL, EngineConfig
from pdserve.router.policies import CacheAwareWeights
from pdserve.rpc.security import TOKEN_ENV, Security, new_token, resolve_token


class PoolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(1, ge=0, description="workers in this pool")
    min_replicas: int = Field(0, ge=0, description="autoscaler lower bound")
    max_replicas: int = Field(8, ge=1, description="autoscaler upper bound")
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs per worker")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per worker")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources, e.g. {prefill: 1} to pin to labelled nodes")
    placement: Literal["spread", "pack"] = Field(
        "spread", description="spread: workers over the nodes that can host them, so one node's loss never "
                              "takes the whole pool; pack: fill a node first (Ray's default placement)")
    engine: dict = Field(default_factory=dict, description="engine options (block_size, max_num_batched_tokens, ...)")
    cpu_affinity: list[int] | None = Field(None, description="pin this pool's workers to these CPU cores")

    @field_validator("engine")
    @classmethod
    def _engine_options(cls, value: dict) -> dict:
        try:
            EngineConfig.from_kwargs(**{"model": DEFAULT_MODEL, **value})  # names a bad option
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        return value


class CacheAwareSpec(BaseModel):
    """The cache-aware policy's exchange rates, in prompt tokens (router.policies.CacheAwareWeights)."""

    model_config = ConfigDict(extra="forbid")
    request_tokens: int = Field(CacheAwareWeights.request_tokens, ge=0,
                                description="what one open request on a decode worker is worth")
    kv_tokens: int = Field(CacheAwareWeights.kv_tokens, ge=0, description="what a full KV cache is worth")


class RouterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    routing: Literal["cache-aware", "least-loaded", "round-robin"] = Field(
        "cache-aware", description="cache-aware: where the prompt's KV is cached, traded against load")
    cache_aware: CacheAwareSpec = Field(default_factory=lambda: CacheAwareSpec())
    max_inflight_requests: int = Field(256, ge=1)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    admin_token: str | None = Field(None, description="bearer token for /admin (or env PDSERVE_ADMIN_TOKEN)")
    request_timeout_s: float = Field(600.0, gt=0)
    max_migrations: int = Field(2, ge=0, description="times a request whose decode worker fails mid-stream is "
                                                     "resumed on another (0: the client gets the error)")
    migration_wait_s: float = Field(30.0, ge=0, description="how long a request whose decode worker failed waits "
                                    "for another to become routable (e.g. the replacement) before failing")
    api_keys: list[str] | None = Field(None, description="bearer keys /v1 requires (or env PDSERVE_API_KEY, "
                                                         "comma-separated); none: /v1 is open")
    metrics_require_key: bool = Field(False, description="/metrics requires an API key too")
    https_cert_file: str | None = Field(None, description="serve HTTPS with this certificate (PEM)")
    https_key_file: str | None = Field(None, description="the HTTPS certificate's key (PEM)")


class TLSSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cert_file: str = Field(description="certificate every worker serves gRPC with (PEM; valid for the "
                                       "addresses workers listen on)")
    key_file: str = Field(description="its private key (PEM)")
    ca_file: str | None = Field(None, description="CA that signed it (default: the certificate itself)")


class TracingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    otlp_endpoint: str | None = Field(None, description="export OpenTelemetry traces of every request over "
                                      "OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317 (https:// for TLS), "
                                      "like vLLM's --otlp-traces-endpoint; null: no tracing")


class AutoscalerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = False
    profile: str | None = Field(None, description="JSON from `pdserve profile` (required when enabled)")
    ttft_slo_s: float = Field(2.0, gt=0)
    tpot_slo_s: float = Field(0.15, gt=0)
    percentile: float = Field(90.0, gt=0, lt=100)
    interval_s: float = Field(10.0, gt=0, description="seconds between decisions")
    window_s: float = Field(30.0, gt=0, description="observations older than this are ignored")
    cooldown_s: float = Field(30.0, ge=0, description="least time between changes of one pool")
    min_samples: int = Field(5, ge=1)


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(DEFAULT_MODEL, description="model name, checkpoint dir, .gguf, or cached hub id")
    served_model_name: str | None = Field(None, description="name clients send (default: model)")
    kv_transport: Literal["torch", "grpc"] = "torch"
    kv_transfer_timeout_s: float = Field(60.0, gt=0)
    kv_send_deadline_s: float = Field(5.0, gt=0, description="a prefill worker fails a request's leg when its "
                                      "decode worker takes no KV piece for this long (it stopped reading)")
    local_prefill_max_tokens: int = Field(256, ge=0, description="a decode worker prefills a request itself when "
                                          "its prefix cache lacks at most this many prompt tokens")
    max_queued_requests: int = Field(1024, ge=1, description="a worker refuses new requests past this many waiting "
                                     "(decode: for KV blocks or a batch slot, and the router retries another, then "
                                     "answers 429; prefill: legs open, and the decode worker tries another "
                                     "prefill worker, then prefills itself)")
    prefill_profile: str | None = Field(None, description="`pdserve profile` JSON: decode workers then also "
                                        "prefill longer tails themselves when its latency model says it is faster")
    worker_host: str | None = Field("127.0.0.1", description="address workers listen on; null: each node's IP "
                                    "(what a multi-node cluster needs)")
    health_check_interval_s: float = Field(1.0, gt=0)
    drain_timeout_s: float = Field(300.0, gt=0)
    cluster_token: str | None = Field(None, repr=False,
                                      description="shared secret of internal RPCs (or env PDSERVE_CLUSTER_TOKEN); "
                                                  "`pdserve up` generates one when neither is set")
    tls: TLSSpec | None = Field(None, description="TLS for internal gRPC (router <-> workers, decode <-> prefill)")
    env: dict[str, str] = Field(default_factory=dict,
                                description="environment of worker processes (KV pairs bind each worker's own "
                                            "address: no GLOO_SOCKET_IFNAME needed)")
    router: RouterSpec = Field(default_factory=RouterSpec)
    prefill: PoolSpec = Field(default_factory=PoolSpec)
    decode: PoolSpec = Field(default_factory=PoolSpec)
    autoscaler: AutoscalerSpec = Field(default_factory=AutoscalerSpec)
    tracing: TracingSpec = Field(default_factory=TracingSpec)

    @field_validator("decode")
    @classmethod
    def _decode_nonempty(cls, value: PoolSpec) -> PoolSpec:
        if value.replicas < 1:
            raise ValueError("the decode pool needs at least 1 replica")
        return value

    @model_validator(mode="after")
    def _autoscaler_needs_profile(self):
        if self.autoscaler.enabled and not self.autoscaler.profile:
            raise ValueError("autoscaler.profile is required when autoscaler.enabled (run `pdserve profile`)")
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def pool(self, role: str) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode

    def engine_kwargs(self, role: str) -> dict:
        return {"model": self.model, **self.pool(role).engine}

    def admin_token(self) -> str | None:
        return self.router.admin_token or os.environ.get("PDSERVE_ADMIN_TOKEN")

    def security(self) -> Security:
        """The processes' credentials; ValueError when no cluster token is set (see `with_token`)."""
        tls = self.tls
        return Security(resolve_token(self.cluster_token), tls.cert_file if tls else None,
                        tls.key_file if tls else None, tls.ca_file if tls else None)

    def with_token(self) -> ServeConfig:
        """This config with a cluster token: the configured one, the environment's, or a new one."""
        token = self.cluster_token or os.environ.get(TOKEN_ENV) or new_token()
        return self.model_copy(update={"cluster_token": token})


def load_config(path: str | Path | None = None, overrides: dict | None = None) -> ServeConfig:
    """Read YAML (or defaults), apply dotted overrides ({"router.port": 8001}); ValueError
    naming `file: field.path: problem` on any mistake."""
    data: dict = {}
    source = str(path) if path else "defaults"
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ValueError(f"config file {path} not found") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{source}: {problems}") from None
