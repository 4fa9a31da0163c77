"""Tokenizer loading, prompt encoding and chat templates."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None (with a warning) if it ships none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no usable tokenizer in %s (%s): prompts must be token ids", model_dir, exc)
        return None


def encode_prompt(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    """Token ids for a text or token-id prompt; raises ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass the prompt as token ids")
        ids = tokenizer(prompt).input_ids
    elif isinstance(prompt, list | tuple):
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]!r}"
            )
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt must not be empty")
    return ids


def apply_chat_template(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation with the generation prompt appended."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a plain completion prompt")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
        ids = ids["input_ids"]
    return list(ids)
