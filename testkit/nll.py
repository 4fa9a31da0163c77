"""Per-token negative log-likelihood of a text under pdserve's own forward (teacher forcing).

The whole text is run as one prefill over a paged KV cache in the engine's dtype; logits are
computed in fp32 in slices. Used by the bf16 quality gate (tests and benchmarks)."""

from __future__ import annotations

import torch

from pdserve.engine import LLM
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledChunk


def token_nll(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """NLL (nats) of token_ids[1:] given the tokens before each: `[len(token_ids) - 1]` fp32."""
    targets = torch.as_tensor(token_ids[1:])
    losses = []
    for rows, logits in _logits(llm, token_ids):
        wanted = targets[rows]  # the last position predicts nothing in the text
        logprobs = torch.log_softmax(logits[: len(wanted)], dim=-1)
        losses.append(-logprobs.gather(1, wanted[:, None])[:, 0])
    return torch.cat(losses)


def token_argmax(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """The greedy choice after each prefix of token_ids: `[len(token_ids)]` int64."""
    return torch.cat([logits.argmax(dim=-1) for _, logits in _logits(llm, token_ids)])


def _logits(llm: LLM, token_ids: list[int], logits_rows: int = 256):
    """Yield (rows, fp32 logits of those positions) over the whole text, one slice at a time.
    The text is written into the idle engine's KV blocks 0.. directly (no request is made)."""
    engine = llm.engine
    block_size = engine.config.block_size
    num_blocks = -(-len(token_ids) // block_size)
    if num_blocks > engine.block_manager.num_free_blocks:
        raise ValueError(f"{len(token_ids)} tokens need {num_blocks} free KV blocks")
    chunk = ScheduledChunk("nll", list(token_ids), 0, list(range(num_blocks)), sample=False,
                           output_index=0, seed=0, sampling_params=SamplingParams())
    model = engine.loaded.model
    hidden = engine.runner.forward([chunk])
    for start in range(0, len(token_ids), logits_rows):
        rows = slice(start, min(start + logits_rows, len(token_ids)))
        yield rows, model.compute_logits(hidden[rows])
