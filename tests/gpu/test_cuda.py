"""CUDA checks (marked `gpu`; the CI suite runs `-m "not gpu"`). Run on a GPU machine with
`pytest -m gpu tests/gpu`."""

import asyncio

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL pairs need two GPUs")


@needs_cuda
def test_engine_runs_bf16_on_cuda_and_is_batch_invariant(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), max_model_len=256)
    assert llm.engine.loaded.model.dtype == torch.bfloat16
    prompts = [[5 + i, 6, 7, 8] * (i + 1) for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert batched == alone
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@needs_cuda
def test_fp32_on_cuda_matches_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).cuda().eval()
    prompt = list(range(10, 60))
    want = hf.generate(torch.tensor([prompt]).cuda(), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    assert llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0].token_ids == want


@needs_two_gpus
def test_nccl_transport_between_two_gpus(tiny_llama_dir):
    from pdserve.testkit.workers import WorkerProcess, collect, decode_stub, generate_request

    model = str(tiny_llama_dir)
    prompt = list(range(100, 400))
    want = LLM(model, device="cuda:1").generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                                         ignore_eos=True))[0].token_ids
    with WorkerProcess("prefill", model, "--device", "cuda:0") as p, \
            WorkerProcess("decode", model, "--device", "cuda:1") as d:

        async def run():
            channel, stub = decode_stub(d.address)
            async with channel:
                return await collect(stub, generate_request("nccl", prompt, 8, [p.address], "torch"))

        tokens, finish, prefilled_by = asyncio.run(run())
    assert prefilled_by != "local" and tokens == want
