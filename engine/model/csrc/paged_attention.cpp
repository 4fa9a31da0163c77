// Decode attention over a paged KV cache, for the CPU.
//
// One query token per sequence attends to that sequence's first ctx_lens[b] cached tokens,
// read in place through its block table: no gathered copy of the KV is made. Work is split
// over (sequence, kv head); every query head of a GQA group shares one pass over the keys.
#include "attention_common.h"

namespace {

using namespace pdserve_attention;

// HEAD_DIM > 0 fixes the head size at compile time (fully unrolled inner loops); 0 reads it
// from the tensors.
template <typename T, int64_t HEAD_DIM>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& ctx_lens, double scale, at::Tensor& out) {
  const Operands<T> o(q, k_cache, v_cache, block_tables, ctx_lens, out);
  const int64_t num_seqs = o.num_seqs, num_heads = o.num_heads, head_dim = HEAD_DIM > 0 ? HEAD_DIM : o.head_dim;
  const int64_t block_size = o.block_size, group = o.group, max_blocks = o.max_blocks, token_stride = o.token_stride;
  const T *q_ptr = o.q, *k_ptr = o.k, *v_ptr = o.v;
  const int64_t *bt_ptr = o.tables, *len_ptr = o.lens;
  T* out_ptr = o.out;
  const float fscale = static_cast<float>(scale);

  // One work item per sequence: each cached token's K (and V) row, all kv heads together, is
  // one contiguous run of memory, so blocks stream through the cache in order.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv_sums, qf(num_heads * head_dim), acc(num_heads * head_dim), row(token_stride);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = len_ptr[b];
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      const int64_t* table = bt_ptr + b * max_blocks;
      scores.resize(num_heads * ctx);
      for (int64_t i = 0; i < num_heads * head_dim; ++i)
        qf[i] = to_float(q_ptr[b * num_heads * head_dim + i]) * fscale;
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
        const T* key = k_ptr + table[blk] * block_size * token_stride;
        const T* next_key = k_ptr + table[std::min(blk + 1, num_blocks - 1)] * block_size * token_stride;
        for (int64_t i = 0; i < count; ++i, key += token_stride) {
          prefetch_row(next_key + i * token_stride, token_stride);
          for (int64_t j = 0; j < token_stride; ++j) row[j] = to_float(key[j]);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float* qh = qf.data() + h * head_dim;
            const float* kh = row.data() + (h / group) * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
            scores[h * ctx + first + i] = dot;
          }
        }
      }
      softmax_rows(scores.data(), num_heads, ctx, inv_sums);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
        const T* value = v_ptr + table[blk] * block_size * token_stride;
        const T* next_value = v_ptr + table[std::min(blk + 1, num_blocks - 1)] * block_size * token_stride;
        for (int64_t i = 0; i < count; ++i, value += token_stride) {
          prefetch_row(next_value + i * token_stride, token_stride);
          for (int64_t j = 0; j < token_stride; ++j) row[j] = to_float(value[j]);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float p = scores[h * ctx + first + i];
            const float* vh = row.data() + (h / group) * head_dim;
            float* a = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
          }
        }
      }
      for (int64_t i = 0; i < num_heads * head_dim; ++i)
        out_ptr[b * num_heads * head_dim + i] = static_cast<T>(acc[i]);
    }
  });
}


#if defined(__AVX512F__)
// The AVX-512 kernel: the same contract as decode_attention_impl, restructured so that the
// step is bound by reading K/V rather than by arithmetic.
//  - Scores in bf16 with avx512_bf16: keys in lanes (score_group_bf16): each group of up to
//    16 cached tokens of a kv head is transposed once into bf16 pairs, and every score of
//    the group's query heads is one chain of vdpbf16ps with the query's pair broadcast, four
//    key groups at a time. Other dtypes: for each kv head and query head of its group, 16
//    cached tokens at a time, each token's q.k a vector of 16 partial sums reduced together
//    by one transpose-and-add tree (45 instructions for 16 dot products).
//  - Values: for each kv head, the output rows of (up to 256 / D) query heads stay in
//    registers while every cached token's V row is read once. In bf16 with avx512_bf16 the
//    exps are rounded to bf16 in one pass (exp_row_to_bf16), two tokens are weighed per
//    vdpbf16ps (weigh_values_bf16) instead of converting each V row to fp32, and the sum
//    is scaled by 1/sum at the end (mean NLL +0.015% vs fp32 on SmolLM2-135M).
// Each output's summation order depends only on its own sequence, never on the batch, so a
// token's attention is the same bits alone, batched, or as a prefill token.
namespace fast {

using namespace pdserve_attention::simd;

// sum over the cached tokens of p[h][t] * V[t] for NH query heads sharing one kv head
// (`values` points at that head's slice of block 0's first row; probabilities [NH][ctx]).
// With `prefetch`, block i of the next sequence's K (`next_k`, `next_table`, `next_blocks`)
// is fetched into L2 while block i of V is weighed.
template <typename T, int64_t D, int64_t NH, int64_t MAX_NH>
inline void weigh_values(const T* values, const int64_t* table, int64_t num_blocks, int64_t block_size,
                         int64_t block_stride, int64_t token_stride, int64_t ctx, const float* probs,
                         bool prefetch, const T* next_k, const int64_t* next_table, int64_t next_blocks,
                         __m512 (&out)[MAX_NH][D / 16]) {
  constexpr int64_t C = D / 16;
  __m512 acc[NH][C];
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
    const T* value = values + table[blk] * block_stride;
    if (prefetch && blk < next_blocks) prefetch_l2(next_k + next_table[blk] * block_stride, block_stride);
    for (int64_t i = 0; i < count; ++i, value += token_stride) {
      __m512 v[C];
      for (int64_t c = 0; c < C; ++c) v[c] = load16(value + 16 * c);
      for (int64_t j = 0; j < NH; ++j) {
        const __m512 p = _mm512_set1_ps(probs[j * ctx + first + i]);
        for (int64_t c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(p, v[c], acc[j][c]);
      }
    }
  }
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) out[j][c] = acc[j][c];
}

