"""The shared engine: model forward over a paged KV cache, continuous batching, sampling.

    from pdserve.engine import LLM, SamplingParams
    llm = LLM()  # embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].text)

Exports load lazily, so the torch-free parts (scheduler, block manager) import without torch.
"""

import importlib

_EXPORTS = {
    "DEFAULT_MODEL": "pdserve.engine.config",
    "EngineConfig": "pdserve.engine.config",
    "LLM": "pdserve.engine.llm",
    "LLMEngine": "pdserve.engine.llm_engine",
    "CompletionOutput": "pdserve.engine.outputs",
    "RequestOutput": "pdserve.engine.outputs",
    "SamplingParams": "pdserve.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
