"""The deployment config (YAML, validated with pydantic at this edge) and what each
component's frozen config is built from. A bad field is reported by its dotted path.

The defaults describe one machine (workers on loopback); `pdserve up` with no `--config` uses
them. Each setting is declared once: the router's in router.config (RouterSettings), the
workers' in worker_base.config (WorkerSettings, whose fields this top level carries), the
rest here; `router_config()` and `worker_kwargs()` build the processes' configs from them.
`deploy/local.yaml` is a documented copy of the defaults (a test keeps it equal), and
`deploy/cluster-serve.yaml` is the starting point for a multi-node cluster."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from pdserve.engine.config import DEFAULT_MODEL, SIM_MODEL, EngineConfig, SimConfig, checkpoint_of
from pdserve.protos import DEFAULT_KV_TRANSPORT
from pdserve.router.config import KVTransport, ModelName, RouterConfig, RouterSettings, ServedModelName
from pdserve.rpc.security import TOKEN_ENV, Security, new_token, resolve_token
from pdserve.worker_base.config import WorkerConfig, WorkerSettings


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
        if "sim" in value:
            raise ValueError("set `sim` at the top level: both pools and the router share it")
        try:
            EngineConfig.from_kwargs(**{"model": DEFAULT_MODEL, **value})  # names a bad option
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        return value


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


class RouterScalingSpec(BaseModel):
    """How the autoscaler sizes the router replicas from their CPU (cluster.autoscaler.RouterSizer).
    One router process tops out at about one core, so the replicas' mean CPU says whether they keep up."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=1, description="lower bound of the router replicas")
    max_replicas: int | None = Field(None, ge=1, description="upper bound of the router replicas; null: fixed at "
                                     "`router.replicas` (the autoscaler leaves the routers alone unless this is "
                                     "above min_replicas). Replicas share their hosts' cores (all the head's "
                                     "without `router.resources`): more than those cores buys nothing")
    cpu_high: float = Field(0.7, gt=0, description="cores: one replica more when the replicas' mean CPU is above "
                                                   "this (a router tops out at about 1)")
    cpu_low: float = Field(0.35, gt=0, description="cores: one replica fewer once the replicas' CPU spread over "
                                                   "one replica fewer stays below this for a whole cooldown")

    @model_validator(mode="after")
    def _low_below_high(self):
        if self.cpu_low >= self.cpu_high:
            raise ValueError(f"cpu_low ({self.cpu_low}) must be below cpu_high ({self.cpu_high}): the replicas "
                             f"left after a scale-down would read as too busy")
        return self

    def bounds(self) -> tuple[int, int] | None:
        """[min, max] of the replica count; None when it is fixed (max unset, or not above min)."""
        ranged = self.max_replicas is not None and self.max_replicas > self.min_replicas
        return (self.min_replicas, self.max_replicas) if ranged else None


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
    routers: RouterScalingSpec = Field(default_factory=RouterScalingSpec,
                                       description="the router replicas' bounds and CPU marks")


