"""Attention over the paged KV cache.

A step's tokens arrive concatenated (`[num_tokens, heads, head_dim]`, selective batching).
Sequences contributing one token (decodes, and one-token chunks) are attended together in
one batched call; sequences contributing a chunk of several tokens are attended one by one
with a causal mask offset by the tokens already cached.

Cache layout per layer: `k_cache`, `v_cache` of shape `[num_blocks, block_size, kv_heads,
head_dim]`; a token at position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

In bf16 (and fp16) on the CPU every query token, decode or prefill, is attended by the
paged kernels (the prefill kernel gives each token the decode kernel's bits), so a token's
attention output is the same bits whether it was computed in a prefill, a chunk of one, or
a decode step (after preemption or migration). Two kernels summing in different orders
differ in the last bits; bf16's 8-bit mantissa turns that into flipped tokens (measured:
5-7 of 32 requests differed alone vs batched with SDPA for prefill). fp32 goes through the
kernels too where the prefill kernel is tiled (AVX-512 builds, head sizes 16/32/64/128;
faster than SDPA there: benchmarks/prefill_attention.py), else through SDPA, whose
differences stay near 1e-7 and which beats running every token as a decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.model.kernels import cpu_kernels

_ONE_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_TILED_HEAD_DIMS = (16, 32, 64, 128)
PREFILL_TILE = 32  # queries per tile of the prefill kernel (chosen with benchmarks/prefill_attention.py)


@dataclass
class PrefillSpan:
    """A sequence contributing `num_tokens > 1` tokens starting at position `start_pos`."""

    token_start: int
    num_tokens: int
    start_pos: int
    block_table: torch.Tensor  # [num_blocks_of_this_sequence] int64


@dataclass
class AttentionMetadata:
    """Where each new token's K/V is written, and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_token_index: torch.Tensor  # [num_decodes] int64, indices into the step's tokens
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_ctx_lens: torch.Tensor  # [num_decodes] int64, cached tokens incl. the new one
    prefills: list[PrefillSpan]

    @property
    def num_decodes(self) -> int:
        return self.decode_token_index.numel()


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the step's new K/V into the cache, then attend; returns `[num_tokens, heads, dim]`.
    A step of decodes alone on the CPU kernels does both in one call (`paged_decode_attention_write`:
    the same bits and caches, without two copies' dispatch per layer)."""
    decodes_only = meta.num_decodes == q.shape[0]
    if decodes_only and (kernel := _decode_kernel(q)) is not None:
        return kernel.paged_decode_attention_write(q, k, v, k_cache, v_cache, meta.slot_mapping,
                                                   meta.decode_block_tables, meta.decode_ctx_lens, scale)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    if decodes_only:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        idx = meta.decode_token_index
        out[idx] = _decode_attention(q[idx], k_cache, v_cache, meta, scale)
    kernel = _prefill_kernel(q)
    for span in meta.prefills:
        rows = slice(span.token_start, span.token_start + span.num_tokens)
        if kernel is not None:
            out[rows] = _prefill_through_kernel(kernel, q[rows], k_cache, v_cache, span, scale)
        else:
            out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, span, scale)
    return out


def _prefill_kernel(q: torch.Tensor):
    """The kernels' module when they attend this step's prefill chunks, else None (SDPA)."""
    if q.device.type != "cpu" or (kernel := cpu_kernels()) is None:
        return None
    if q.dtype in _ONE_KERNEL_DTYPES:
        return kernel
    tiled = q.dtype == torch.float32 and kernel.tiled_prefill and q.shape[-1] in _TILED_HEAD_DIMS
    return kernel if tiled else None


def _prefill_through_kernel(kernel, q, k_cache, v_cache, span: PrefillSpan, scale: float):
    """A chunk's tokens attended by the prefill kernel: in tiles of PREFILL_TILE queries over
    the sequence's blocks, each token the bits a decode of its own causal prefix gives it."""
    return kernel.paged_prefill_attention(q.contiguous(), k_cache, v_cache, span.block_table.contiguous(),
                                          span.start_pos, scale, PREFILL_TILE)


def _decode_kernel(q: torch.Tensor):
    """The kernels' module where they attend this step's decodes (on the CPU), else None."""
    return cpu_kernels() if q.device.type == "cpu" else None


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
    kernel = _decode_kernel(q)
    if kernel is not None:
        return kernel.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_ctx_lens, scale
        )
    num_seqs, max_blocks = meta.decode_block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_len = max_blocks * block_size
    keys = k_cache[meta.decode_block_tables].view(num_seqs, max_len, num_kv_heads, head_dim)
    values = v_cache[meta.decode_block_tables].view(num_seqs, max_len, num_kv_heads, head_dim)
    positions = torch.arange(max_len, device=q.device)
    mask = (positions[None, :] < meta.decode_ctx_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out[:, :, 0]


def _prefill_attention(q, k, v, k_cache, v_cache, span: PrefillSpan, scale: float):
    if span.start_pos == 0:  # nothing cached before this chunk: attend to the chunk itself
        keys, values, mask, causal = k, v, None, True
    else:
        ctx_len = span.start_pos + span.num_tokens
        head_shape = k_cache.shape[2:]
        keys = k_cache[span.block_table].view(-1, *head_shape)[:ctx_len]
        values = v_cache[span.block_table].view(-1, *head_shape)[:ctx_len]
        query_pos = torch.arange(span.start_pos, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= query_pos[:, None]
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)
