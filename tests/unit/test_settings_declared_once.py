"""Each router and worker setting is declared once (router.config, worker_base.config): the
deployment's YAML, the bare router's and the workers' flags and the processes' configs all
follow from that declaration, with the same default, and no other class declares it again."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
from pathlib import Path

import pytest

from pdserve.cluster.config import ServeConfig, load_config
from pdserve.engine.arg_utils import config_options
from pdserve.protos import DEFAULT_KV_TRANSPORT, KV_TRANSPORTS
from pdserve.router.config import RouterConfig, RouterSettings
from pdserve.router.policies import CacheAwareWeights
from pdserve.router.server import build_parser, router_config_from_args
from pdserve.rpc.security import Security
from pdserve.worker_base.config import WorkerConfig, WorkerSettings, add_worker_args

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("cluster", "router", "worker_base", "prefill_worker", "decode_worker", "engine", "kv_transfer", "rpc",
           "protos")
TOKEN = "t" * 32
# Settings whose names other, different settings share: pdserve up's --host/--port override
# router.host/port; a worker's host and port are where it listens; `replicas` is the router's
# (router.replicas, flag --routers) and a pool's (prefill.replicas, decode.replicas), and so is
# `resources` (router.resources, prefill.resources: the Ray resources each replica or worker needs).
SHARED_NAMES = {"host", "port", "replicas", "resources"}
SETTINGS = sorted((set(RouterSettings.model_fields) | set(WorkerSettings.model_fields)) - SHARED_NAMES)


def leaf_defaults(schema) -> dict[str, object]:
    """argparse dest -> default of every field of a pydantic model (a nested dataclass's fields
    flattened as `<field>_<name>`), read from the model itself, not from its flags."""
    out = {}
    for name, info in schema.model_fields.items():
        default = info.get_default(call_default_factory=True)
        if dataclasses.is_dataclass(default):
            out.update({f"{name}_{k}": v for k, v in dataclasses.asdict(default).items()})
        else:
            out[name] = default
    return out


def test_every_router_setting_is_a_flag_of_the_bare_router_with_its_default():
    parser = build_parser()
    dests = {action.dest for action in parser._actions}
    for dest, default in leaf_defaults(RouterConfig).items():
        if dest in ("security", "resources"):  # --cluster-token and the TLS files; Ray placement only
            continue
        assert dest in dests, f"RouterConfig.{dest} has no flag"
        assert parser.get_default(dest) == default, dest


def test_every_worker_setting_is_a_flag_of_the_workers_with_its_default():
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    dests = {action.dest for action in parser._actions}
    for dest, default in leaf_defaults(WorkerConfig).items():
        if dest in ("security", "worker_id"):  # the rpc layer's flags; a fresh id each process
            continue
        assert dest in dests, f"WorkerConfig.{dest} has no flag"
        assert parser.get_default(dest) == default, dest


def test_the_deployments_defaults_are_the_routers_and_the_workers():
    config = load_config(None)
    assert config.router == RouterSettings()
    assert {name: getattr(config, name) for name in WorkerSettings.model_fields} == WorkerSettings().model_dump()
    assert config.kv_transport == RouterConfig.model_fields["kv_transport"].default == DEFAULT_KV_TRANSPORT
    assert config.worker_host == WorkerConfig.model_fields["host"].default
    assert set(WorkerSettings.model_fields) < set(ServeConfig.model_fields)  # flat at the top level, as in YAML


def test_the_kv_transports_are_the_protos_ones():
    (option,) = [o for o in config_options(RouterConfig) if o.path == ("kv_transport",)]
    assert option.kwargs["choices"] == list(KV_TRANSPORTS) and option.kwargs["default"] == DEFAULT_KV_TRANSPORT
    with pytest.raises(ValueError, match="kv_transport: Input should be 'torch' or 'grpc'"):
        load_config(None, {"kv_transport": "udp"})


@functools.cache
def product_nodes() -> list[tuple[str, ast.AST]]:
    """(file, node) of every syntax node of the product code."""
    return [(str(path.relative_to(ROOT)), node) for package in PRODUCT for path in (ROOT / package).rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text(), str(path)))]


def declared_by(name: str) -> list[str]:
    """The product classes that declare a field `name`."""
    return [f"{path}:{node.name}" for path, node in product_nodes() if isinstance(node, ast.ClassDef)
            for stmt in node.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name]


def written_in(text: str, packages: tuple[str, ...] = PRODUCT) -> list[str]:
    """The product files of `packages` where the string constant `text` occurs."""
    return [path for path, node in product_nodes()
            if isinstance(node, ast.Constant) and node.value == text and path.split("/")[0] in packages]


@pytest.mark.parametrize("name", SETTINGS)
def test_each_setting_is_declared_by_one_class_and_its_flag_by_none(name):
    assert len(declared_by(name)) == 1, declared_by(name)
    flag = "--" + name.replace("_", "-")
    assert not written_in(flag), f"{flag} is declared by hand in {written_in(flag)}"


def test_no_transport_name_is_written_out_beside_the_protos_declaration():
    for name in KV_TRANSPORTS:
        assert not written_in(name, ("cluster", "router", "worker_base")), name


def test_the_documented_router_flags_build_its_config(monkeypatch):
    monkeypatch.delenv("PDSERVE_ADMIN_TOKEN", raising=False)
    argv = ["--decode", "h:1", "--model", "m", "--served-model-name", "tiny", "--host", "0.0.0.0", "--port", "8001",
            "--routing", "round-robin", "--cache-aware-request-tokens", "7", "--cache-aware-kv-tokens", "9",
            "--max-inflight-requests", "3", "--kv-transport", "grpc", "--max-migrations", "5",
            "--migration-wait-s", "1.5", "--api-key", "a", "--api-key", "b", "--https-cert", "c.pem",
            "--https-key", "k.pem", "--ttft-slo-s", "1", "--tpot-slo-s", "0.1", "--metrics-require-key",
            "--cluster-token", TOKEN]
    config = router_config_from_args(build_parser().parse_args(argv))
    assert config == RouterConfig(
        model="m", served_model_name="tiny", host="0.0.0.0", port=8001, routing="round-robin",
        cache_aware=CacheAwareWeights(7, 9), max_inflight_requests=3, kv_transport="grpc", max_migrations=5,
        migration_wait_s=1.5, api_keys=("a", "b"), https_cert_file="c.pem", https_key_file="k.pem", ttft_slo_s=1,
        tpot_slo_s=0.1, metrics_require_key=True, security=config.security)
    assert config.security.cluster_token == TOKEN


def test_a_bad_router_flag_is_named(monkeypatch):
    parser = build_parser()
    with pytest.raises(ValueError, match="--port: Input should be less than or equal to 65535"):
        router_config_from_args(parser.parse_args(["--decode", "h:1", "--port", "70000", "--cluster-token", TOKEN]))
    with pytest.raises(ValueError, match="--max-migrations: Input should be greater than or equal to 0"):
        router_config_from_args(parser.parse_args(["--decode", "h:1", "--max-migrations=-1",
                                                   "--cluster-token", TOKEN]))
    with pytest.raises(ValueError, match="HTTPS needs both a certificate file and a key file"):
        router_config_from_args(parser.parse_args(["--decode", "h:1", "--https-cert", "c", "--cluster-token", TOKEN]))


def test_the_deployment_builds_the_routers_and_the_workers_configs(monkeypatch):
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "from-the-environment")
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    config = load_config(None, {"router.max_migrations": 0, "router.cache_aware": {"kv_tokens": 0},
                                "kv_transport": "grpc", "served_model_name": "tiny", "cluster_token": TOKEN,
                                "kv_send_deadline_s": 2.5, "worker_host": None, "tracing.otlp_endpoint": "http://c:1"})
    router = config.router_config()
    assert router.max_migrations == 0 and router.cache_aware == CacheAwareWeights(256, 0)
    assert router.kv_transport == "grpc" and router.model == config.model and router.served_model_name == "tiny"
    assert router.admin_token == "from-the-environment" and router.api_keys == ()  # unset: the environment's
    assert router.ttft_slo_s == config.autoscaler.ttft_slo_s and router.otlp_traces_endpoint == "http://c:1"
    assert router.security == config.security()
    kwargs = config.worker_kwargs()
    assert "host" not in kwargs  # null: the worker's node IP
    worker = WorkerConfig(**kwargs, host="10.0.0.1")
    assert worker.kv_send_deadline_s == 2.5 and worker.otlp_traces_endpoint == "http://c:1"
    assert load_config(None, {"cluster_token": TOKEN}).worker_kwargs()["host"] == "127.0.0.1"


def test_the_router_config_needs_the_cluster_token_and_names_the_model_it_serves():
    with pytest.raises(ValueError, match="security"):
        RouterConfig(model="m")
    assert RouterConfig(model="m", security=Security(TOKEN)).served_model_name == "m"
