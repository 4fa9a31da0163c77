// Decode attention over a paged KV cache, for the CPU.
//
// One query token per sequence attends to that sequence's first ctx_lens[b] cached tokens,
// read in place through its block table: no gathered copy of the KV is made. Work is split
// over (sequence, kv head); every query head of a GQA group shares one pass over the keys.
#include "attention_common.h"

#include <cstring>

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
  for_balanced_ranges(len_ptr, num_seqs, [&](int64_t begin, int64_t end) {
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


#if defined(PDSERVE_VECTOR_ATTENTION)
// The vector kernel (AVX-512 or AVX2): the same contract as decode_attention_impl, restructured so that the
// step is bound by reading K/V rather than by arithmetic, and so that those reads stream.
//  - Each sequence is walked block by block, its K blocks then its V blocks, and each block
//    (all kv heads' rows of its tokens: one contiguous run) is read in one visit
//    (SequenceBlocks): its lines are touched in ascending order first (touch_in_order) and
//    the walk's next block is fetched into L2, so that the reads run under the arithmetic.
//    Taking one kv head at a time through every block instead jumps through each block in
//    strides of a token's row, which the hardware prefetcher does not follow: memory then
//    waits on the arithmetic and the arithmetic on memory.
//  - Scores in bf16 with avx512_bf16: keys in lanes (score_sequence_bf16): each group of up
//    to 16 cached tokens of a kv head is transposed once into bf16 pairs, and every score of
//    the group's query heads is one chain of vdpbf16ps with the query's pair broadcast, four
//    key groups at a time. Other dtypes, and bf16 without avx512_bf16 (score_sequence): kLanes
//    cached tokens at a time for two query heads of a kv head (one with AVX2), each token's
//    q.k a vector of kLanes partial sums reduced together by one transpose-and-add tree
//    (score_lanes_rows), the two heads sharing each load of a key.
//  - Values: every head's fp32 output row lives in memory between blocks (loading and
//    storing it changes no bits) and in registers while a block is weighed, up to 4 heads of
//    a kv head's group at a time. In bf16 with avx512_bf16 the scores are left unscaled and
//    their exps (the scale folded into the exponent) rounded to bf16 in one pass
//    (exp_row_to_bf16), two tokens are weighed per vdpbf16ps (weigh_block_bf16)
//    instead of converting each V row to fp32, and the sum is scaled by 1/sum at the end.
//  - With AMX (where the kernel grants it: amx.h), for head sizes that are multiples of 32,
//    bf16 runs on tiles: the scores with 16 cached tokens' keys, as they lie in their block,
//    as the A tile and a kv head's query heads as the B tile (score_sequence_amx: no
//    transposition), and P.V with a kv head's query heads as tiles of 4 rows
//    (weigh_sequence_amx: the V blocks read once in order, then each kv head's probabilities
//    times its V pairs, 32 tokens a tile), the prefill kernel's bits.
// Each output's summation order depends only on its own sequence, never on the batch or on
// where its blocks lie, so a token's attention is the same bits alone, batched, or as a
// prefill token (paged_prefill.cpp keeps the same order).
namespace fast {

using namespace pdserve_attention::simd;

// One sequence's blocks in the cache, visited K block by K block, then V block by V block.
template <typename T>
struct SequenceBlocks {
  const T *k, *v;
  const int64_t* table;
  int64_t num_blocks, block_stride;

  // K block `blk` (its first token's row), its lines touched in order; the walk's next
  // block (K's next, after the last one V's first) fetched into L2.
  const T* key_block(int64_t blk) const {
    const T* block = k + table[blk] * block_stride;
    touch_in_order(block, block_stride);
    prefetch_l2(blk + 1 < num_blocks ? k + table[blk + 1] * block_stride : v + table[0] * block_stride, block_stride);
    return block;
  }
  // V block `blk`, the same way.
  const T* value_block(int64_t blk) const {
    const T* block = v + table[blk] * block_stride;
    touch_in_order(block, block_stride);
    if (blk + 1 < num_blocks) prefetch_l2(v + table[blk + 1] * block_stride, block_stride);
    return block;
  }
};

// The scaled scores of every query head (`q`: the sequence's [heads][D] rows) against the
// sequence's first `ctx` cached tokens, into `scores` [heads][ctx]: per block, the heads of
// each kv head two at a time (score_block_rows), kLanes tokens at a time.
template <typename T, int64_t D>
inline void score_sequence(const T* q, const SequenceBlocks<T>& blocks, int64_t num_heads, int64_t group,
                           int64_t block_size, int64_t token_stride, int64_t ctx, float scale, float* scores) {
  for (int64_t blk = 0; blk < blocks.num_blocks; ++blk) {
    const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
    const T* block = blocks.key_block(blk);
    for (int64_t h = 0; h < num_heads; h += 2) {
      const bool two = (h + 1) % group != 0;  // head h + 1 shares head h's kv head
      const Dot<T, D> dots[2] = {Dot<T, D>(q + h * D), Dot<T, D>(q + (two ? h + 1 : h) * D)};
      score_block_rows(dots, two, block + (h / group) * D, token_stride, count, count, scale,
                       scores + h * ctx + first, two ? scores + (h + 1) * ctx + first : nullptr);
      if (!two) --h;  // h + 1 opens the next kv head's group
    }
  }
}

#if defined(__AVX512BF16__)
// weigh_block for bf16 V with vdpbf16ps: the probabilities rounded to bf16 (`probs16`, as
// GPU flash attention rounds P before its P.V product) and each pair of neighbouring tokens
// of the block weighed by one instruction, (p[t], p[t+1]) . (V[t][d], V[t+1][d]) for 16
// dims at a time, instead of converting every V row to fp32 and multiplying once per token.
// A block's last token without a partner (an odd count) is weighed with a zero row. Pairs
// follow the block and the context length alone, so the result is the same in any batch.
template <int64_t D, int64_t NH>
inline void weigh_block_bf16(const c10::BFloat16* value, int64_t token_stride, int64_t count, const uint16_t* probs16,
                             int64_t p_stride, float* acc) {
  constexpr int64_t C = D / 16;
  __m512 sum[NH][C];
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) sum[j][c] = _mm512_loadu_ps(acc + j * D + 16 * c);
  for (int64_t i = 0; i < count; i += 2, value += 2 * token_stride) {
    const bool single = i + 1 == count;
    __m512bh pairs[C];
    pair_rows<D>(value, single ? nullptr : value + token_stride, pairs);
    for (int64_t j = 0; j < NH; ++j) {
      const uint16_t* p = probs16 + j * p_stride + i;
      const __m512bh w = single ? pair_weights(p, true) : pair_at(p);
      for (int64_t c = 0; c < C; ++c) sum[j][c] = dot_pair(sum[j][c], pairs[c], w);
    }
  }
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + j * D + 16 * c, sum[j][c]);
}

// The scaled scores of R query heads (`q`: the first head's bf16 row, the others D apart)
// against the (up to 4) groups of keys in lanes in `kt`: row r of `scores` (`ctx` apart) for
// head r, token pos[g] + t at lane t of group g.
template <int64_t D, int R>
inline void score_heads(const __m512i* kt, const int64_t* pos, const int64_t* count, int64_t groups,
                        const c10::BFloat16* q, float scale, float* scores, int64_t ctx) {
  __m512 s[4][R];
  score_rows<D, R, 4>(kt, q, D, scale, s);
  for (int64_t g = 0; g < groups; ++g)
    for (int r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(scores + r * ctx + pos[g], static_cast<__mmask16>((1u << count[g]) - 1), s[g][r]);
}

// score_sequence for bf16, keys in lanes: up to 4 groups of 16 tokens are gathered, then for
// each kv head transposed (keys_in_lanes) and scored for the head's GQA group (score_rows).
// A score's bits depend only on its query row and its token's K row, never on this grouping.
template <int64_t D>
inline void score_sequence_bf16(const c10::BFloat16* q, const SequenceBlocks<c10::BFloat16>& blocks,
                                int64_t num_kv_heads, int64_t group, int64_t block_size, int64_t token_stride,
                                int64_t ctx, float scale, float* scores) {
  constexpr int64_t P = D / 2;
  alignas(64) __m512i kt[4 * P];
  const c10::BFloat16* src[4];
  int64_t pos[4], count[4], groups = 0;
  auto flush = [&] {
    for (int64_t g = groups; g < 4; ++g)
      for (int64_t p = 0; p < P; ++p) kt[g * P + p] = _mm512_setzero_si512();
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
      for (int64_t g = 0; g < groups; ++g) keys_in_lanes<D>(src[g] + kv_head * D, token_stride, count[g], kt + g * P);
      for (int64_t h = 0; h < group; h += 4) {
        const int64_t head = kv_head * group + h;
        const c10::BFloat16* qh = q + head * D;
        float* rows = scores + head * ctx;
        switch (std::min<int64_t>(4, group - h)) {
          case 1: score_heads<D, 1>(kt, pos, count, groups, qh, scale, rows, ctx); break;
          case 2: score_heads<D, 2>(kt, pos, count, groups, qh, scale, rows, ctx); break;
          case 3: score_heads<D, 3>(kt, pos, count, groups, qh, scale, rows, ctx); break;
          default: score_heads<D, 4>(kt, pos, count, groups, qh, scale, rows, ctx);
        }
      }
    }
    groups = 0;
  };
  for (int64_t blk = 0; blk < blocks.num_blocks; ++blk) {
    const int64_t first = blk * block_size, tokens = std::min(block_size, ctx - first);
    const c10::BFloat16* block = blocks.key_block(blk);
    for (int64_t i0 = 0; i0 < tokens; i0 += 16) {
      src[groups] = block + i0 * token_stride;
      pos[groups] = first + i0;
      count[groups] = std::min<int64_t>(16, tokens - i0);
      if (++groups == 4) flush();
    }
  }
  if (groups > 0) flush();
}
#endif

#if defined(PDSERVE_AMX)
// Whether score_sequence_amx scores bf16 here: on AMX (granted) and D a multiple of 32.
template <int64_t D>
inline bool scores_on_tiles() {
  return D % 32 == 0 && amx::permitted();
}

// score_sequence_bf16 on AMX tiles, keys as they lie in the cache: 16 cached tokens' K rows of
// a kv head, in their block, are the A tile (tile 6: no transposition into lanes) and up to 16
// of the group's query heads the B tile (tile 7: pairs of dims x heads, made once per sequence
// in `qpairs`), so that row t of C (tile 2) holds token t's sums for those heads, stored and
// gathered into each head's row of `scores`. Each sum is AMX's chain over the D/2 pairs, 16 a
// tile, in order, a pair's products exact in fp32 whichever operand carries which factor: the
// bits of the prefill kernel's score_group_amx (queries as the A tile, keys in lanes as B) at
// scale 1, the unscaled sums exp_row_to_bf16 takes. A group of fewer than 16 tokens (a block's
// last, or blocks of fewer) is copied with zero rows after it. The tiles have 16 rows
// (TileConfig's 2, 6 and 7).
template <int64_t D>
inline void score_sequence_amx(const c10::BFloat16* q, const SequenceBlocks<c10::BFloat16>& blocks,
                               int64_t num_kv_heads, int64_t group, int64_t block_size, int64_t token_stride,
                               int64_t ctx, float* scores, std::vector<uint32_t>& qpairs) {
  constexpr int64_t H = D / 32;                     // B tiles (16 pairs each) per head row
  const int64_t head_tiles = (group + 15) / 16;     // B tiles' columns: 16 heads each
  const auto b_tile = [&](int64_t kv_head, int64_t ht, int64_t c) {
    return qpairs.data() + ((kv_head * head_tiles + ht) * H + c) * 256;
  };
  qpairs.assign(num_kv_heads * head_tiles * H * 256, 0u);
  for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
    for (int64_t n = 0; n < group; ++n)
      for (int64_t k = 0; k < H * 16; ++k)  // pair k of head n: row k % 16, column n % 16 of its B tile
        b_tile(kv_head, n / 16, k / 16)[(k % 16) * 16 + n % 16] =
            static_cast<uint32_t>(pair_word(q + (kv_head * group + n) * D + 2 * k));
  alignas(64) c10::BFloat16 padded[16 * D];
  alignas(64) float sums[16][16];
  const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  for (int64_t blk = 0; blk < blocks.num_blocks; ++blk) {
    const int64_t first = blk * block_size, tokens = std::min(block_size, ctx - first);
    const c10::BFloat16* block = blocks.key_block(blk);
    for (int64_t i0 = 0; i0 < tokens; i0 += 16) {
      const int64_t count = std::min<int64_t>(16, tokens - i0);
      const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
      for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        const c10::BFloat16* a = block + i0 * token_stride + kv_head * D;
        int64_t lda = token_stride;
        if (count < 16) {
          for (int64_t t = 0; t < count; ++t) std::copy_n(a + t * token_stride, D, padded + t * D);
          std::fill(padded + count * D, padded + 16 * D, c10::BFloat16(0.f));
          a = padded, lda = D;
        }
        for (int64_t ht = 0; ht < head_tiles; ++ht) {
          _tile_zero(2);
          for (int64_t c = 0; c < H; ++c) {
            _tile_loadd(6, a + 32 * c, lda * 2);
            _tile_loadd(7, b_tile(kv_head, ht, c), 64);
            _tile_dpbf16ps(2, 6, 7);
          }
          _tile_stored(2, sums, 64);
          for (int64_t n = 16 * ht; n < std::min(group, 16 * ht + 16); ++n)
            _mm512_mask_storeu_ps(scores + (kv_head * group + n) * ctx + first + i0, mask,
                                  _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, rows, &sums[0][n % 16], 4));
        }
      }
    }
  }
}

