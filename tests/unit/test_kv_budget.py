"""The CPU KV budget an engine takes when none is configured: `$PDSERVE_CPU_KV_CACHE_BYTES`,
else 2 GiB; a bad value is refused with a message naming the variable."""

import pytest

from pdserve.engine.config import CPU_KV_CACHE_ENV, DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, default_cpu_kv_cache_bytes


def test_unset_gives_the_two_gib_default(monkeypatch):
    monkeypatch.delenv(CPU_KV_CACHE_ENV, raising=False)
    assert default_cpu_kv_cache_bytes() == DEFAULT_CPU_KV_CACHE_BYTES == 2 << 30


def test_the_environment_sets_it(monkeypatch):
    monkeypatch.setenv(CPU_KV_CACHE_ENV, str(96 << 20))
    assert default_cpu_kv_cache_bytes() == 96 << 20


@pytest.mark.parametrize("raw", ["0", "-5", "2GiB", "1.5"])
def test_a_bad_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(CPU_KV_CACHE_ENV, raw)
    with pytest.raises(ValueError, match=f"{CPU_KV_CACHE_ENV} must be a positive number of bytes.*{raw!r}"):
        default_cpu_kv_cache_bytes()


def test_an_engine_without_a_budget_sizes_its_cache_from_the_environment(monkeypatch, tiny_llama_dir):
    from pdserve.engine.loader import kv_block_bytes, load_model, num_kv_blocks

    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32")
    loaded = load_model(config)
    per_block = kv_block_bytes(loaded.model.shape, config.block_size, loaded.model.dtype)
    for budget in (64 << 20, 80 << 20):
        monkeypatch.setenv(CPU_KV_CACHE_ENV, str(budget))
        assert num_kv_blocks(config, loaded) == budget // per_block
    explicit = EngineConfig(model=str(tiny_llama_dir), dtype="float32", kv_cache_bytes=32 << 20)
    assert num_kv_blocks(explicit, loaded) == (32 << 20) // per_block, "an explicit budget wins"
