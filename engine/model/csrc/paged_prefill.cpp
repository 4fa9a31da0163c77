// Prefill attention over a paged KV cache, for the CPU: the tokens of one sequence's chunk,
// query i at position start_pos + i attending to the positions up to its own, all cached
// already (the chunk's K/V is written before attention runs).
//
// Token identity. Every query's output is computed by exactly the arithmetic the decode
// kernel (paged_attention.cpp, AVX-512 path) applies to a sequence of that context length:
// the same scores (score16), the same two-pass softmax over the row, the same accumulation
// of probabilities times V token by token in position order (in bf16: the same pairs of
// tokens per vdpbf16ps, a block's odd last token against a zero row). So a token's output is
// the same bits whether it is prefilled in any chunking or decoded, alone or batched.
//
// What changes is the order of the loops around that arithmetic: queries are taken in tiles
// of consecutive tokens, and each tile walks the sequence's K and V blocks once, every block
// scored (or weighed) for all the tile's queries while it is in L1, where the decode kernel
// reads the whole prefix again for every query. V rows (fp32 path) or their bf16 pairs are
// prepared once per block and kv head for the tile. A query's accumulators live in memory
// between blocks (fp32 values, so loading and storing them changes nothing). Tiles are
// handed to threads in a balanced order (first, last, second, second-to-last, ...): later
// tiles attend to longer prefixes, and contiguous ranges of tiles would give the last
// thread most of the work.
#include "attention_common.h"

#include <ATen/ops/arange.h>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor ctx_lens, double scale);

