"""The second KV tier on CUDA (marked `gpu`): the pool is device memory, so the tier keeps
blocks in pinned host memory (engine.kv_host) in front of the node's store. A block evicted
from the pool comes back from host memory without reading the store; a restarted engine
reads the store into pinned rows; tokens equal a run without any cache, in bf16."""

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@needs_cuda
def test_an_evicted_block_comes_back_from_pinned_host_memory_and_a_restart_from_the_store(tiny_llama_dir, tmp_path):
    model = str(tiny_llama_dir)
    reference = LLM(model, max_model_len=8 * BLOCK, enable_prefix_caching=False)
    per_block = reference.engine.runner.kv_cache[:, :, 0].nbytes
    kwargs = dict(max_model_len=8 * BLOCK, kv_cache_bytes=8 * per_block, block_size=BLOCK,
                  kv_tier={"enabled": True, "directory": str(tmp_path)})
    prompt = list(range(1000, 1000 + 5 * BLOCK + 3))
    want = reference.generate([prompt], GREEDY)[0].token_ids

    llm = LLM(model, **kwargs)
    tier = llm.engine.kv_tier
    assert tier.host is not None and tier.host.pin and llm.engine.runner.kv_cache.is_cuda
    assert llm.generate([prompt], GREEDY)[0].token_ids == want
    llm.generate([list(range(3000, 3000 + 7 * BLOCK - 2))], GREEDY)  # fills the pool: evicts the prompt
    assert llm.engine.block_manager.cached_prefix(prompt) == []
    store_hits = tier.store.stats()["hits"]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.token_ids == want and again.num_cached_tokens == 5 * BLOCK
    assert tier.store.stats()["hits"] == store_hits and tier.host.stats()["host_hits"] >= 5  # host memory only
    assert tier.host.read_bandwidth() > 0
    tier.store.close()

    restarted = LLM(model, **kwargs)  # empty pool and host memory, the same store
    out = restarted.generate([prompt], GREEDY)[0]
    assert out.token_ids == want and out.num_cached_tokens == 5 * BLOCK
    stats = restarted.engine.kv_tier.store.stats()
    assert stats["hits"] == 5 and restarted.engine.kv_tier.host.stats()["host_blocks"] >= 5  # read, then kept
    restarted.engine.block_manager.check_integrity()
    restarted.engine.kv_tier.store.close()