// One sequence's P.V on AMX tiles (values_on_tiles): per kv head, its group's probabilities
// (exp_row_to_bf16 of `scores` [heads][ctx], unscaled sums; 1/sum into inv_sums) as rows of 32-token tiles
// (zero past ctx), its V as tiles of pairs (value_pairs), weighed by weigh_tiles_amx 4 rows at a time into
// `acc` [heads][D] (the prefill kernel weighs a token's row the same way).
template <int64_t D>
inline void weigh_sequence_amx(const Operands<c10::BFloat16>& o, const SequenceBlocks<c10::BFloat16>& blocks,
                               int64_t ctx, const float* scores, float scale, std::vector<float>& inv_sums,
                               std::vector<uint16_t>& probs, std::vector<uint16_t>& pairs, std::vector<float>& sums,
                               float* acc) {
  constexpr int64_t R = kDecodeTileRows;  // rows per tile here (for_balanced_ranges' TileScope)
  const int64_t group = o.group, block_size = o.block_size, rows = (group + R - 1) / R * R;
  const int64_t p_stride = (ctx + 1 + 31) / 32 * 32;  // exp_row_to_bf16 writes ctx + 1 entries
  sums.resize(rows * D);
  pairs.resize(2 * 16 * D * 2);  // a tile's pairs at a time, made as they are weighed (two buffers, in L1)
  probs.assign(rows * p_stride, 0);  // exp_row_to_bf16 writes the same entries of a row for every kv head
  const int64_t tiles = (ctx + 31) / 32;
  // the V blocks read once in order into L2 (value_block) before the kv heads' passes stride through them
  for (int64_t blk = 0; blk < blocks.num_blocks; ++blk) blocks.value_block(blk);
  for (int64_t kv_head = 0; kv_head < o.num_kv_heads; ++kv_head) {
    for (int64_t j = 0; j < group; ++j) {
      const int64_t h = kv_head * group + j;
      inv_sums[h] = exp_row_to_bf16(scores + h * ctx, ctx, scale, probs.data() + j * p_stride);
    }
    const auto row = [&](int64_t t) {
      return blocks.v + blocks.table[t / block_size] * blocks.block_stride + (t % block_size) * o.token_stride +
             kv_head * D;
    };
    const auto pairs_of = [&](int64_t j) {
      uint16_t* to = pairs.data() + (j % 2) * 16 * D * 2;  // the other tile's buffer may still be read
      value_pairs<D>(row, 16 * j, 16 * j + 16, ctx, to);
      return to;
    };
    std::fill(sums.begin(), sums.end(), 0.f);
    for (int64_t r0 = 0; r0 < rows; r0 += R)
      weigh_tiles_amx<D>([&](int64_t j) { return probs.data() + r0 * p_stride + 32 * j; }, p_stride, pairs_of, tiles,
                         sums.data() + r0 * D);
    std::copy_n(sums.data(), group * D, acc + kv_head * group * D);
  }
}
#endif

