"""Logit adjustments a request asks for (SamplingParams: `min_tokens`, `logit_bias`,
`repetition_penalty`, `frequency_penalty`, `presence_penalty`), in that order, before
temperature, top-k and top-p.

Each is a pure function of the logits and the request's own tokens, so sampling stays a
function of (seed, position, logits, the request's tokens so far): batch composition,
chunking, preemption and the worker that samples do not change a token. A request resumed
on another worker has the tokens generated before at the end of its prompt
(`SamplingParams.first_position` of them); they count as generated, as in the unbroken run.
"""

from __future__ import annotations

import torch

from pdserve.engine.request import TokenHistory
from pdserve.engine.sampling_params import SamplingParams


def adjust_logits(row: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """A copy of one request's logits `[vocab]` (fp32) with its adjustments applied."""
    row = row.clone()
    vocab = row.shape[0]
    generated = history.generated()
    if params.min_tokens and len(generated) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(history.eos_token_ids))
        banned = [t for t in stops if t < vocab]
        if banned:
            row[banned] = float("-inf")
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        row[list(ids)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(history.prompt_token_ids) | set(history.output_token_ids)),
                            dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(device=row.device, dtype=row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)
    return row
