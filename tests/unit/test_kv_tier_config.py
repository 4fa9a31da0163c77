"""The second KV tier's settings (engine.config.KVTierConfig): on by default in a serving
worker with a real model and prefix caching, off in the offline engine; the workers'
flags and a pool's `engine: {kv_tier: ...}` reach the engine's config, settings it cannot
run with are refused, and each KV layout gets a store directory of its own."""

import argparse

import pytest

from pdserve.cluster.config import load_config
from pdserve.engine.arg_utils import add_engine_args, engine_config_from_args
from pdserve.engine.config import SIM_MODEL, EngineConfig, KVTierConfig
from pdserve.engine.kv_tier import layout_directory


def test_the_tier_is_on_by_default_where_it_can_run_in_a_serving_worker_only():
    default = EngineConfig()
    assert default.kv_tier.enabled is None and default.kv_tier.budget_bytes == 8 << 30
    assert default.kv_tier_on(serving=True) and not default.kv_tier_on(serving=False)
    for cannot in (EngineConfig(model=SIM_MODEL), EngineConfig(enable_prefix_caching=False)):
        assert not cannot.kv_tier_on(serving=True)  # the default, not refused
    assert EngineConfig(kv_tier={"enabled": True}).kv_tier_on(serving=False)  # asked for, offline too
    assert not EngineConfig(kv_tier={"enabled": False}).kv_tier_on(serving=True)


def test_the_tiers_flags_follow_from_kvtierconfig():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).kv_tier == KVTierConfig()
    args = parser.parse_args(["--kv-tier-enabled", "--kv-tier-budget-bytes", "1000", "--kv-tier-directory", "/t"])
    assert engine_config_from_args(args).kv_tier == KVTierConfig(enabled=True, budget_bytes=1000, directory="/t")
    assert engine_config_from_args(parser.parse_args(["--no-kv-tier-enabled"])).kv_tier.enabled is False


def test_a_pools_engine_section_sets_the_tier():
    config = load_config(None, {"decode.engine": {"kv_tier": {"enabled": True, "directory": "/t"}}})
    decode = EngineConfig.from_kwargs(**config.engine_kwargs("decode"))
    assert decode.kv_tier == KVTierConfig(enabled=True, directory="/t")
    assert EngineConfig.from_kwargs(**config.engine_kwargs("prefill")).kv_tier == KVTierConfig()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": SIM_MODEL, "kv_tier": {"enabled": True}}, "simulated engine computes no KV"),
    ({"enable_prefix_caching": False, "kv_tier": {"enabled": True}}, "needs prefix caching"),
    ({"kv_tier": {"budget_bytes": 0}}, "kv_tier.budget_bytes must be"),
    ({"kv_tier": {"size": 1}}, "unexpected keyword argument 'size'"),
    ({"kv_tier": {"enabled": "yes"}}, "kv_tier.enabled must be true, false or null"),
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
