"""The fused CPU kernels of a layer's token-wise ops compute what their torch references in
engine.model.fused compute, row by row: the same arithmetic in the same precision, so any
difference is a few roundings of the dtype (fp32 sums in another order, another expf)."""

import pytest
import torch

from pdserve.engine.model import fused

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_within_roundings(got, expected):
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got, expected, rtol=4 * eps, atol=eps)


def reference(monkeypatch, fn, *args):
    with monkeypatch.context() as m:
        m.setattr(fused, "cpu_kernels", lambda: None)
        return fn(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(cpu_kernels, monkeypatch, dtype, with_delta):
    gen = torch.Generator().manual_seed(0)
    hidden = (3 * torch.randn(37, 576, generator=gen)).to(dtype)
    delta = torch.randn(37, 576, generator=gen).to(dtype) if with_delta else None
    weight = torch.rand(576, generator=gen).to(dtype) + 0.5
    expected_hidden, expected = reference(monkeypatch, fused.add_rms_norm, hidden.clone(), delta, weight, 1e-5)
    got_hidden, got = fused.add_rms_norm(hidden, delta, weight, 1e-5)
    assert got_hidden.data_ptr() == hidden.data_ptr()  # updated in place
    torch.testing.assert_close(got_hidden, expected_hidden, rtol=0, atol=0)  # one add, one rounding
    assert_within_roundings(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(cpu_kernels, monkeypatch, dtype):
    gate_up = (4 * torch.randn(23, 2 * 1536, generator=torch.Generator().manual_seed(1))).to(dtype)
    assert_within_roundings(fused.silu_mul(gate_up), reference(monkeypatch, fused.silu_mul, gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_gives_a_feature_the_same_bits_wherever_it_sits_in_the_row(cpu_kernels, dtype):
    """The gated panel product runs silu_mul on 48 features at a time and must match it on a
    whole row: a pair (gate, up) gets the same bits at any column, in a row of any width."""
    gen = torch.Generator().manual_seed(3)
    gate, up = (4 * torch.randn(2, 1000, generator=gen)).to(dtype)
    whole = fused.silu_mul(torch.cat([gate, up])[None])[0]
    for offset, width in [(0, 1), (3, 20), (5, 37), (17, 64), (40, 999)]:
        row = torch.cat([gate[offset:offset + width], up[offset:offset + width]])[None]
        assert torch.equal(fused.silu_mul(row)[0], whole[offset:offset + width]), (offset, width)



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_on_the_fused_qkv_as_heads(cpu_kernels, monkeypatch, dtype, head_dim):
    """q and k rotated as the torch reference rotates them, and v the last kv heads of qkv as
    they are, without a copy."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, tokens = 9, 3, 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qkv = qkv.view(tokens, heads + 2 * kv_heads, head_dim)
    angles = torch.arange(100)[:, None] * torch.rand(head_dim // 2, generator=gen)[None]
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    q, k, v = fused.rope(qkv, positions, cos, sin, heads, kv_heads)
    expected_q, expected_k, expected_v = reference(monkeypatch, fused.rope, qkv, positions, cos, sin, heads, kv_heads)
    assert q.shape == (tokens, heads, head_dim) and k.shape == (tokens, kv_heads, head_dim)
    assert_within_roundings(q, expected_q)
    assert_within_roundings(k, expected_k)
    assert torch.equal(v, expected_v) and torch.equal(v, qkv[:, heads + kv_heads:])
    assert v.data_ptr() == qkv[:, heads + kv_heads:].data_ptr()  # a view, not a copy


def test_rope_refuses_a_position_past_the_table(cpu_kernels):
    qkv = torch.zeros(2, 4, 16)
    table = torch.zeros(8, 16)
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_kernels.rope(qkv, torch.tensor([0, 8]), table, table, 2, 1)


def test_rope_names_a_head_count_that_does_not_match_qkv(cpu_kernels):
    qkv = torch.zeros(2, 5, 16)
    table = torch.zeros(8, 16)
    with pytest.raises(RuntimeError, match="2 q heads and 2 k and v heads each, got 5"):
        cpu_kernels.rope(qkv, torch.tensor([0, 1]), table, table, 2, 2)


@pytest.mark.parametrize("width", [1, 15, 16, 17, 100, 49152])
def test_row_argmax_is_torchs_first_maximum(cpu_kernels, width):
    """row_argmax (the greedy sampler's pick) gives torch's max(dim=-1).indices: the first
    maximum on ties, the first NaN in a row holding one, and rows of -inf or +inf alike."""
    gen = torch.Generator().manual_seed(width)
    rows = torch.randn(12, width, generator=gen)
    rows[1] = rows[1].round()  # many ties at the maximum
    rows[2, width // 2:] = rows[2].max() + 1  # the maximum repeated from the middle on
    rows[3, width - 1] = float("nan")  # a NaN last
    rows[4, width // 3] = float("nan")
    rows[4, width - 1] = float("nan")  # two NaNs: the first counts
    rows[5] = float("-inf")
    rows[6, width // 2] = float("inf")
    rows[7] = float("inf")
    rows[8, ::2] = float("-inf")
    assert torch.equal(cpu_kernels.row_argmax(rows), rows.max(dim=-1).indices)


def test_row_argmax_refuses_what_it_does_not_take(cpu_kernels):
    with pytest.raises(RuntimeError, match="row_argmax takes contiguous fp32 rows"):
        cpu_kernels.row_argmax(torch.randn(2, 8).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="row_argmax takes contiguous fp32 rows"):
        cpu_kernels.row_argmax(torch.randn(8, 2).t())