// Sequences [begin, end): per sequence its scores, their softmax (bf16 pairs: exps rounded
// to bf16, the sum's reciprocal applied at the end), and the probabilities times V, block by
// block, into fp32 rows that are rounded to T once at the end.
template <typename T, int64_t D>
void decode_range(const Operands<T>& o, float scale, int64_t begin, int64_t end) {
  constexpr int64_t C = D / kLanes;                                     // vectors per head row
  constexpr int64_t PASS = std::clamp<int64_t>(kAccumulators / C, 1, 4);  // heads weighed together
#if defined(__AVX512BF16__)
  constexpr bool kPairedValues = std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
  constexpr bool kKeysInLanes = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPairedValues = false, kKeysInLanes = false;
#endif
  const int64_t num_heads = o.num_heads, group = o.group, block_size = o.block_size, token_stride = o.token_stride;
  std::vector<float> scores, inv_sums(num_heads), acc(num_heads * D);
  std::vector<uint16_t> probs16, pairs;  // bf16 probabilities, for weigh_block_bf16; V pairs (AMX)
  std::vector<float> sums;  // a kv head's weighted sums on AMX, 16 rows at a time
  std::vector<uint32_t> qpairs;  // the query heads as AMX B tiles (score_sequence_amx)
  alignas(64) float row[D];
  // sequence b's weighted sums (`acc`) times 1/sum (bf16) into its output rows
  const auto finish = [&](int64_t b) {
    for (int64_t h = 0; h < num_heads; ++h) {
      T* out = o.out + (b * num_heads + h) * D;
      const vfloat norm = vset1(kPairedValues ? inv_sums[h] : 1.f);
      for (int64_t c = 0; c < C; ++c) {
        const vfloat sum = vload(&acc[h * D + kLanes * c]);
        vstore(row + kLanes * c, kPairedValues ? vmul(sum, norm) : sum);
      }
      for (int64_t d = 0; d < D; ++d) out[d] = static_cast<T>(row[d]);
    }
  };
  for (int64_t b = begin; b < end; ++b) {
    const int64_t ctx = o.lens[b];
    const SequenceBlocks<T> blocks{o.k, o.v, o.tables + b * o.max_blocks, (ctx + block_size - 1) / block_size,
                                   block_size * token_stride};
    const T* q = o.q + b * num_heads * D;
    scores.resize(num_heads * ctx);
    [&] {  // the scores: on AMX tiles, keys in lanes (bf16), or kLanes tokens at a time
#if defined(PDSERVE_AMX)
      if constexpr (kPairedValues)
        if (scores_on_tiles<D>())
          return score_sequence_amx<D>(q, blocks, o.num_kv_heads, group, block_size, token_stride, ctx, scores.data(),
                                       qpairs);  // unscaled: exp_row_to_bf16 scales
#endif
#if defined(__AVX512BF16__)
      if constexpr (kKeysInLanes)
        return score_sequence_bf16<D>(q, blocks, o.num_kv_heads, group, block_size, token_stride, ctx,
                                      kPairedValues ? 1.f : scale, scores.data());  // paired: exp_row_to_bf16 scales
#endif
      score_sequence<T, D>(q, blocks, num_heads, group, block_size, token_stride, ctx, scale, scores.data());
    }();
#if defined(PDSERVE_AMX)
    if constexpr (kPairedValues) {
      if (values_on_tiles<D>()) {
        weigh_sequence_amx<D>(o, blocks, ctx, scores.data(), scale, inv_sums, probs16, pairs, sums, acc.data());
        finish(b);
        continue;
      }
    }
#endif
#if defined(__AVX512BF16__)
    if constexpr (kPairedValues) {
      probs16.resize(num_heads * (ctx + 1));
      for (int64_t h = 0; h < num_heads; ++h)
        inv_sums[h] = exp_row_to_bf16(scores.data() + h * ctx, ctx, scale, probs16.data() + h * (ctx + 1));
    } else
#endif
      softmax_rows(scores.data(), num_heads, ctx, inv_sums);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t blk = 0; blk < blocks.num_blocks; ++blk) {
      const int64_t first = blk * block_size, count = std::min(block_size, ctx - first);
      const T* block = blocks.value_block(blk);
      for (int64_t kv_head = 0; kv_head < o.num_kv_heads; ++kv_head) {
        const T* value = block + kv_head * D;
        for (int64_t h0 = kv_head * group, h_end = h0 + group; h0 < h_end; h0 += PASS) {
          auto weigh = [&](auto heads) {  // the head count fixed at compile time keeps the sums in registers
            constexpr int64_t NH = decltype(heads)::value;
            if constexpr (NH <= PASS) {
#if defined(__AVX512BF16__)
              if constexpr (kPairedValues)
                weigh_block_bf16<D, NH>(value, token_stride, count, probs16.data() + h0 * (ctx + 1) + first, ctx + 1,
                                        acc.data() + h0 * D);
              else
#endif
              {
                const float* probs[NH];
                float* sums[NH];
                for (int64_t j = 0; j < NH; ++j)
                  probs[j] = scores.data() + (h0 + j) * ctx + first, sums[j] = acc.data() + (h0 + j) * D;
                weigh_block<T, D, NH>(value, token_stride, count, probs, sums);
              }
            }
          };
          switch (std::min(PASS, h_end - h0)) {
            case 1: weigh(std::integral_constant<int64_t, 1>{}); break;
            case 2: weigh(std::integral_constant<int64_t, 2>{}); break;
            case 3: weigh(std::integral_constant<int64_t, 3>{}); break;
            default: weigh(std::integral_constant<int64_t, PASS>{});
          }
        }
      }
    }
    finish(b);
  }
}

