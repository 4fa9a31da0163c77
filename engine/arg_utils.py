"""Command-line flags for EngineConfig, derived from its fields (one source of truth)."""

from __future__ import annotations

import argparse
import dataclasses

from pdserve.engine.config import EngineConfig

_HELP = {
    "model": "model name, local HF checkpoint dir, .gguf file, or cached hub id "
             "(default: the embedded SmolLM2-135M-Instruct)",
    "device": "auto | cpu | cuda[:N] (auto: CUDA if present)",
    "dtype": "auto | float32 | bfloat16 | float16 (auto: bf16 on CUDA and on CPUs with native bf16 "
             "arithmetic, avx512_bf16 or amx_bf16; fp32 on other CPUs)",
    "block_size": "tokens per KV-cache block",
    "max_model_len": "longest prompt + output in tokens (default: the model's limit)",
    "max_num_seqs": "most sequences in one batch",
    "max_num_batched_tokens": "token budget of one step (chunked prefill splits longer prompts)",
    "kv_cache_bytes": ("KV cache budget in bytes (default: $PDSERVE_CPU_KV_CACHE_BYTES or 2 GiB on CPU, "
                       "a fraction of free GPU memory)"),
    "gpu_memory_utilization": "fraction of free GPU memory for the KV cache",
    "seed": "seed for requests that bring none",
    "enable_prefix_caching": "reuse the KV of cached full blocks of earlier prompts and replies",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        text = _HELP.get(field.name, "")
        if "(default:" not in text:  # a help text that explains its default keeps its own words
            text += " (default: %(default)s)"
        flag = "--" + field.name.replace("_", "-")
        if str(field.type) == "bool":  # --enable-prefix-caching / --no-enable-prefix-caching
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default, help=text)
            continue
        kind = {"int": int, "float": float, "str": str}.get(str(field.type).split(" ")[0], int)
        group.add_argument(flag, type=kind, default=field.default, help=text)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})
