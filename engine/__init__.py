"""The shared engine: model forward over a paged KV cache, continuous batching, sampling.

    from engine import LLM, SamplingParams
    llm = LLM()  # embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=16))[0].text)
"""

from engine.config import DEFAULT_MODEL, EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "DEFAULT_MODEL", "EngineConfig", "LLM", "LLMEngine", "CompletionOutput", "RequestOutput",
    "SamplingParams",
]