#if defined(__AVX512BF16__)
// weigh_values for bf16 V with vdpbf16ps: the probabilities rounded to bf16 (as GPU flash
// attention rounds P before its P.V product) and each pair of neighbouring tokens of a block
// weighed by one instruction, (p[t], p[t+1]) . (V[t][d], V[t+1][d]) for 16 dims at a time,
// instead of converting every V row to fp32 and multiplying once per token (3x fewer
// instructions per token for a group of 3 heads). `probs16` holds the bf16 probabilities,
// [NH][ctx + 1] (one spare entry so that a pair read at the last token stays in bounds). A
// block's last token without a partner (an odd count) is weighed with a zero row. Pairs
// follow the block and the context length alone, so the result is the same in any batch.
template <int64_t D, int64_t NH, int64_t MAX_NH>
inline void weigh_values_bf16(const c10::BFloat16* values, const int64_t* table, int64_t num_blocks,
                              int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t ctx,
                              const uint16_t* probs16, bool prefetch, const c10::BFloat16* next_k,
                              const int64_t* next_table, int64_t next_blocks, __m512 (&out)[MAX_NH][D / 16]) {
  constexpr int64_t C = D / 16;
  const int64_t stride = ctx + 1;
  __m512 acc[NH][C];
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
    const c10::BFloat16* value = values + table[blk] * block_stride;
    if (prefetch && blk < next_blocks) prefetch_l2(next_k + next_table[blk] * block_stride, block_stride);
    for (int64_t i = 0; i < count; i += 2, value += 2 * token_stride) {
      const bool single = i + 1 == count;
      __m512bh pairs[C];
      pair_rows<D>(value, single ? nullptr : value + token_stride, pairs);
      for (int64_t j = 0; j < NH; ++j) {
        const uint16_t* p = probs16 + j * stride + first + i;
        const __m512bh w = single ? pair_weights(p, true) : pair_at(p);
        for (int64_t c = 0; c < C; ++c) acc[j][c] = dot_pair(acc[j][c], pairs[c], w);
      }
    }
  }
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) out[j][c] = acc[j][c];
}

#endif

#if defined(__AVX512BF16__)
// The scaled scores of a GQA group's query heads (`q`: the first head's bf16 row, the
// others D apart; `group` of them) against one sequence's first `ctx` cached tokens, keys
// in lanes (keys_in_lanes, score_rows): row j of `scores` (`ctx` apart) for head j. Tokens
// go in groups of up to 16 within a block, four groups scored together so that the R x 4
// chains of vdpbf16ps keep the units busy; a score's bits do not depend on that grouping.
template <int64_t D, int R>
inline void score_heads(const __m512i* kt, const int64_t* pos, const int64_t* count, int64_t groups,
                        const c10::BFloat16* q, float scale, float* scores, int64_t ctx) {
  __m512 s[4][R];
  score_rows<D, R, 4>(kt, q, D, scale, s);
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(scores + r * ctx + pos[g], static_cast<__mmask16>((1u << count[g]) - 1), s[g][r]);
}