namespace {

using namespace pdserve_attention;

// The k-th tile to run of `num_tiles`, in the balanced order: 0, n-1, 1, n-2, ...
inline int64_t balanced_tile(int64_t k, int64_t num_tiles) { return k % 2 == 0 ? k / 2 : num_tiles - 1 - k / 2; }

#if defined(__AVX512F__)
namespace fast {

using namespace pdserve_attention::simd;

#if defined(__AVX512BF16__)
// One V block of one kv head weighed into the accumulators (`acc`, [query][head][D] fp32) of
// every query of a tile that attends to it, pair by pair as the decode kernel's
// weigh_values_bf16 does: tokens (t, t+1) of the block per vdpbf16ps, a query's odd last
// token of the block against a zero row. Query i's context is `ctx0 + i`; the block starts
// at position `first`, and the tile's last query attends to `block_tokens` of its tokens.
// The pairs are made once per block for all the tile's queries (`full`, and `single` for
// the odd counts some query ends on).
template <int64_t D>
inline void weigh_block_bf16(const c10::BFloat16* value, int64_t token_stride, int64_t block_size,
                             int64_t block_tokens, int64_t first, int64_t ctx0, int64_t nq, int64_t num_heads,
                             int64_t h0, int64_t group, const uint16_t* probs16, int64_t p_stride, float* acc,
                             std::vector<uint16_t>& full, std::vector<uint16_t>& single) {
  constexpr int64_t C = D / 16, V = 32;  // vectors of pairs per token pair; bf16 lanes per vector
  const int64_t npairs = (block_tokens + 1) / 2;
  full.resize(npairs * C * V);
  single.resize(npairs * C * V);
  auto keep = [](const __m512bh (&pairs)[C], uint16_t* to) {
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_si512(to + c * V, (__m512i)pairs[c]);
  };
  const int64_t lowest = std::max<int64_t>(1, std::min(block_size, ctx0 - first));  // the fewest tokens a query uses
  for (int64_t p = 0; p < npairs; ++p) {
    const int64_t t = 2 * p;
    const c10::BFloat16* row = value + t * token_stride;
    __m512bh pairs[C];
    if (t + 1 < block_tokens) {
      pair_rows<D>(row, row + token_stride, pairs);
      keep(pairs, &full[p * C * V]);
    }
    if (t + 1 >= lowest) {
      pair_rows<D>(row, nullptr, pairs);
      keep(pairs, &single[p * C * V]);
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t ctx = ctx0 + i;
    if (ctx <= first) continue;
    const int64_t count = std::min(block_size, ctx - first);
    for (int64_t j = 0; j < group; ++j) {
      const int64_t h = h0 + j;
      const uint16_t* probs = probs16 + (i * num_heads + h) * p_stride + first;
      float* a = acc + (i * num_heads + h) * D;
      __m512 sum[C];
      for (int64_t c = 0; c < C; ++c) sum[c] = _mm512_loadu_ps(a + 16 * c);
      for (int64_t t = 0; t < count; t += 2) {
        const bool alone = t + 1 == count;
        const uint16_t* pairs = &(alone ? single : full)[t / 2 * C * V];
        const __m512bh w = pair_weights(probs + t, alone);
        for (int64_t c = 0; c < C; ++c)
          sum[c] = _mm512_dpbf16_ps(sum[c], w, (__m512bh)_mm512_loadu_si512(pairs + c * V));
      }
      for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(a + 16 * c, sum[c]);
    }
  }
}
#endif

template <typename T, int64_t D>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, int64_t start_pos, double scale, int64_t tile_size,
                       at::Tensor& out) {
  constexpr int64_t C = D / 16;  // vectors per head row
  const int64_t n = q.size(0), num_heads = q.size(1), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride;
  const T *q_ptr = q.data_ptr<T>(), *k_ptr = k_cache.data_ptr<T>(), *v_ptr = v_cache.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  using DotT = typename DotFor<T, D>::type;
#if defined(__AVX512BF16__)
  constexpr bool kPairedValues = std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
#else
  constexpr bool kPairedValues = false;
#endif
  const int64_t num_tiles = (n + tile_size - 1) / tile_size;

  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, inv_sums(1);
    std::vector<uint16_t> probs16;
    std::vector<float> rows(block_size * D);  // a block's V rows for one kv head, in fp32 (fp32 path)
    std::vector<uint16_t> full, single;  // a block's bf16 pairs (weigh_block_bf16)
    for (int64_t k = begin; k < end; ++k) {
      const int64_t q0 = balanced_tile(k, num_tiles) * tile_size, nq = std::min(tile_size, n - q0);
      const int64_t ctx_max = start_pos + q0 + nq;  // the tile's last query's context
      const int64_t num_blocks = (ctx_max + block_size - 1) / block_size;
      auto ctx_of = [&](int64_t i) { return start_pos + q0 + i + 1; };
      scores.resize(nq * num_heads * ctx_max);  // row (i, h) at (i * H + h) * ctx_max
      for (int64_t blk = 0; blk < num_blocks; ++blk) {  // scores
        const int64_t first = blk * block_size;
        const T* block = k_ptr + table[blk] * block_stride;
        if (blk + 1 < num_blocks) prefetch_row(k_ptr + table[blk + 1] * block_stride, block_stride);
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t ctx = ctx_of(i);
          if (ctx <= first) continue;
          const int64_t count = std::min(block_size, ctx - first);
          for (int64_t h = 0; h < num_heads; ++h) {
            const DotT dot(q_ptr + ((q0 + i) * num_heads + h) * D);
            const T* key = block + (h / group) * D;
            float* row = scores.data() + (i * num_heads + h) * ctx_max + first;
            for (int64_t i0 = 0; i0 < count; i0 += 16)
              score16(dot, key + i0 * token_stride, token_stride, std::min<int64_t>(16, count - i0), fscale, row + i0);
          }
        }
      }
      const int64_t p_stride = ctx_max + 1;  // bf16 probability rows, one spare entry each
      if constexpr (kPairedValues) probs16.resize(nq * num_heads * p_stride);
      for (int64_t i = 0; i < nq; ++i) {  // softmax, each row as the decode kernel takes it
        for (int64_t h = 0; h < num_heads; ++h) {
          float* row = scores.data() + (i * num_heads + h) * ctx_max;
#if defined(__AVX512BF16__)
          if constexpr (kPairedValues) {
            exp_rows(row, 1, ctx_of(i), inv_sums.data());
            round_row_to_bf16(row, inv_sums[0], ctx_of(i), probs16.data() + (i * num_heads + h) * p_stride);
            continue;
          }
#endif
          softmax_rows(row, 1, ctx_of(i), inv_sums);
        }
      }
      acc.assign(nq * num_heads * D, 0.f);
      for (int64_t blk = 0; blk < num_blocks; ++blk) {  // probabilities times V
        const int64_t first = blk * block_size, block_tokens = std::min(block_size, ctx_max - first);
        if (blk + 1 < num_blocks) prefetch_row(v_ptr + table[blk + 1] * block_stride, block_stride);
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
          const T* value = v_ptr + table[blk] * block_stride + kv_head * D;
#if defined(__AVX512BF16__)
          if constexpr (kPairedValues) {
            weigh_block_bf16<D>(value, token_stride, block_size, block_tokens, first, ctx_of(0), nq, num_heads,
                                kv_head * group, group, probs16.data(), p_stride, acc.data(), full, single);
            continue;
          }
#endif
          for (int64_t t = 0; t < block_tokens; ++t)
            for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(&rows[t * D + 16 * c], load16(value + t * token_stride + 16 * c));
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t ctx = ctx_of(i);
            if (ctx <= first) continue;
            const int64_t count = std::min(block_size, ctx - first);
            for (int64_t j = 0; j < group; ++j) {
              const int64_t h = kv_head * group + j;
              const float* probs = scores.data() + (i * num_heads + h) * ctx_max + first;
              float* a = acc.data() + (i * num_heads + h) * D;
              __m512 sum[C];
              for (int64_t c = 0; c < C; ++c) sum[c] = _mm512_loadu_ps(a + 16 * c);
              for (int64_t t = 0; t < count; ++t) {
                const __m512 p = _mm512_set1_ps(probs[t]);
                for (int64_t c = 0; c < C; ++c) sum[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(&rows[t * D + 16 * c]), sum[c]);
              }
              for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(a + 16 * c, sum[c]);
            }
          }
        }
      }
      for (int64_t i = 0; i < nq * num_heads; ++i) {
        const float* a = acc.data() + i * D;
        T* o = out_ptr + (q0 * num_heads + i) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(a[d]);
      }
    }
  });
}

}  // namespace fast
#endif  // __AVX512F__

}  // namespace

