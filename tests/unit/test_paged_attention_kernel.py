"""The CPU paged-decode-attention kernel against an fp64 reference, and its batch invariance.

The kernel has an AVX-512 path for head sizes 16/32/64/128 (with vdpbf16ps for bf16 where
the CPU has avx512_bf16) and a portable one for other sizes; both are checked here over
GQA groups, partial blocks and block sizes that do not divide 16.
"""

import pytest
import torch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def make_case(dtype, head_dim, num_heads, num_kv_heads, block_size, ctx_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max((n + block_size - 1) // block_size for n in ctx_lens)
    num_blocks = len(ctx_lens) * max_blocks + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)  # blocks scattered through the cache
    tables = torch.zeros(len(ctx_lens), max_blocks, dtype=torch.int64)
    for b in range(len(ctx_lens)):
        tables[b] = order[b * max_blocks:(b + 1) * max_blocks]
    return q, k_cache, v_cache, tables, torch.tensor(ctx_lens, dtype=torch.int64)


def reference(q, k_cache, v_cache, tables, ctx_lens, scale):
    """fp64 attention of each sequence over its cached tokens, read through its table."""
    num_heads, group = q.shape[1], q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(ctx_lens.tolist()):
        slots = torch.tensor([int(tables[b, p // block_size]) * block_size + p % block_size for p in range(n)])
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].double(), keys) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    assert out.shape[1] == num_heads
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(9, 3, 16), (4, 4, 5), (14, 2, 32)])
def test_kernel_matches_fp64_reference(cpu_kernels, dtype, head_dim, num_heads, num_kv_heads, block_size):
    ctx_lens = [1, 15, 16, 17, 33, 300]
    case = make_case(dtype, head_dim, num_heads, num_kv_heads, block_size, ctx_lens)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(*case, scale)
    assert out.dtype == dtype
    expected = reference(*case, scale)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_a_sequences_output_is_the_same_bits_in_any_batch(cpu_kernels, dtype, head_dim):
    ctx_lens = [7, 300, 16, 45, 129]
    q, k_cache, v_cache, tables, lens = make_case(dtype, head_dim, 9, 3, 16, ctx_lens, seed=3)
    batched = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    for b in range(len(ctx_lens)):
        alone = cpu_kernels.paged_decode_attention(q[b:b + 1].contiguous(), k_cache, v_cache,
                                              tables[b:b + 1, :].contiguous(), lens[b:b + 1], 0.125)
        assert torch.equal(alone[0], batched[b])
    # and with a table padded wider (as a batch with longer sequences pads it)
    wide = torch.zeros(len(ctx_lens), tables.shape[1] + 4, dtype=torch.int64)
    wide[:, :tables.shape[1]] = tables
    assert torch.equal(cpu_kernels.paged_decode_attention(q, k_cache, v_cache, wide, lens, 0.125), batched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("ctx_lens", [[1500, 1, 3, 1], [1, 2, 1, 3, 900], [5, 1200, 7]])
def test_threads_sharing_out_very_uneven_contexts_change_no_bits(cpu_kernels, dtype, head_dim, ctx_lens):
    """The kernel cuts a batch among threads by cached tokens, not by count: one long context
    among short ones gets a thread to itself, and every sequence keeps the bits it has alone."""
    q, k_cache, v_cache, tables, lens = make_case(dtype, head_dim, 9, 3, 16, ctx_lens, seed=9)
    batched = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    for b in range(len(ctx_lens)):
        alone = cpu_kernels.paged_decode_attention(q[b:b + 1].contiguous(), k_cache, v_cache,
                                                   tables[b:b + 1].contiguous(), lens[b:b + 1], 0.125)
        assert torch.equal(alone[0], batched[b])
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert (batched.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_slots_past_the_context_are_never_read(cpu_kernels, dtype, block_size):
    """A block's slots past a sequence's last token hold whatever an earlier owner left (NaN
    here): the bf16 kernel weighs V rows two at a time, and an odd last token must be paired
    with zeros, not with the next slot."""
    ctx_lens = [1, 15, 17, 33]
    q, k_cache, v_cache, tables, lens = make_case(dtype, 64, 9, 3, block_size, ctx_lens, seed=5)
    expected = reference(q, k_cache, v_cache, tables, lens, 0.125)
    for b, n in enumerate(ctx_lens):
        last = int(tables[b, (n - 1) // block_size])
        k_cache[last, (n - 1) % block_size + 1:] = float("nan")
        v_cache[last, (n - 1) % block_size + 1:] = float("nan")
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


def decode_step_case(dtype, head_dim, ctx_lens, seed=11):
    """A decode step: each sequence's new token at position ctx_len - 1, its K/V rows to write
    (V a strided view of a wider row, as the model's qkv split gives it) and its slot."""
    q, k_cache, v_cache, tables, lens = make_case(dtype, head_dim, 9, 3, 16, ctx_lens, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(len(ctx_lens), 3, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(ctx_lens), 5, head_dim, generator=gen).to(dtype)[:, 1:4]
    slots = torch.tensor([int(tables[b, (n - 1) // 16]) * 16 + (n - 1) % 16 for b, n in enumerate(ctx_lens)])
    return q, k, v, k_cache, v_cache, slots, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [24, 64])
def test_decode_with_its_kv_write_equals_index_copy_then_attention(cpu_kernels, dtype, head_dim):
    """paged_decode_attention_write (the model's decode steps) writes each new K/V row into its
    slot and attends: the caches and the output bits of index_copy_ then paged_decode_attention."""
    q, k, v, k_cache, v_cache, slots, tables, lens = decode_step_case(dtype, head_dim, [1, 16, 17, 300])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.view(-1, 3, head_dim).index_copy_(0, slots, k)
    v_ref.view(-1, 3, head_dim).index_copy_(0, slots, v)
    expected = cpu_kernels.paged_decode_attention(q, k_ref, v_ref, tables, lens, 0.125)
    out = cpu_kernels.paged_decode_attention_write(q, k, v, k_cache, v_cache, slots, tables, lens, 0.125)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(out, expected)


def test_decode_with_its_kv_write_refuses_a_bad_slot_and_writes_nothing(cpu_kernels):
    q, k, v, k_cache, v_cache, slots, tables, lens = decode_step_case(torch.bfloat16, 64, [5, 40])
    before = k_cache.clone(), v_cache.clone()
    bad = slots.clone()
    bad[1] = k_cache.shape[0] * k_cache.shape[1]
    with pytest.raises(RuntimeError, match=f"slot {int(bad[1])} of sequence 1 is outside the cache"):
        cpu_kernels.paged_decode_attention_write(q, k, v, k_cache, v_cache, bad, tables, lens, 0.125)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    with pytest.raises(RuntimeError, match="k and v must be in the cache's dtype"):
        cpu_kernels.paged_decode_attention_write(q, k.float(), v, k_cache, v_cache, slots, tables, lens, 0.125)
    with pytest.raises(RuntimeError, match=r"k and v must be \[num_seqs, 3, 64\]"):
        cpu_kernels.paged_decode_attention_write(q, k[:, :2], v[:, :2], k_cache, v_cache, slots, tables, lens, 0.125)


def prefill_case(dtype, head_dim, num_heads, num_kv_heads, block_size, start_pos, num_tokens, seed=7):
    """One sequence's chunk: `num_tokens` queries at positions start_pos.., its blocks
    scattered through the cache; the slots past the chunk's last token hold NaN."""
    q, k_cache, v_cache, tables, _ = make_case(dtype, head_dim, num_heads, num_kv_heads, block_size,
                                               [start_pos + num_tokens], seed=seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    end = start_pos + num_tokens
    last = int(tables[0, (end - 1) // block_size])
    k_cache[last, (end - 1) % block_size + 1:] = float("nan")
    v_cache[last, (end - 1) % block_size + 1:] = float("nan")
    return q, k_cache, v_cache, tables[0].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "block_size"),
                         [(64, 9, 3, 16), (128, 4, 4, 5), (16, 14, 2, 32), (24, 4, 2, 16), (64, 36, 2, 16)])
@pytest.mark.parametrize(("start_pos", "num_tokens", "tile"), [(0, 70, 16), (37, 45, 8), (0, 1, 16), (100, 33, 1)])
def test_prefill_gives_each_token_the_bits_of_its_decode(cpu_kernels, dtype, head_dim, num_heads, num_kv_heads,
                                                         block_size, start_pos, num_tokens, tile):
    """paged_prefill_attention (tiles of queries over the chunk's blocks) against
    paged_decode_attention of every token over its own prefix: the same bits, whatever the
    tile size or where the chunk starts; and near the fp64 reference. (36 heads on 2 kv heads:
    a group of 18, more than the 16 heads one AMX B tile holds in the decode kernel's scores.) The model's scale, which
    is not a power of two for every head size (rounding a score to it then matters)."""
    q, k_cache, v_cache, table = prefill_case(dtype, head_dim, num_heads, num_kv_heads, block_size, start_pos,
                                              num_tokens)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table, start_pos, scale, tile)
    tables = table[None].expand(num_tokens, -1).contiguous()
    lens = torch.arange(start_pos + 1, start_pos + num_tokens + 1)
    decoded = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert torch.equal(out, decoded)
    expected = reference(q, k_cache, v_cache, tables, lens, scale)
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_rounds_each_score_as_the_decode_kernel_does(cpu_kernels, head_dim):
    """Scores near 2^14 after scaling (queries and keys all of one size, small differences
    between them), where one rounding more or less of a score (a multiply fused into the
    subtraction of the max) moves its exp by a bf16 step about half the time: the prefill
    kernel's outputs are still the decode kernel's bits. (At head size 128 the scale is not a
    power of two, and this fails if the prefill kernel fuses the multiply, which the test
    above does not see; at 64 the scale's multiply is exact.)"""
    q, k_cache, v_cache, table = prefill_case(torch.bfloat16, head_dim, 4, 2, 16, 20, 60)
    gen = torch.Generator().manual_seed(11)
    big = 2.0**14 / (head_dim**-0.5 * head_dim)  # each of the D products ~big: a scaled score ~2^14
    q = (big**0.5 + torch.rand(q.shape, generator=gen)).to(torch.bfloat16)
    finite = k_cache.isfinite()
    k_cache[finite] = (big**0.5 + torch.rand(int(finite.sum()), generator=gen)).to(torch.bfloat16)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table, 20, scale, 16)
    lens = torch.arange(21, 81)
    decoded = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, table[None].expand(60, -1).contiguous(), lens,
                                                 scale)
    assert torch.equal(out, decoded)


def test_prefill_refuses_a_table_that_does_not_cover_the_chunk(cpu_kernels):
    q, k_cache, v_cache, table = prefill_case(torch.float32, 64, 9, 3, 16, 0, 40)
    with pytest.raises(RuntimeError, match="block_table does not cover the chunk"):
        cpu_kernels.paged_prefill_attention(q, k_cache, v_cache, table[:2], 0, 0.125, 16)