template <typename T, int64_t D>
void decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                      at::Tensor& out) {
  const Operands<T> o(q, k_cache, v_cache, block_tables, ctx_lens, out);
  const float fscale = static_cast<float>(scale);
  for_balanced_ranges(o.lens, o.num_seqs, [&](int64_t begin, int64_t end) { decode_range<T, D>(o, fscale, begin, end); });
}

}  // namespace fast
#endif  // PDSERVE_VECTOR_ATTENTION

}  // namespace

// The vector kernel where this build has one (fp32, bf16 and fp16), the portable one otherwise.
template <typename T, int64_t D>
void fast_or_portable(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale,
                      at::Tensor& out) {
#if defined(PDSERVE_VECTOR_ATTENTION)
  if constexpr (!std::is_same_v<T, double>)
    fast::decode_attention<T, D>(q, k_cache, v_cache, block_tables, ctx_lens, scale, out);
  else
#endif
    decode_attention_impl<T, D>(q, k_cache, v_cache, block_tables, ctx_lens, scale, out);
}

// What paged_decode_attention takes, checked (before anything is written, where a call writes).
static void check_decode_operands(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& ctx_lens) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "expected q [B, H, D] and k/v cache [blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q and the caches must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && ctx_lens.scalar_type() == at::kLong,
              "block_tables and ctx_lens must be int64");
}

