"""The torch fallback of the CPU paged-decode-attention kernel (`PDSERVE_DISABLE_CPU_KERNEL=1`,
or no working C++ compiler) gives the same greedy tokens as the C++ kernel, over a batch of
sequences of different lengths (padded block tables, several blocks each). Both tests need
the kernel to compare with: where it does not build, they fail (`cpu_kernels` fixture)."""

import json
import os
import random
import subprocess
import sys

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model import attention, kernels


def test_fallback_attention_gives_the_kernels_greedy_tokens(tiny_llama_dir, monkeypatch, cpu_kernels):
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
    try:  # a model loaded without the kernels: its linear layers are oneDNN's (the same bits) too
        without = LLM(str(tiny_llama_dir), max_model_len=512, enable_prefix_caching=False, dtype="float32")
        fallback = [o.token_ids for o in without.generate(prompts, params)]
    finally:
        del os.environ["PDSERVE_DISABLE_CPU_KERNEL"]
        kernels.cpu_kernels.cache_clear()
    assert used and all(k is None for k in used)
    assert fallback == with_kernel


GENERATE = """
import json, sys
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model import kernels
llm = LLM(sys.argv[1], max_model_len=256, enable_prefix_caching=False, dtype="float32")
out = llm.generate([[5, 6, 7, 8, 9] * 8], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
print(json.dumps({"kernels": kernels.cpu_kernels() is not None, "tokens": out[0].token_ids}))
"""


def test_without_a_working_compiler_the_engine_serves_on_the_fallback(tiny_llama_dir, tmp_path, cpu_kernels):
    """A user's machine whose compiler fails: the build fails (logged), the engine runs on
    the torch path, and its greedy tokens are the kernel's."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_llama_dir), max_model_len=256, enable_prefix_caching=False, dtype="float32").generate(
        [[5, 6, 7, 8, 9] * 8], params)[0].token_ids
    env = {**os.environ, "CXX": "/bin/false", "PDSERVE_CACHE": str(tmp_path)}  # a fresh cache: it must build
    env.pop("PDSERVE_DISABLE_CPU_KERNEL", None)
    ran = subprocess.run([sys.executable, "-c", GENERATE, str(tiny_llama_dir)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    assert report["kernels"] is False and "CPU kernels unavailable" in ran.stderr
    assert report["tokens"] == want
