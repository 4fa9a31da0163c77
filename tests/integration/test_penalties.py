"""Penalties, logit_bias and min_tokens in the engine, against a reference implementation of
their formulas over HF transformers' logits: the engine's greedy tokens are the argmax of
the adjusted logits and its logprobs their log-softmax (fp32, within 1e-4); a sampled
request's logprobs are those of the adjusted logits after temperature."""

import math

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=64 << 20)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def reference_logits(logits: torch.Tensor, prompt: list[int], generated: list[int], *, presence=0.0,
                     frequency=0.0, repetition=1.0, bias=None, min_tokens=0, stops=()) -> torch.Tensor:
    """The formulas as OpenAI, HF and vLLM document them, one token at a time."""
    out = logits.clone()
    if len(generated) < min_tokens:
        for t in stops:
            out[t] = -math.inf
    for t, b in (bias or {}).items():
        out[t] += b
    for t in set(prompt) | set(generated):
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(generated):
        out[t] -= frequency * generated.count(t) + presence
    return out


def _hf_rows(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


ADJUSTMENTS = {"presence": 0.5, "frequency": 1.0, "repetition": 1.3}


def test_greedy_tokens_and_logprobs_follow_the_penalty_formulas(engine, hf):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0, presence_penalty=0.5,
                            frequency_penalty=1.0, repetition_penalty=1.3, logit_bias={9: 2.5, 40: -50.0})
    [out] = engine.generate([PROMPT], params)
    rows = _hf_rows(hf, PROMPT + out.token_ids)
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert out.token_ids != plain, "the adjustments changed the output"
    for i, lp in enumerate(out.outputs[0].logprobs):
        adjusted = reference_logits(rows[len(PROMPT) - 1 + i], PROMPT, out.token_ids[:i], bias={9: 2.5, 40: -50.0},
                                    **ADJUSTMENTS)
        assert lp.token_id == int(adjusted.argmax()), i
        assert abs(torch.log_softmax(adjusted, -1)[lp.token_id].item() - lp.logprob) < 1e-4, i


def test_sampled_logprobs_are_after_penalties_and_temperature(engine, hf):
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=4, ignore_eos=True, logprobs=2,
                            presence_penalty=-0.5, frequency_penalty=0.7, repetition_penalty=0.9)
    [out] = engine.generate([PROMPT], params)
    rows = _hf_rows(hf, PROMPT + out.token_ids)
    for i, lp in enumerate(out.outputs[0].logprobs):
        adjusted = reference_logits(rows[len(PROMPT) - 1 + i], PROMPT, out.token_ids[:i], presence=-0.5,
                                    frequency=0.7, repetition=0.9)
        reference = torch.log_softmax(adjusted / 0.8, -1)
        assert abs(reference[lp.token_id].item() - lp.logprob) < 1e-4, i
        assert [t for t, _ in lp.top] == reference.topk(2).indices.tolist()


def test_min_tokens_holds_eos_back_exactly_that_long(engine):
    eos = min(engine.engine.loaded.eos_token_ids)
    pushed = SamplingParams(max_tokens=30, temperature=0, logit_bias={eos: 100.0})
    [now] = engine.generate([PROMPT], pushed)
    assert now.token_ids == [eos] and now.finish_reason == "stop", "the bias makes EOS the argmax"
    [held] = engine.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, logit_bias={eos: 100.0},
                                                      min_tokens=4))
    assert len(held.token_ids) == 5 and eos not in held.token_ids[:4] and held.token_ids[4] == eos
    assert held.finish_reason == "stop"
    [stop_id] = engine.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, logit_bias={9: 100.0},
                                                         stop_token_ids=(9,), min_tokens=3))
    assert stop_id.token_ids[3] == 9 and 9 not in stop_id.token_ids[:3] and len(stop_id.token_ids) == 4


@pytest.mark.parametrize(("fields", "message"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2]"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number in (0, 100]"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be an integer in [0, max_tokens=10]"),
    ({"logit_bias": {3: 101}}, "logit_bias values must be numbers in [-100, 100]"),
    ({"logit_bias": {"3": 1.0}}, "logit_bias must be keyed by non-negative token ids"),
])
def test_bad_adjustments_are_refused_naming_them(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**fields)


def test_a_bias_outside_the_vocabulary_is_refused_by_the_engine(engine):
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 49152\)"):
        engine.generate([PROMPT], SamplingParams(logit_bias={10**6: 1.0}))
