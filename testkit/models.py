"""Tiny random checkpoints built in tests and loaded through the real loader."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_model(target: Path, family: str, tokenizer_dir: Path | None, seed: int = 0,
                     **overrides) -> Path:
    """Save a 2-layer random Llama or Qwen2 (vocab of SmolLM2, so its tokenizer fits)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    common.update(overrides)
    config = (Qwen2Config if family == "qwen2" else LlamaConfig)(**common)
    config.architectures = ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random (not zero) biases, so the bias path is exercised
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(target)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, target / name)
    return target
