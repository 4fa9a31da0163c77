"""Token sampling that depends only on (seed, output position, logits).

Each request carries a seed. At output position i the sampler draws one Gumbel variate per
vocabulary entry from a generator seeded by a hash of (seed, i), and picks
argmax(logits / temperature + gumbel) over the tokens top-k/top-p leave: an exact sample
from the filtered softmax. No generator state is shared between requests, so a request's
tokens never depend on its batch, on chunking, on preemption, or on which worker samples.
(Gumbel-max rather than inverse-CDF: a last-bit change in the logits flips an argmax only
when two perturbed scores tie, while it moves a CDF lookup whenever the distribution is
flat.) The noise is drawn on the CPU so CPU and CUDA workers agree.

Requests may adjust their logits first (penalties, logit_bias, min_tokens: `engine.logits`),
and a request with a JSON schema then has every token its grammar forbids masked out
(`engine.guided`).
Log-probabilities, for requests that ask (`SamplingParams.logprobs`), are of the
distribution the token was drawn from: the (adjusted) log-softmax for greedy requests, and
after temperature, top-k and top-p for sampled ones (a token the filters exclude has
logprob -inf). They are computed from the same logits as the token, so they share its
batch invariance.
"""

from __future__ import annotations

import torch

from pdserve.engine.guided import Guide
from pdserve.engine.logits import adjust_logits
from pdserve.engine.model.kernels import cpu_kernels
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.request import TokenHistory
from pdserve.engine.sampling_params import SamplingParams

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
           positions: list[int], histories: list[TokenHistory | None] | None = None,
           guides: list[Guide | None] | None = None) -> list[int]:
    """Pick one token per row of `logits` `[rows, vocab]` (fp32). `histories[i]` is row i's
    request's tokens, needed (only) where its params adjust logits (`engine.logits`) or it
    has a guide `guides[i]` (`engine.guided`)."""
    return sample_with_logprobs(logits, params, seeds, positions, histories, guides)[0]


def sample_with_logprobs(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                         positions: list[int], histories: list[TokenHistory | None] | None = None,
                         guides: list[Guide | None] | None = None,
                         ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Tokens as `sample`, and for each row whose request asked for logprobs its
    `TokenLogprob` (None for the others; nothing is computed when no row asked)."""
    adjusted = [i for i, p in enumerate(params) if p.adjusts_logits]
    guided = [i for i, g in enumerate(guides or ()) if g is not None]
    needs_history = adjusted + guided
    if needs_history and (histories is None or any(histories[i] is None for i in needs_history)):
        raise ValueError("rows whose params adjust logits or that have a guide need their token histories")
    if needs_history:
        logits = logits.clone()
    for i in adjusted:
        logits[i] = adjust_logits(logits[i], params[i], histories[i])
    for i in guided:
        guides[i].sync(histories[i].generated())
        allowed = torch.from_numpy(guides[i].allowed(histories[i].eos_token_ids)).to(logits.device)
        logits[i].masked_fill_(~allowed, float("-inf"))
    tokens = first_max_indices(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    processed = None
    if rows:
        processed = _processed_logits(logits[rows], [params[i] for i in rows])
        noise = torch.stack([gumbel_noise(seeds[i], positions[i], logits.shape[-1]) for i in rows])
        tokens[rows] = (processed + noise.to(processed.device)).argmax(dim=-1)
    token_list = tokens.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asked:
        sampled_row = {row: n for n, row in enumerate(rows)}
        dist = torch.stack([processed[sampled_row[i]] if i in sampled_row else logits[i] for i in asked])
        found = token_logprobs(dist, [token_list[i] for i in asked], [params[i].logprobs for i in asked])
        for i, logprob in zip(asked, found, strict=True):
            logprobs[i] = logprob
    return token_list, logprobs


def first_max_indices(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the index of its first maximum (a NaN's, if it has one), as
    `logits.max(dim=-1).indices` gives it (faster than argmax on the CPU); by the CPU kernels'
    `row_argmax` where they run, faster again (benchmarks/README.md, "Decode's dispatch")."""
    kernels = cpu_kernels() if logits.device.type == "cpu" else None
    if kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous() \
            and logits.shape[1] > 0:
        return kernels.row_argmax(logits)
    return logits.max(dim=-1).indices


def token_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    """For each row of `logits` `[rows, vocab]`: the log-softmax value of `token_ids[row]`
    and the `ks[row]` most likely tokens' (the sampler's logprobs, and prompt scoring's)."""
    dist = torch.log_softmax(logits.float(), dim=-1)
    want = torch.as_tensor(token_ids, device=dist.device)
    chosen = dist.gather(1, want[:, None])[:, 0].tolist()
    k = max(ks)
    top_values, top_ids = dist.topk(k, dim=-1) if k else (dist[:, :0], dist[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprob(token, value, tuple(zip(top_ids[n][:ks[n]], top_values[n][:ks[n]], strict=True)))
            for n, (token, value) in enumerate(zip(token_ids, chosen, strict=True))]


def _processed_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The logits a sampled row draws from: divided by its temperature, then top-k/top-p."""
    vocab = logits.shape[-1]
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temps
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    return logits


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
