"""OpenAI's logprob shapes from TokenLogprobs: -inf (a token top-k/top-p excluded) becomes
-9999.0 as in vLLM, since JSON has no infinity; completions text offsets continue across
stream chunks."""

import json
import math

from pdserve.engine.outputs import TokenLogprob
from pdserve.router.logprobs import chat_logprobs, completion_logprobs


class Letters:
    """Stands in for a tokenizer: token i decodes to the i-th letter, repeated i+1 times."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i) * (i + 1) for i in ids)


def test_minus_infinity_is_written_as_minus_9999():
    lp = TokenLogprob(1, -0.25, ((1, -0.25), (2, -math.inf)))
    chat = chat_logprobs(Letters(), [lp])
    assert chat["content"][0]["top_logprobs"][1]["logprob"] == -9999.0
    completion, _ = completion_logprobs(Letters(), [lp], 0)
    assert completion["top_logprobs"] == [{"bb": -0.25, "ccc": -9999.0}]
    json.dumps(chat, allow_nan=False)
    json.dumps(completion, allow_nan=False)


def test_text_offsets_continue_across_chunks():
    first, offset = completion_logprobs(Letters(), [TokenLogprob(0, -1.0), TokenLogprob(2, -2.0)], 0)
    second, end = completion_logprobs(Letters(), [TokenLogprob(1, -3.0)], offset)
    assert first["tokens"] == ["a", "ccc"] and first["text_offset"] == [0, 1]
    assert second["text_offset"] == [4] and end == 6


def test_chat_entries_carry_the_tokens_utf8_bytes():
    entry = chat_logprobs(Letters(), [TokenLogprob(3, -0.5)])["content"][0]
    assert entry == {"token": "dddd", "logprob": -0.5, "bytes": list(b"dddd"), "top_logprobs": []}
