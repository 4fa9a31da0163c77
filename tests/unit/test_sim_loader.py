"""A simulated engine reads its checkpoint through engine.loader.sim_facts: what
transformers' AutoConfig, GenerationConfig and the tokenizer make of the files, recorded once
per machine. The loaded model (shapes, limits, eos ids, tokenizer) is the one they give,
recorded or not, for Llama and Qwen2 configs with and without a sliding window, a generation
config or a tokenizer; a changed file is read afresh; and an engine whose facts are recorded
imports no transformers until its tokenizer is first used."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine import loader
from pdserve.engine.config import EngineConfig
from pdserve.engine.model.llama import ModelShape
from pdserve.engine.model_source import check_architecture


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "sim-facts"


def checkpoint(target: Path, smollm2_dir: Path, generation: bool = True, tokenizer: bool = True,
               **changes) -> Path:
    """SmolLM2's config and tokenizer (a simulated engine never reads weights), `changes` applied
    (None removes a key)."""
    target.mkdir()
    config = json.loads((smollm2_dir / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja") if tokenizer else ()
    for name in (*names, "generation_config.json") if generation else names:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, target / name)
    return target


def expected(model_dir: Path) -> tuple:
    """Shape, architecture, max_model_len and eos ids as the loader derives them from AutoConfig."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    engine = EngineConfig(model="sim", sim={"like": str(model_dir)})
    tokenizer = loader.load_tokenizer(model_dir)
    return (ModelShape.from_hf_config(hf_config), check_architecture(hf_config),
            loader.resolve_max_model_len(engine, hf_config),
            loader._eos_token_ids(model_dir, hf_config, tokenizer), tokenizer_facts(tokenizer))


def tokenizer_facts(tokenizer) -> tuple | None:
    if tokenizer is None:
        return None
    return type(tokenizer).__name__, tokenizer.eos_token_id, tokenizer("Hello, world").input_ids


def loaded(model_dir: Path) -> tuple:
    engine = EngineConfig(model="sim", sim={"like": str(model_dir)})
    result = loader.load_model(engine)
    return (result.shape, check_architecture(result.hf_config), result.max_model_len, result.eos_token_ids,
            tokenizer_facts(result.tokenizer))


VARIANTS = {
    "llama": {},
    "llama-no-generation-config": {"generation": False, "eos_token_id": [2, 0]},
    "llama-no-tokenizer": {"tokenizer": False, "eos_token_id": 5},
    "llama-defaults": {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": None},
    "qwen2-window-unused": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 4096,
                            "max_window_layers": 30},
    "qwen2-window-used": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "sliding_window": 2048,
                          "use_sliding_window": True, "max_window_layers": 30},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_recorded_facts_load_the_model_autoconfig_gives(variant, tmp_path, cache, smollm2_dir):
    changes = dict(VARIANTS[variant])
    model_dir = checkpoint(tmp_path / "model", smollm2_dir, changes.pop("generation", True),
                           changes.pop("tokenizer", True), **changes)
    want = expected(model_dir)
    assert loaded(model_dir) == want  # read by transformers, then recorded
    assert len(list(cache.glob("*.json"))) == 1
    assert loaded(model_dir) == want  # from the record


def test_a_changed_config_is_read_afresh(tmp_path, cache, smollm2_dir):
    model_dir = checkpoint(tmp_path / "model", smollm2_dir)
    assert loaded(model_dir)[2] == 8192
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    assert loaded(model_dir)[2] == 4096
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert loaded(model_dir)[3] == frozenset({2, 7})
    assert len(list(cache.glob("*.json"))) == 3


def test_a_damaged_record_is_read_again(tmp_path, cache, smollm2_dir):
    model_dir = checkpoint(tmp_path / "model", smollm2_dir)
    want = loaded(model_dir)
    (record,) = cache.glob("*.json")
    record.write_text("{not json")
    assert loaded(model_dir) == want
    assert json.loads(record.read_text())["config"]["num_hidden_layers"] == 30


def test_a_real_model_still_reads_autoconfig_and_its_tokenizer_at_load(tmp_path, cache, smollm2_dir, monkeypatch):
    monkeypatch.setattr(loader, "_load_weights", lambda *args: "weights")  # not what this is about
    result = loader.load_model(EngineConfig(model=str(checkpoint(tmp_path / "model", smollm2_dir))))
    assert type(result.hf_config).__name__ == "LlamaConfig" and result._tokenizer is not None
    assert not cache.exists()


def test_a_recorded_sim_engine_imports_transformers_at_its_tokenizers_first_use(tmp_path, cache, smollm2_dir):
    model_dir = checkpoint(tmp_path / "model", smollm2_dir)
    want = loaded(model_dir)  # recorded
    code = ("import sys; from pdserve.engine.llm_engine import LLMEngine; from pdserve.engine.config import "
            f"EngineConfig; engine = LLMEngine(EngineConfig(model='sim', sim={{'like': {str(model_dir)!r}}}, "
            "kv_cache_bytes=1 << 28)); before = 'transformers' in sys.modules; "
            "print(before, type(engine.tokenizer).__name__, 'transformers' in sys.modules, "
            "sorted(engine.loaded.eos_token_ids))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PDSERVE_CACHE": str(cache.parent)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().split(maxsplit=3) == ["False", want[4][0], "True", str(sorted(want[3]))]


def test_structured_output_loads_a_recorded_sim_engines_tokenizer(tmp_path, cache, smollm2_dir):
    from pdserve.engine.llm_engine import LLMEngine

    model_dir = checkpoint(tmp_path / "model", smollm2_dir)
    loaded(model_dir)  # recorded
    engine = LLMEngine(EngineConfig(model="sim", sim={"like": str(model_dir)}, kv_cache_bytes=1 << 28))
    assert engine.loaded._tokenizer_source is not None  # not loaded yet
    guide = engine._guides.new('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert guide is not None and engine.loaded._tokenizer_source is None
    assert tokenizer_facts(engine.tokenizer) == tokenizer_facts(loader.load_tokenizer(model_dir))


def test_a_recorded_sim_engine_serves_token_id_prompts_without_loading_its_tokenizer(tmp_path, cache, smollm2_dir):
    """What its workers send: a worker's first request must not pay for the tokenizer."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    model_dir = checkpoint(tmp_path / "model", smollm2_dir)
    loaded(model_dir)  # recorded
    engine = LLMEngine(EngineConfig(model="sim", sim={"like": str(model_dir)}, kv_cache_bytes=1 << 28))
    engine.add_request("ids", list(range(5, 40)), SamplingParams(max_tokens=3, ignore_eos=True), detokenize=False)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.loaded._tokenizer_source is not None  # still not loaded
