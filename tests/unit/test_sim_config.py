"""The simulated engine's settings and its token function, without an engine: `model: sim`
with the `sim` section reaches the workers' engines and gives the router the tokenizer of
`sim.like` under the name `sim`; the workers' flags follow from SimConfig; the default
profile is the committed one; the simulated logits depend on exactly the documented window."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pdserve.cluster.config import load_config
from pdserve.engine.arg_utils import add_engine_args, engine_config_from_args
from pdserve.engine.config import DEFAULT_MODEL, SIM_MODEL, EngineConfig, SimConfig
from pdserve.engine.sim import DEFAULT_PROFILE, PREFERRED_LOGITS, WINDOW, keyed_logits, token_keys

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t" * 32


def test_a_simulated_deployment_gives_every_engine_the_sim_section_and_the_router_its_tokenizer():
    config = load_config(None, {"model": SIM_MODEL, "sim": {"like": "/models/other", "speed": 4},
                                "cluster_token": TOKEN})
    for role in ("prefill", "decode"):
        engine = EngineConfig.from_kwargs(**config.engine_kwargs(role))
        assert engine.is_sim and engine.sim == SimConfig(like="/models/other", speed=4.0)
        assert engine.checkpoint == "/models/other"
    router = config.router_config()
    assert router.model == "/models/other" and router.served_model_name == SIM_MODEL
    assert config.simulated() == dataclasses.asdict(config.sim)
    assert load_config(None).simulated() is None and load_config(None).engine_kwargs("decode")["model"] == DEFAULT_MODEL


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": SIM_MODEL, "served_model_name": "gpt-4"}, "served_model_name: .*served as `sim`"),
    ({"sim.speed": 0}, "sim: .*sim.speed must be a finite number > 0"),
    ({"sim.like": SIM_MODEL}, "sim: .*sim.like must name a real model"),
    ({"sim.weights": True}, "sim.weights: Unexpected keyword argument"),
    ({"decode.engine": {"sim": {"speed": 2}}}, "decode.engine: .*set `sim` at the top level"),
])
def test_a_bad_sim_setting_is_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_the_workers_sim_flags_follow_from_simconfig():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", SIM_MODEL, "--sim-like", "/m", "--sim-profile", "p.json", "--sim-speed",
                              "2.5", "--no-sim-kv-bytes"])
    assert engine_config_from_args(args).sim == SimConfig(like="/m", profile="p.json", speed=2.5, kv_bytes=False)
    defaults = engine_config_from_args(parser.parse_args([]))
    assert defaults.sim == SimConfig() and not defaults.is_sim and defaults.checkpoint == DEFAULT_MODEL


def test_the_default_profile_is_the_committed_one():
    assert DEFAULT_PROFILE.read_bytes() == (ROOT / "benchmarks" / "results" / "profile_2cores.json").read_bytes()


def _keys(tokens: list[int], end: int) -> np.ndarray:
    """The key of the token at position `end - 1` of `tokens`, computed as a chunk of one token."""
    start = end - 1
    return token_keys(tokens[max(0, start - WINDOW + 1):start], tokens[start:end], start)


def test_a_key_depends_on_the_window_ending_at_its_position_and_on_nothing_before():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, 3 * WINDOW).tolist()
    end = 2 * WINDOW + 5
    earlier = list(tokens)
    earlier[end - WINDOW - 1] += 1  # just outside the window
    assert _keys(earlier, end) == _keys(tokens, end)
    inside = list(tokens)
    inside[end - WINDOW] += 1  # the window's first token
    assert _keys(inside, end) != _keys(tokens, end)
    shifted = [7, *tokens]  # the same window one position later
    assert _keys(shifted, end + 1) != _keys(tokens, end)


def test_keys_of_a_chunk_are_those_of_its_tokens_one_at_a_time():
    tokens = list(range(1000, 1000 + 3 * WINDOW))
    whole = token_keys(tokens[:WINDOW - 1], tokens[WINDOW - 1:], WINDOW - 1)
    assert whole.tolist() == [_keys(tokens, end)[0] for end in range(WINDOW, len(tokens) + 1)]


def test_the_logits_prefer_a_few_tokens_over_a_flat_rest():
    keys = token_keys([], list(range(50, 90)), 0)
    logits = keyed_logits(keys, 1000)
    assert logits.shape == (40, 1000)
    for row in logits:
        preferred = row[row != 0]
        assert 1 <= len(preferred) <= len(PREFERRED_LOGITS) and preferred.max() == max(PREFERRED_LOGITS)
    assert len({int(row.argmax()) for row in logits}) > 30, "the favourite token varies with the position"


def test_sim_is_no_checkpoint_and_says_what_to_load_instead():
    from pdserve.engine.model_source import resolve_model

    with pytest.raises(ValueError, match="simulated engine, not a checkpoint.*--served-model-name sim"):
        resolve_model(SIM_MODEL)