template <int64_t D>
inline void score_group_bf16(const c10::BFloat16* q, int64_t group, const c10::BFloat16* keys, const int64_t* table,
                             int64_t num_blocks, int64_t block_size, int64_t block_stride, int64_t token_stride,
                             int64_t ctx, float scale, float* scores) {
  constexpr int64_t P = D / 2;
  alignas(64) __m512i kt[4 * P];
  int64_t pos[4], count[4], groups = 0;
  auto flush = [&] {
    for (int64_t g = groups; g < 4; ++g)
      for (int64_t p = 0; p < P; ++p) kt[g * P + p] = _mm512_setzero_si512();
    for (int64_t h = 0; h < group; h += 4) {
      const c10::BFloat16* qh = q + h * D;
      float* rows = scores + h * ctx;
      switch (std::min<int64_t>(4, group - h)) {
        case 1: score_heads<D, 1>(kt, pos, count, groups, qh, scale, rows, ctx); break;
        case 2: score_heads<D, 2>(kt, pos, count, groups, qh, scale, rows, ctx); break;
        case 3: score_heads<D, 3>(kt, pos, count, groups, qh, scale, rows, ctx); break;
        default: score_heads<D, 4>(kt, pos, count, groups, qh, scale, rows, ctx);
      }
    }
    groups = 0;
  };
  for (int64_t blk = 0; blk < num_blocks; ++blk) {
    const int64_t first = blk * block_size, tokens = std::min(block_size, ctx - first);
    const c10::BFloat16* block = keys + table[blk] * block_stride;
    for (int64_t i0 = 0; i0 < tokens; i0 += 16) {
      pos[groups] = first + i0;
      count[groups] = std::min<int64_t>(16, tokens - i0);
      keys_in_lanes<D>(block + i0 * token_stride, token_stride, count[groups], kt + groups * P);
      if (++groups == 4) flush();
    }
  }
  if (groups > 0) flush();
}
#endif

constexpr int64_t kFetchBlocks = 32;  // a sequence's blocks fetched ahead into L2 (bf16 path)

template <typename T, int64_t D>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                      at::Tensor& out) {
  constexpr int64_t C = D / 16;              // vectors per head row
  constexpr int64_t HEADS_PER_PASS = 16 / C;  // output rows held in registers while V streams
  const Operands<T> o(q, k_cache, v_cache, block_tables, ctx_lens, out);
  const int64_t num_seqs = o.num_seqs, num_heads = o.num_heads, num_kv_heads = o.num_kv_heads;
  const int64_t block_size = o.block_size, group = o.group, max_blocks = o.max_blocks, token_stride = o.token_stride;
  const int64_t block_stride = block_size * token_stride;
  const T *q_ptr = o.q, *k_ptr = o.k, *v_ptr = o.v;
  const int64_t *bt_ptr = o.tables, *len_ptr = o.lens;
  T* out_ptr = o.out;
  const float fscale = static_cast<float>(scale);
  using DotT = typename DotFor<T, D>::type;
#if defined(__AVX512BF16__)
  constexpr bool kPairedValues = std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
  constexpr bool kKeysInLanes = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPairedValues = false;
#endif

  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, inv_sums;
    std::vector<uint16_t> probs16;  // bf16 probabilities, for weigh_values_bf16
    alignas(64) float row[D];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = len_ptr[b];
      const int64_t num_blocks = (ctx + block_size - 1) / block_size;
      const int64_t* table = bt_ptr + b * max_blocks;
      scores.resize(num_heads * ctx);
#if defined(__AVX512BF16__)
      if constexpr (kKeysInLanes) {  // q.k for every (head, token), scaled: keys in lanes
        // scattered blocks: the next sequence's K and V are fetched into L2 while this one is
        // computed (the first sequence of the range fetches its own)
        auto fetch = [&](int64_t seq) {
          const int64_t* seq_table = bt_ptr + seq * max_blocks;
          const int64_t blocks = std::min<int64_t>((len_ptr[seq] + block_size - 1) / block_size, kFetchBlocks);
          for (int64_t blk = 0; blk < blocks; ++blk) {
            prefetch_l2(k_ptr + seq_table[blk] * block_stride, block_stride);
            prefetch_l2(v_ptr + seq_table[blk] * block_stride, block_stride);
          }
        };
        if (b == begin) fetch(b);
        if (b + 1 < end) fetch(b + 1);
        for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
          score_group_bf16<D>(q_ptr + (b * num_heads + kv_head * group) * D, group, k_ptr + kv_head * D, table,
                              num_blocks, block_size, block_stride, token_stride, ctx, fscale,
                              scores.data() + kv_head * group * ctx);
      } else
#endif
      // q.k for every (head, token), scaled
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
        const T* block = k_ptr + table[blk] * block_stride;
        if (blk + 1 < num_blocks) prefetch_row(k_ptr + table[blk + 1] * block_stride, block_stride);
        prefetch_l2(v_ptr + table[blk] * block_stride, block_stride);
        for (int64_t h = 0; h < num_heads; ++h) {
          const DotT dot(q_ptr + (b * num_heads + h) * D);
          const T* key = block + (h / group) * D;
          for (int64_t i0 = 0; i0 < count; i0 += 16)
            score16(dot, key + i0 * token_stride, token_stride, std::min<int64_t>(16, count - i0), fscale,
                    scores.data() + h * ctx + first + i0);
        }
      }