// Each sequence's new K and V rows (`k`, `v`: [B, kv_heads, D], rows any stride apart) into its
// slot of the caches (`slots` [B] int64: block * block_size + offset). Every slot is checked
// before anything is written, so a bad one leaves the caches as they were.
static void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slots) {
  const int64_t B = k.size(0), kv_heads = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == kv_heads && k.size(2) == D,
              "k and v must be [num_seqs, ", kv_heads, ", ", D, "] to match the cache, got k ", k.sizes(), " and v ",
              v.sizes());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "k and v must be in the cache's dtype (", k_cache.scalar_type(), "), got ", k.scalar_type(), " and ",
              v.scalar_type());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == B,
              "slots must be int64 [", B, "], one per sequence, got ", slots.scalar_type(), " ", slots.sizes());
  const auto slot_list = slots.contiguous();
  const int64_t* slot = slot_list.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slot[b] >= 0 && slot[b] < num_slots, "slot ", slot[b], " of sequence ", b,
                " is outside the cache's ", num_slots, " slots");
  const int64_t row_bytes = kv_heads * D * k_cache.element_size();
  auto write = [&](const at::Tensor& rows, at::Tensor& cache) {
    const at::Tensor inner = rows.stride(2) == 1 && rows.stride(1) == D ? rows : rows.contiguous();
    const char* src = static_cast<const char*>(inner.data_ptr());
    char* dst = static_cast<char*>(cache.data_ptr());
    const int64_t src_stride = inner.stride(0) * inner.element_size();
    for (int64_t b = 0; b < B; ++b) std::memcpy(dst + slot[b] * row_bytes, src + b * src_stride, row_bytes);
  };
  write(k, k_cache);
  write(v, v_cache);
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor ctx_lens, double scale);

// A decode step's attention in one call: each sequence's new K/V written into its slot
// (write_kv), then paged_decode_attention over the caches, the new token included. The same
// bits and the same caches as writing the slots with index_copy_ and then attending, without
// the two copies' dispatch (benchmarks/README.md, "Decode's dispatch").
at::Tensor paged_decode_attention_write(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache,
                                        at::Tensor v_cache, at::Tensor slots, at::Tensor block_tables,
                                        at::Tensor ctx_lens, double scale) {
  q = q.contiguous();
  check_decode_operands(q, k_cache, v_cache, block_tables, ctx_lens);
  TORCH_CHECK(k.dim() == 3 && q.size(0) == k.size(0), "q [B, H, D] and k [B, kv_heads, D] must have one row per "
              "sequence, got q ", q.sizes(), " and k ", k.sizes());
  write_kv(k, v, k_cache, v_cache, slots);
  return paged_decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, scale);
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor ctx_lens, double scale) {
  check_decode_operands(q, k_cache, v_cache, block_tables, ctx_lens);
  auto tables = block_tables.contiguous();
  auto lens = ctx_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (q.size(2)) {
#if defined(PDSERVE_VECTOR_ATTENTION)
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
