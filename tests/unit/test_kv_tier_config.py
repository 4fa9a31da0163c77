"""The second KV tier's settings (engine.config.KVTierConfig): off by default, the workers'
flags and a pool's `engine: {kv_tier: ...}` reach the engine's config, settings it cannot
run with are refused, and each KV layout gets a store directory of its own."""

import argparse

import pytest

from pdserve.cluster.config import load_config
from pdserve.engine.arg_utils import add_engine_args, engine_config_from_args
from pdserve.engine.config import SIM_MODEL, EngineConfig, KVTierConfig
from pdserve.engine.kv_tier import layout_directory


def test_the_tier_is_off_by_default_and_its_flags_follow_from_kvtierconfig():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).kv_tier == KVTierConfig() and not KVTierConfig().enabled
    args = parser.parse_args(["--kv-tier-enabled", "--kv-tier-budget-bytes", "1000", "--kv-tier-directory", "/t"])
    assert engine_config_from_args(args).kv_tier == KVTierConfig(enabled=True, budget_bytes=1000, directory="/t")


def test_a_pools_engine_section_sets_the_tier():
    config = load_config(None, {"decode.engine": {"kv_tier": {"enabled": True, "directory": "/t"}}})
    decode = EngineConfig.from_kwargs(**config.engine_kwargs("decode"))
    assert decode.kv_tier == KVTierConfig(enabled=True, directory="/t")
    assert not EngineConfig.from_kwargs(**config.engine_kwargs("prefill")).kv_tier.enabled


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": SIM_MODEL, "kv_tier": {"enabled": True}}, "simulated engine computes no KV"),
    ({"enable_prefix_caching": False, "kv_tier": {"enabled": True}}, "needs prefix caching"),
    ({"kv_tier": {"budget_bytes": 0}}, "kv_tier.budget_bytes must be"),
    ({"kv_tier": {"size": 1}}, "unexpected keyword argument 'size'"),
])
def test_settings_the_tier_cannot_run_with_are_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        EngineConfig(**kwargs)


def test_each_kv_layout_has_a_directory_of_its_own(tmp_path):
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    layout = ("m|torch.float32", checkpoint, 16, (2, 2, 16))
    base = layout_directory(tmp_path / "tier", *layout)
    assert base.parent == tmp_path / "tier" and base == layout_directory(tmp_path / "tier", *layout)
    others = {layout_directory(tmp_path / "tier", *changed) for changed in (
        ("m|torch.bfloat16", checkpoint, 16, (2, 2, 16)), ("m|torch.float32", checkpoint, 32, (2, 2, 16)),
        ("m|torch.float32", checkpoint, 16, (2, 4, 16)))}
    (checkpoint / "model.safetensors").write_bytes(b"other weights")  # rewritten in place
    others.add(layout_directory(tmp_path / "tier", *layout))
    assert len(others) == 4 and base not in others
