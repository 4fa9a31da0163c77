"""Token sampling that depends only on (seed, output position, logits).

Each request carries a seed. At output position i the sampler draws one Gumbel variate per
vocabulary entry from a generator seeded by a hash of (seed, i), and picks
argmax(logits / temperature + gumbel) over the tokens top-k/top-p leave: an exact sample
from the filtered softmax. No generator state is shared between requests, so a request's
tokens never depend on its batch, on chunking, on preemption, or on which worker samples.
(Gumbel-max rather than inverse-CDF: a last-bit change in the logits flips an argmax only
when two perturbed scores tie, while it moves a CDF lookup whenever the distribution is
flat.) The noise is drawn on the CPU so CPU and CUDA workers agree.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed determined by (request seed, output position) alone."""
    return _splitmix64(_splitmix64(seed) ^ position) >> 1


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(position_seed(seed, position))
    uniform = torch.rand(vocab_size, generator=generator)
    return -torch.log(-torch.log(uniform))


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
           positions: list[int]) -> list[int]:
    """Pick one token per row of `logits` `[rows, vocab]` (fp32)."""
    tokens = logits.max(dim=-1).indices  # the first maximum, as argmax; ~2x faster on CPU
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        noise = torch.stack([gumbel_noise(seeds[i], positions[i], logits.shape[-1]) for i in rows])
        tokens[rows] = _sample_rows(logits[rows], [params[i] for i in rows], noise)
    return tokens.tolist()


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], noise: torch.Tensor):
    vocab = logits.shape[-1]
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temps
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    return (logits + noise.to(device)).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """Mask (to -inf) all but the top_k largest logits, then all but the smallest set of
    those whose probability mass reaches top_p. Ties at the threshold are kept."""
    sorted_logits = logits.sort(dim=-1, descending=True).values
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    num_keep = ((mass_before < top_p[:, None]) & (rank < top_k[:, None])).sum(dim=-1).clamp_(min=1)
    threshold = sorted_logits.gather(1, (num_keep - 1)[:, None])
    return logits.masked_fill(logits < threshold, float("-inf"))