at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                   int64_t start_pos, double scale, int64_t tile_size) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [tokens, H, D] and k/v cache [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kLong, "block_table must be 1-D int64");
  TORCH_CHECK(start_pos >= 0 && tile_size >= 1, "start_pos must be >= 0 and tile_size >= 1");
  const int64_t n = q.size(0), block_size = k_cache.size(1);
  TORCH_CHECK(block_table.size(0) * block_size >= start_pos + n, "block_table does not cover the chunk");
  auto table = block_table.contiguous();
  auto out = at::empty_like(q);
  bool done = false;
#if defined(__AVX512F__)
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      done = true;
      switch (q.size(2)) {
        case 16: fast::prefill_attention<scalar_t, 16>(q, k_cache, v_cache, table, start_pos, scale, tile_size, out); break;
        case 32: fast::prefill_attention<scalar_t, 32>(q, k_cache, v_cache, table, start_pos, scale, tile_size, out); break;
        case 64: fast::prefill_attention<scalar_t, 64>(q, k_cache, v_cache, table, start_pos, scale, tile_size, out); break;
        case 128: fast::prefill_attention<scalar_t, 128>(q, k_cache, v_cache, table, start_pos, scale, tile_size, out); break;
        default: done = false;
      }
    }
  });
#endif
  if (done) return out;
  // no tiled kernel for this build or head size: every token as a decode of its own prefix
  auto tables = table.unsqueeze(0).expand({n, table.size(0)}).contiguous();
  auto ctx_lens = at::arange(start_pos + 1, start_pos + n + 1, table.options());
  return paged_decode_attention(q, k_cache, v_cache, tables, ctx_lens, scale);
}
