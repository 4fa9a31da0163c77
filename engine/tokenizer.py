"""Tokenizer loading, prompt encoding and chat templates."""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None (with a warning) if it ships none.

    The class that `tokenizer_config.json` names is loaded directly; AutoTokenizer is the
    fallback (tests/integration/test_tokenizer_loading.py checks the ids match AutoTokenizer's).
    The direct path matters to the router: transformers' auto classes import torch (~1 s,
    ~250 MB), a tokenizer class does not.
    Every process (router, workers, offline engine) loads through here, so all agree.
    """
    import transformers

    try:
        tokenizer_class = _named_tokenizer_class(model_dir) or transformers.AutoTokenizer
        return tokenizer_class.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("no usable tokenizer in %s (%s): prompts must be token ids", model_dir, exc)
        return None


def _named_tokenizer_class(model_dir: Path):
    import transformers

    try:
        name = json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None


def encode_prompt(tokenizer, prompt: str | list[int], vocab_size: int | None) -> list[int]:
    """Token ids for a text or token-id prompt; raises ValueError naming what is wrong."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass the prompt as token ids")
        return check_token_ids(tokenizer(prompt).input_ids, None)
    if isinstance(prompt, list | tuple):
        return check_token_ids(prompt, vocab_size)
    raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


def check_token_ids(ids, vocab_size: int | None) -> list[int]:
    """The prompt's token ids as a list; ValueError if it is empty or an id is not an integer
    in [0, vocab_size) (`vocab_size=None`: any non-negative integer)."""
    ids = list(ids)
    if not ids:
        raise ValueError("prompt must not be empty")
    high = vocab_size if vocab_size is not None else float("inf")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < high]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]!r}")
    return ids


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """ValueError unless a prompt of `num_tokens` leaves room for one generated token."""
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_tokens} tokens but max_model_len is {max_model_len}: "
                         f"the prompt must be at most {max_model_len - 1} tokens")


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation, with the assistant's generation prompt appended unless
    `add_generation_prompt` is false."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a plain completion prompt")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] must have string 'role' and 'content'")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
        ids = ids["input_ids"]
    return list(ids)
