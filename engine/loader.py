"""From an EngineConfig to a loaded model and a sized KV cache (shared by every worker kind)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdserve.engine.config import EngineConfig, default_cpu_kv_cache_bytes
from pdserve.engine.cpu import native_bf16_flags
from pdserve.engine.dtypes import TORCH_DTYPES, dtype_name
from pdserve.engine.model.llama import CausalLM, ModelShape
from pdserve.engine.model.weights import CheckpointReader
from pdserve.engine.model_source import check_architecture, resolve_model
from pdserve.engine.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pdserve.engine.sim import SimModel

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model_dir: Path
    hf_config: object
    model: CausalLM | SimModel  # SimModel: the simulated engine's shapes, no weights
    tokenizer: object | None
    max_model_len: int
    eos_token_ids: frozenset[int]

    @property
    def shape(self) -> ModelShape:
        return self.model.shape


def load_model(config: EngineConfig) -> LoadedModel:
    """The model `config` names with its tokenizer and limits; for the simulated engine
    (`config.is_sim`) the tokenizer and shapes of `sim.like` and no weights (engine.sim.SimModel)."""
    from transformers import AutoConfig

    model_dir = resolve_model(config.checkpoint)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    check_architecture(hf_config)
    device, dtype = resolve_device_dtype(config)
    max_model_len = resolve_max_model_len(config, hf_config)
    if config.is_sim:
        from pdserve.engine.sim import SimModel

        model = SimModel(ModelShape.from_hf_config(hf_config), dtype, device)
    else:
        model = _load_weights(model_dir, hf_config, dtype, device, max_model_len)
    tokenizer = load_tokenizer(model_dir)
    return LoadedModel(model_dir, hf_config, model, tokenizer, max_model_len,
                       _eos_token_ids(model_dir, hf_config, tokenizer))


def _load_weights(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device,
                  max_model_len: int) -> CausalLM:
    if device.type == "cpu":
        from pdserve.engine.model.kernels import cpu_kernels

        cpu_kernels()  # built (once) at load, so no request waits for the compiler
    return CausalLM(hf_config, CheckpointReader(model_dir, dtype, device), max_model_len)


def resolve_device_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """`auto` device: CUDA when a GPU is present (the simulated engine: always the CPU, which
    is all it needs), else CPU. `auto` dtype: see `auto_dtype`."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() and not config.is_sim else "cpu")
    else:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but no CUDA device is available")
    if config.dtype == "auto":
        dtype, why = auto_dtype(device)
        logger.info("dtype %s (auto: %s)", dtype_name(dtype), why)
    else:
        dtype = TORCH_DTYPES[config.dtype]
    return device, dtype


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """bf16 on CUDA and on CPUs with native bf16 arithmetic (AVX512-BF16 or AMX), fp32 on
    other CPUs, where bf16 is emulated and slower. Returns the dtype and why it was chosen."""
    if device.type == "cuda":
        return torch.bfloat16, "CUDA"
    flags = native_bf16_flags()
    if flags:
        return torch.bfloat16, f"this CPU has native bf16 ({', '.join(flags)})"
    return torch.float32, "this CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)"


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    limit = hf_config.max_position_embeddings
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        limit = min(limit, window)  # no sliding-window attention: stay inside the window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's limit of {limit} tokens"
        )
    return config.max_model_len


def kv_block_bytes(shape: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * shape.num_layers * block_size * shape.num_kv_heads * shape.head_dim * element


def num_kv_blocks(config: EngineConfig, loaded: LoadedModel) -> int:
    """How many blocks the KV budget holds; raises if one max-length request cannot fit."""
    model = loaded.model
    per_block = kv_block_bytes(model.shape, config.block_size, model.dtype)
    budget = config.kv_cache_bytes
    if budget is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            budget = int(free * config.gpu_memory_utilization)
        else:
            budget = default_cpu_kv_cache_bytes()
    num_blocks = budget // per_block
    needed = -(-loaded.max_model_len // config.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache too small: {budget} bytes hold {num_blocks} blocks of {config.block_size} "
            f"tokens, but one request of max_model_len={loaded.max_model_len} needs {needed} "
            f"blocks ({needed * per_block} bytes). Raise kv_cache_bytes or lower max_model_len."
        )
    return num_blocks


def _eos_token_ids(model_dir: Path, hf_config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    if tokenizer is not None:
        candidates.append(getattr(tokenizer, "eos_token_id", None))
    try:
        from transformers import GenerationConfig

        candidates.append(GenerationConfig.from_pretrained(str(model_dir)).eos_token_id)
    except OSError:
        pass
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