class ServeConfig(WorkerSettings):
    """The deployment. Its top level carries the workers' settings (WorkerSettings' fields);
    `router` is the router's (RouterSettings)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName = DEFAULT_MODEL
    served_model_name: ServedModelName = None
    kv_transport: KVTransport = DEFAULT_KV_TRANSPORT
    worker_host: str | None = Field(WorkerConfig.model_fields["host"].default, description="address workers "
                                    "listen on; null: each node's IP (what a multi-node cluster needs)")
    health_check_interval_s: float = Field(1.0, gt=0)
    drain_timeout_s: float = Field(300.0, gt=0)
    cluster_token: str | None = Field(None, repr=False,
                                      description="shared secret of internal RPCs (or env PDSERVE_CLUSTER_TOKEN); "
                                                  "`pdserve up` generates one when neither is set")
    tls: TLSSpec | None = Field(None, description="TLS for internal gRPC (router <-> workers, decode <-> prefill)")
    env: dict[str, str] = Field(default_factory=dict,
                                description="environment of worker processes (KV pairs bind each worker's own "
                                            "address: no GLOO_SOCKET_IFNAME needed)")
    sim: SimConfig = Field(default_factory=SimConfig, description="the simulated engine, when `model` is "
                           f"`{SIM_MODEL}`: the tokenizer and shapes it takes, its latency profile and speed")
    router: RouterSettings = Field(default_factory=RouterSettings)
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

    @field_validator("served_model_name")
    @classmethod
    def _sim_is_served_as_sim(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("model") == SIM_MODEL and value not in (None, SIM_MODEL):
            raise ValueError(f"a simulated deployment is served as `{SIM_MODEL}`, so that no client mistakes it "
                             f"for a model: leave it unset")
        return value

    @model_validator(mode="after")
    def _autoscaler_needs_profile(self):
        if self.autoscaler.enabled and not self.autoscaler.profile:
            raise ValueError("autoscaler.profile is required when autoscaler.enabled (run `pdserve profile`)")
        return self

    @model_validator(mode="after")
    def _router_replicas_within_bounds(self):
        scaling, replicas = self.autoscaler.routers, self.router.replicas
        if not scaling.min_replicas <= replicas <= (scaling.max_replicas or replicas):
            raise ValueError(f"router.replicas ({replicas}) must be within autoscaler.routers' min_replicas "
                             f"({scaling.min_replicas}) and max_replicas ({scaling.max_replicas})")
        if self.router_bounds() and self.router.port == 0:
            raise ValueError("autoscaled router replicas share one port: give router.port other than 0")
        return self

    def router_bounds(self) -> tuple[int, int] | None:
        """[min, max] the autoscaler keeps the router replicas in; None when it leaves their
        count alone (autoscaler off, or `autoscaler.routers` fixes it)."""
        return self.autoscaler.routers.bounds() if self.autoscaler.enabled else None

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def simulated(self) -> dict | None:
        """The simulated engine's settings (`sim`) when the model is `sim`, else None."""
        return dataclasses.asdict(self.sim) if self.model == SIM_MODEL else None

    def pool(self, role: str) -> PoolSpec:
        return self.prefill if role == "prefill" else self.decode

    def engine_kwargs(self, role: str) -> dict:
        return {"model": self.model, "sim": self.sim, **self.pool(role).engine}

    def security(self) -> Security:
        """The processes' credentials; ValueError when no cluster token is set (see `with_token`)."""
        tls = self.tls
        return Security(resolve_token(self.cluster_token), tls.cert_file if tls else None,
                        tls.key_file if tls else None, tls.ca_file if tls else None)

    def router_config(self) -> RouterConfig:
        """The router's config: `router` and the deployment's part, with the environment's
        fallbacks (RouterConfig.with_environment); ValueError without a cluster token. The
        router loads the tokenizer of the model's checkpoint (`sim.like` for `sim`)."""
        return RouterConfig(**dict(self.router), model=checkpoint_of(self.model, self.sim), served_model_name=self.name,
                            kv_transport=self.kv_transport, security=self.security(),
                            ttft_slo_s=self.autoscaler.ttft_slo_s, tpot_slo_s=self.autoscaler.tpot_slo_s,
                            otlp_traces_endpoint=self.tracing.otlp_endpoint).with_environment()

    def worker_kwargs(self) -> dict:
        """What each worker's WorkerConfig is built from; without `host` when `worker_host` is
        null (the worker then listens on its node's IP). ValueError without a cluster token."""
        kwargs = {**{name: getattr(self, name) for name in WorkerSettings.model_fields},
                  "security": self.security(), "otlp_traces_endpoint": self.tracing.otlp_endpoint}
        return {**kwargs, "host": self.worker_host} if self.worker_host else kwargs

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
