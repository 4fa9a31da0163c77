"""bf16's quality gate on the real SmolLM2-135M, against fp32 and against Hugging Face in bf16.

The text is tests/data/english.txt (~2,200 tokens of plain English prose written for this
test). Both measures are teacher-forced over the whole text, so they do not hinge on one
early near-tie the way a greedy continuation does."""

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM
from pdserve.testkit.nll import token_argmax, token_nll

TEXT = (Path(__file__).parent.parent / "data" / "english.txt").read_text()
MAX_LEN = 4096

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engines(smollm2_dir):
    return {dtype: LLM(str(smollm2_dir), dtype=dtype, max_model_len=MAX_LEN)
            for dtype in ("float32", "bfloat16")}


@pytest.fixture(scope="module")
def text_ids(engines) -> list[int]:
    ids = engines["float32"].engine.tokenizer.encode(TEXT)
    assert len(ids) > 2000
    return ids


def test_bf16_mean_nll_is_within_1_percent_of_fp32(engines, text_ids):
    nll = {dtype: token_nll(llm, text_ids) for dtype, llm in engines.items()}
    fp32, bf16 = nll["float32"].mean().item(), nll["bfloat16"].mean().item()
    print(f"mean NLL over {len(text_ids) - 1} tokens: fp32 {fp32:.5f}, bf16 {bf16:.5f} "
          f"({100 * (bf16 / fp32 - 1):+.3f}%)")
    assert abs(bf16 / fp32 - 1) <= 0.01
    # the two runs really computed in different precisions
    assert not torch.equal(nll["float32"], nll["bfloat16"])


def test_bf16_agrees_with_hf_bf16_at_least_as_well_as_hf_bf16_agrees_with_hf_fp32(
        smollm2_dir, engines, text_ids):
    """Greedy (top-1) choices at every position of the text. Two bf16 implementations round
    differently, so exact agreement is not expected; the yardstick is how far bf16 rounding
    moves Hugging Face itself: our bf16 must agree with HF bf16 at least that well."""
    from transformers import AutoModelForCausalLM

    hf = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=dtype).eval()
        with torch.inference_mode():
            hf[dtype] = model(torch.tensor([text_ids])).logits[0].float().argmax(-1)
    ours = token_argmax(engines["bfloat16"], text_ids)

    def agreement(a, b):
        return (a == b).float().mean().item()

    ours_vs_hf_bf16 = agreement(ours, hf[torch.bfloat16])
    hf_bf16_vs_hf_fp32 = agreement(hf[torch.bfloat16], hf[torch.float32])
    print(f"top-1 agreement over {len(text_ids)} positions: pdserve bf16 vs HF bf16 "
          f"{ours_vs_hf_bf16:.4f}; HF bf16 vs HF fp32 {hf_bf16_vs_hf_fp32:.4f}")
    assert ours_vs_hf_bf16 >= hf_bf16_vs_hf_fp32
    # and fp32 stays exactly HF fp32 on this text
    assert torch.equal(token_argmax(engines["float32"], text_ids), hf[torch.float32])
