"""Sampling is a function of (seed, position, logits) only."""

import math

import torch

from pdserve.engine.sampler import sample
from pdserve.engine.sampling_params import SamplingParams


def logits_batch(rows=6, vocab=500, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = logits_batch()
    params = [SamplingParams(temperature=0)] * 6
    assert sample(logits, params, [0] * 6, [0] * 6) == logits.argmax(-1).tolist()


def test_token_depends_only_on_seed_position_logits():
    logits = logits_batch()
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50)] * 6
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 3, 5, 0, 9, 2]
    batched = sample(logits, params, seeds, positions)
    alone = [sample(logits[i : i + 1], params[:1], [seeds[i]], [positions[i]])[0] for i in range(6)]
    assert batched == alone
    mixed = [SamplingParams(temperature=0)] + params[1:]  # a greedy neighbour changes nothing
    assert sample(logits, mixed, seeds, positions)[1:] == batched[1:]
    reordered = sample(logits.flip(0), params, seeds[::-1], positions[::-1])
    assert reordered[::-1] == batched


def test_different_positions_and_seeds_give_different_draws():
    logits = torch.zeros(1, 1000)  # uniform
    p = [SamplingParams(temperature=1.0)]
    draws = {sample(logits, p, [1], [i])[0] for i in range(50)}
    assert len(draws) > 40
    assert {sample(logits, p, [s], [0])[0] for s in range(50)} != {sample(logits, p, [1], [0])[0]}


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = logits_batch()
    for params in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        got = sample(logits, [params] * 6, list(range(6)), [0] * 6)
        assert got == logits.argmax(-1).tolist()


def test_top_k_restricts_the_support():
    logits = logits_batch(rows=1, vocab=100)
    allowed = set(logits[0].topk(5).indices.tolist())
    draws = {sample(logits, [SamplingParams(top_k=5, temperature=2.0)], [s], [0])[0] for s in range(200)}
    assert draws <= allowed and len(draws) > 1


def test_frequencies_follow_the_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    probs = torch.softmax(logits[0], -1).tolist()
    n = 4000
    counts = [0] * 4
    for s in range(n):
        counts[sample(logits, [SamplingParams()], [s], [0])[0]] += 1
    for c, p in zip(counts, probs, strict=True):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)  # 4 sigma


def test_greedy_picks_the_first_maximum_through_the_kernel_and_without_it(cpu_kernels, monkeypatch):
    """The greedy pick is logits.max(dim=-1).indices whether the CPU kernels' row_argmax runs
    it (contiguous fp32 rows) or torch does (a strided view, or no kernels)."""
    import pdserve.engine.sampler as sampler

    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)).round()  # ties
    logits[2, 7] = float("nan")
    expected = logits.max(dim=-1).indices
    assert torch.equal(sampler.first_max_indices(logits), expected)
    assert torch.equal(sampler.first_max_indices(logits.t().contiguous().t()), expected)
    calls = []
    monkeypatch.setattr(cpu_kernels, "row_argmax", lambda x: calls.append(x) or x.max(dim=-1).indices)
    sampler.first_max_indices(logits)
    assert len(calls) == 1  # contiguous fp32 rows go to the kernel
    monkeypatch.setattr(sampler, "cpu_kernels", lambda: None)
    assert torch.equal(sampler.first_max_indices(logits), expected)
