"""Deployment config and CLI overrides: every mistake names the field."""

import argparse
from pathlib import Path

import pytest

from pdserve.cluster.cli_planner import _seconds, replicas_from_plan
from pdserve.cluster.cli_service import _overrides
from pdserve.cluster.config import load_config


def test_deploy_local_yaml_is_a_copy_of_the_defaults():
    """`pdserve up` without --config uses the defaults in code (so an installed wheel needs no
    YAML); deploy/local.yaml documents them and must say exactly the same."""
    local = Path(__file__).resolve().parents[2] / "deploy" / "local.yaml"
    assert load_config(local).model_dump() == load_config(None).model_dump()
    assert load_config(None).worker_host == "127.0.0.1"  # one machine: workers on loopback


def test_defaults_and_dotted_overrides():
    config = load_config(None, {"router.port": 8123, "decode.engine.max_num_seqs": 64})
    assert config.router.port == 8123 and config.decode.engine == {"max_num_seqs": 64}
    assert config.prefill.replicas == 1 and config.kv_transport == "torch"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prefill.num_cpus": 0}, "prefill.num_cpus: Input should be greater than 0"),
        ({"decode.replicas": 0}, "decode"),
        ({"router.routing": "random"}, "router.routing"),
        ({"kv_transport": "carrier-pigeon"}, "kv_transport"),
        ({"bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({"decode.engine": {"block_size": 0}}, "block_size must be an integer"),
        ({"decode.engine": {"max_batch": 3}}, "unknown engine argument"),
        ({"autoscaler.enabled": True}, "autoscaler.profile is required"),
    ],
)
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("router: [1, 2")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("router:\n  port: eighty\n")
    with pytest.raises(ValueError, match=r"bad.yaml: router.port"):
        load_config(bad)


def test_plan_file_sets_pool_sizes(tmp_path):
    plan = tmp_path / "plan.yaml"
    plan.write_text("prefill: {replicas: 3}\ndecode: {replicas: 2}\n")
    args = argparse.Namespace(plan=str(plan), model=None, host=None, port=None, prefill=None, decode=None, set=[])
    assert _overrides(args) == {"prefill.replicas": 3, "decode.replicas": 2}
    plan.write_text("prefill: 3\n")
    with pytest.raises(ValueError, match="needs prefill.replicas and decode.replicas"):
        replicas_from_plan(str(plan))


def test_durations():
    assert _seconds("2s") == 2.0 and _seconds("150ms") == 0.15 and _seconds("0.5") == 0.5
    with pytest.raises(ValueError, match="not a duration"):
        _seconds("soon")


def test_a_cluster_token_is_generated_when_none_is_given(monkeypatch):
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN", raising=False)
    config = load_config(None)
    with pytest.raises(ValueError, match="no cluster token"):
        config.security()
    first, second = config.with_token(), config.with_token()
    assert len(first.cluster_token) >= 32 and first.cluster_token != second.cluster_token
    assert first.security().cluster_token == first.cluster_token
    assert first.cluster_token not in repr(first)  # never in a repr, so never in a log line
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "from-the-environment-0123")
    assert config.with_token().cluster_token == "from-the-environment-0123"
    assert load_config(None, {"cluster_token": "configured-token-0123456"}).with_token().cluster_token \
        == "configured-token-0123456"
