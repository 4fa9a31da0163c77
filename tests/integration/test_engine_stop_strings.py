"""Stop strings in the offline engine (`engine.LLM`): the text ends right before the first
stop string, the finish reason is "stop", generation ends there, and only that request."""

import pytest

from pdserve.engine import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [100, 200, 300, 400]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), max_model_len=256)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, **kwargs)


def test_a_stop_string_ends_its_request_before_the_string(llm):
    full = llm.generate(PROMPTS, greedy())
    assert [o.finish_reason for o in full] == ["length", "length"] and len(full[0].text) > 8
    stop = full[0].text[4:7]
    # only the first request has the stop string; the earliest of several stop strings wins
    stopped, other = llm.generate(PROMPTS, [greedy(stop=["never-generated-0", stop]), greedy()])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[0].text[: full[0].text.find(stop)] and stop not in stopped.text
    assert len(stopped.token_ids) < len(full[0].token_ids)
    assert stopped.token_ids == full[0].token_ids[: len(stopped.token_ids)]
    assert (other.finish_reason, other.text, other.token_ids) == \
        (full[1].finish_reason, full[1].text, full[1].token_ids)


def test_a_stop_string_never_generated_changes_nothing(llm):
    full = llm.generate(PROMPTS[:1], greedy())[0]
    out = llm.generate(PROMPTS[:1], greedy(stop=["never-generated-0"]))[0]
    assert (out.finish_reason, out.text, out.token_ids) == ("length", full.text, full.token_ids)
