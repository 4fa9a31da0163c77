"""A request resumed from the tokens already generated (what the router does when a decode
worker fails mid-stream) continues with exactly the tokens of the unbroken run: its prompt
ends with those tokens and `first_position` continues the sampling positions."""

import dataclasses

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.protos.convert import sampling_from_proto, sampling_to_proto

PROMPT = list(range(11, 51))


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "top_k": 50, "seed": 77}],
                         ids=["greedy", "seeded-sampled"])
def test_a_resumed_request_continues_the_unbroken_run(tiny_llama_dir, sampling):
    llm = LLM(str(tiny_llama_dir))
    params = SamplingParams(max_tokens=40, ignore_eos=True, **sampling)
    [whole] = llm.generate([PROMPT], params)
    unbroken = whole.outputs[0].token_ids
    for done in (1, 17, 39):
        resumed_params = dataclasses.replace(params, max_tokens=40 - done, first_position=done)
        [tail] = llm.generate([PROMPT + unbroken[:done]], sampling_from_proto(sampling_to_proto(resumed_params)))
        assert unbroken[:done] + tail.outputs[0].token_ids == unbroken, f"resumed after {done} tokens"
    if sampling.get("seed") is not None:  # without first_position the draws would restart at 0
        [restarted] = llm.generate([PROMPT + unbroken[:17]], dataclasses.replace(params, max_tokens=23))
        assert restarted.outputs[0].token_ids != unbroken[17:]


def test_first_position_is_validated():
    with pytest.raises(ValueError, match="first_position"):
        SamplingParams(first_position=-1)