#if defined(__AVX512BF16__)
      if constexpr (kPairedValues) {  // bf16 exps; the weighted sums are scaled by 1/sum below
        inv_sums.resize(num_heads);
        probs16.resize(num_heads * (ctx + 1));
        for (int64_t h = 0; h < num_heads; ++h)
          inv_sums[h] = exp_row_to_bf16(scores.data() + h * ctx, ctx, probs16.data() + h * (ctx + 1));
      } else
#endif
        softmax_rows(scores.data(), num_heads, ctx, inv_sums);
      // probabilities times V: per kv head, passes of up to HEADS_PER_PASS heads of its group
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        for (int64_t hs = 0; hs < group; hs += HEADS_PER_PASS) {
          const int64_t h0 = kv_head * group + hs, nh = std::min(HEADS_PER_PASS, group - hs);
          __m512 acc[HEADS_PER_PASS][C];
          const float* probs = scores.data() + h0 * ctx;
          const T* values = v_ptr + kv_head * D;
          const bool prefetch = kv_head == 0 && hs == 0 && b + 1 < end;
          const int64_t* next_table = bt_ptr + std::min(b + 1, num_seqs - 1) * max_blocks;
          const int64_t next_blocks = (len_ptr[std::min(b + 1, num_seqs - 1)] + block_size - 1) / block_size;
          auto weigh = [&](auto heads) {  // the head count fixed at compile time keeps acc in registers
            if constexpr (decltype(heads)::value <= HEADS_PER_PASS) {  // nh never exceeds it
#if defined(__AVX512BF16__)
              if constexpr (kPairedValues)
                weigh_values_bf16<D, decltype(heads)::value, HEADS_PER_PASS>(
                    values, table, num_blocks, block_size, block_stride, token_stride, ctx,
                    probs16.data() + h0 * (ctx + 1), prefetch, k_ptr, next_table, next_blocks, acc);
              else
#endif
                weigh_values<T, D, decltype(heads)::value, HEADS_PER_PASS>(
                    values, table, num_blocks, block_size, block_stride, token_stride, ctx, probs, prefetch, k_ptr,
                    next_table, next_blocks, acc);
            }
          };
          switch (nh) {
            case 1: weigh(std::integral_constant<int64_t, 1>{}); break;
            case 2: weigh(std::integral_constant<int64_t, 2>{}); break;
            case 3: weigh(std::integral_constant<int64_t, 3>{}); break;
            default: weigh(std::integral_constant<int64_t, HEADS_PER_PASS>{});
          }
          for (int64_t j = 0; j < nh; ++j) {
            T* o = out_ptr + (b * num_heads + h0 + j) * D;
            const __m512 norm = _mm512_set1_ps(kPairedValues ? inv_sums[h0 + j] : 1.f);
            for (int64_t c = 0; c < C; ++c) _mm512_store_ps(row + 16 * c, kPairedValues ? _mm512_mul_ps(acc[j][c], norm) : acc[j][c]);
            for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(row[d]);
          }
        }
      }
    }
  });
}

}  // namespace fast
#endif  // __AVX512F__

}  // namespace

// The AVX-512 kernel where this build has it (fp32, bf16 and fp16), the portable one otherwise.
template <typename T, int64_t D>
void fast_or_portable(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                      at::Tensor& out) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, double>)
    fast::decode_attention<T, D>(q, k_cache, v_cache, block_tables, ctx_lens, scale, out);
  else
#endif
    decode_attention_impl<T, D>(q, k_cache, v_cache, block_tables, ctx_lens, scale, out);
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [B, H, D] and k/v cache [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong,
              "block_tables and ctx_lens must be int64");
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (q.size(2)) {
#if defined(__AVX512F__)
      case 16: fast_or_portable<scalar_t, 16>(q, k_cache, v_cache, tables, lens, scale, out); break;
      case 32: fast_or_portable<scalar_t, 32>(q, k_cache, v_cache, tables, lens, scale, out); break;
#endif
      case 64: fast_or_portable<scalar_t, 64>(q, k_cache, v_cache, tables, lens, scale, out); break;
      case 128: fast_or_portable<scalar_t, 128>(q, k_cache, v_cache, tables, lens, scale, out); break;
      default: decode_attention_impl<scalar_t, 0>(q, k_cache, v_cache, tables, lens, scale, out);
    }
  });
  return out;
}
