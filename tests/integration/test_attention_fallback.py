"""The torch fallback of the CPU paged-decode-attention kernel (`PDSERVE_DISABLE_CPU_KERNEL=1`,
or no C++ compiler) gives the same greedy tokens as the C++ kernel, over a batch of
sequences of different lengths (padded block tables, several blocks each)."""

import os
import random

import pytest

from engine import LLM, SamplingParams
from engine.model import attention, kernels


def test_fallback_attention_gives_the_kernels_greedy_tokens(tiny_llama_dir, monkeypatch):
    if kernels.cpu_kernels() is None:
        pytest.skip("the C++ kernel cannot be built here: only the fallback exists to compare")
    used = []  # what each decode-attention call got: the kernel module, or None (the fallback)
    monkeypatch.setattr(attention, "cpu_kernels", lambda: used.append(kernels.cpu_kernels()) or used[-1])
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (5, 16, 17, 40, 100, 130)]
    # fp32: in bf16 the two round differently (bf16 keeps one kernel for every token instead)
    llm = LLM(str(tiny_llama_dir), max_model_len=512, enable_prefix_caching=False, dtype="float32")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    with_kernel = [o.token_ids for o in llm.generate(prompts, params)]
    assert used and all(k is not None for k in used)
    used.clear()
    os.environ["PDSERVE_DISABLE_CPU_KERNEL"] = "1"
    kernels.cpu_kernels.cache_clear()
    try:
        fallback = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        del os.environ["PDSERVE_DISABLE_CPU_KERNEL"]
        kernels.cpu_kernels.cache_clear()
    assert used and all(k is None for k in used)
    assert fallback == with_kernel
