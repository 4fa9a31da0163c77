// Prefill attention over a paged KV cache, for the CPU: the tokens of one sequence's chunk,
// query i at position start_pos + i attending to the positions up to its own, all cached
// already (the chunk's K/V is written before attention runs).
//
// Token identity. Every query's output is computed by exactly the arithmetic the decode
// kernel (paged_attention.cpp, its vector path) applies to a sequence of that context length:
// the same scores (bf16: score_rows, keys in lanes; else score_lanes_rows), the same two-pass softmax
// over the row (bf16: exp_row_to_bf16 of the unscaled sums, the weighted sum scaled by 1/sum at the end), the
// same accumulation of probabilities times V token by token in position order (in bf16:
// the same pairs of tokens per vdpbf16ps, a block's odd last token against a zero row). So a
// token's output is the same bits whether it is prefilled in any chunking or decoded, alone
// or batched. With AMX, the scores and P.V of bf16 run on tiles in both kernels alike
// (paged_attention.cpp: score_sequence_amx, weigh_sequence_amx; here score_group_amx and
// weigh_tiles_amx, 16 rows a tile).
//
// What changes is the order of the loops around that arithmetic: queries are taken in tiles
// of consecutive tokens, and each tile walks the sequence's K and V once, every group of keys
// scored (or weighed) for all the tile's queries, where the decode kernel reads the whole
// prefix again for every query. A tile is taken one kv head at a time, so its scores between
// passes are that head group's rows only. In bf16 (prefill_tile_bf16) the keys are put in
// lanes once per call for all the tiles (LaneKeys), and on AMX V is laid out as tiles once per
// call too (ValueTiles), each 16 rows then weighed over all their tokens with their sums on
// the tiles; without AMX, V is weighed in spans of up to 64 tokens, several rows at once, and a
// query's accumulators live in memory between spans (fp32 values, so loading and storing them
// changes nothing); prefill_tile does the same for the other dtypes. Tiles are handed to
// threads in a balanced order (first, last, second, second-to-last, ...): later tiles attend
// to longer prefixes, and contiguous ranges of tiles would give the last thread most of the
// work.
#include "attention_common.h"

#include <ATen/ops/arange.h>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor ctx_lens, double scale);

namespace {

using namespace pdserve_attention;

constexpr int64_t kSpanTokens = 64;  // tokens per span: weighed per load and store of the accumulators

// A thread's working memory for its tiles, reused from tile to tile.
struct TileBuffers {
  std::vector<float> scores, acc, norms, values;  // values: a span's V rows of one kv head in fp32
  std::vector<uint16_t> probs16, full, single;  // bf16 probabilities; a span's V pairs
  std::vector<c10::BFloat16> qbuf;  // the tile's query rows of one kv head
  std::vector<int64_t> query_of, row_of;  // a kv head's rows: query, and row in the buffers
};

// `v` at least `n` long, never shrunk (what is past n is left as it was).
template <typename T>
inline void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The k-th tile to run of `num_tiles`, in the balanced order: 0, n-1, 1, n-2, ...
inline int64_t balanced_tile(int64_t k, int64_t num_tiles) { return k % 2 == 0 ? k / 2 : num_tiles - 1 - k / 2; }

#if defined(PDSERVE_VECTOR_ATTENTION)
namespace fast {

using namespace pdserve_attention::simd;

#if defined(__AVX512BF16__)
// R rows (row_of[k] + h0: query i's head h0 + j at i * num_heads + j) that each take the
// first `count` tokens of the block weighed into their accumulators (`acc`, [query][head][D]),
// pair by pair as the decode kernel's weigh_block_bf16 does; `full`/`single`: the span's V pairs (weigh_span_bf16).
template <int64_t D, int64_t R>
inline void weigh_rows(int64_t count, const std::vector<uint16_t>& full, const std::vector<uint16_t>& single,
                       const uint16_t* probs16, int64_t p_stride, int64_t first, const int64_t* row_of, int64_t h0,
                       float* acc) {
  constexpr int64_t C = D / 16, V = 32;
  const uint16_t* probs[R];
  float* a[R];
  __m512 sum[R][C];
  for (int64_t k = 0; k < R; ++k) {
    const int64_t row = row_of[k] + h0;
    probs[k] = probs16 + row * p_stride + first;
    a[k] = acc + row * D;
    for (int64_t c = 0; c < C; ++c) sum[k][c] = _mm512_loadu_ps(a[k] + 16 * c);
  }
  auto weigh = [&](const uint16_t* pairs, int64_t t, bool alone) {
    __m512bh v[C];
    for (int64_t c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(pairs + c * V);
    for (int64_t k = 0; k < R; ++k) {
      const __m512bh w = alone ? pair_weights(probs[k] + t, true) : pair_at(probs[k] + t);
      for (int64_t c = 0; c < C; ++c) sum[k][c] = dot_pair(sum[k][c], v[c], w);
    }
  };
  int64_t t = 0;
  for (; t + 1 < count; t += 2) weigh(&full[t / 2 * C * V], t, false);
  if (t < count) weigh(&single[t / 2 * C * V], t, true);
  for (int64_t k = 0; k < R; ++k)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(a[k] + 16 * c, sum[k][c]);
}

// A span of V (the tokens of `nblocks` consecutive blocks of one kv head, `values[b]` the
// first token's row of block b; several blocks only where block_size is even, so no pair
// crosses a block) weighed into the accumulators (`acc`, [query][head][D] fp32) of every
// query of a tile that attends to it, pair by pair as the decode kernel's weigh_block_bf16
// does: tokens (t, t+1) of a block per vdpbf16ps, a query's odd last token against a zero
// row. Query i's context is `ctx0 + i`; the span starts at position `first`, and the tile's
// last query attends to `span_tokens` of its tokens. The pairs are made once per span for
// all the tile's queries (`full`, and `single` for the odd counts some query ends on), and
// each group of rows loads and stores its accumulators once per span.
template <int64_t D>
inline void weigh_span_bf16(const c10::BFloat16* const* values, int64_t token_stride, int64_t block_size,
                            int64_t span_tokens, int64_t first, int64_t ctx0, int64_t nq, int64_t h0, int64_t group,
                            const uint16_t* probs16, int64_t p_stride, float* acc, std::vector<uint16_t>& full,
                            std::vector<uint16_t>& single, const int64_t* query_of, const int64_t* row_of) {
  constexpr int64_t C = D / 16, V = 32;  // vectors of pairs per token pair; bf16 lanes per vector
  const int64_t npairs = (span_tokens + 1) / 2;
  full.resize(npairs * C * V);
  single.resize(npairs * C * V);
  auto keep = [](const __m512bh (&pairs)[C], uint16_t* to) {
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_si512(to + c * V, (__m512i)pairs[c]);
  };
  const int64_t lowest = std::max<int64_t>(1, std::min(span_tokens, ctx0 - first));  // the fewest tokens a query uses
  for (int64_t p = 0, b = 0, in_block = 0; p < npairs; ++p, in_block += 2) {
    if (in_block >= block_size) ++b, in_block = 0;
    const int64_t t = 2 * p;
    const c10::BFloat16* row = values[b] + in_block * token_stride;
    __m512bh pairs[C];
    if (t + 1 < span_tokens) {
      pair_rows<D>(row, row + token_stride, pairs);
      keep(pairs, &full[p * C * V]);
    }
    if (t + 1 >= lowest) {
      pair_rows<D>(row, nullptr, pairs);
      keep(pairs, &single[p * C * V]);
    }
  }
  // rows (query i, head h0 + j) in query-major order, kRowsV at a time where they all take
  // the same tokens of the span (16 independent chains of vdpbf16ps: one row's 4 would
  // wait on the instruction's latency), one by one at the causal edge
  constexpr int64_t kRowsV = 256 / D;  // rows weighed together: 16 accumulators
  const int64_t rows = nq * group;
  auto count_of = [&](int64_t r) { return std::clamp<int64_t>(ctx0 + query_of[r] - first, 0, span_tokens); };
  int64_t r = 0;
  while (r < rows) {
    const int64_t count = count_of(r);
    if (r + kRowsV <= rows && count_of(r + kRowsV - 1) == count && count > 0) {
      weigh_rows<D, kRowsV>(count, full, single, probs16, p_stride, first, row_of + r, h0, acc);
      r += kRowsV;
      continue;
    }
    if (count > 0) weigh_rows<D, 1>(count, full, single, probs16, p_stride, first, row_of + r, h0, acc);
    ++r;
  }
}
#endif

// A call's V as AMX B tiles, made once for all its query tiles (value_pairs of each kv head's
// first `tokens` tokens, from the sequence's first). Made per query tile and span as they
// were, every tile read V again from its scattered blocks and paired it again: at 8,192
// tokens that took about a fifth of the kernel's time (benchmarks/README.md).
template <int64_t D>
struct ValueTiles {
  std::vector<uint16_t> pairs;  // [kv_head][tile][16 pairs][D / 16][32]
  int64_t tiles = 0;
  // tile j of kv head h: 16 pairs of tokens 32j ..
  const uint16_t* at(int64_t h, int64_t j) const { return pairs.data() + (h * tiles + j) * 16 * D * 2; }
  uint16_t* at(int64_t h, int64_t j) { return pairs.data() + (h * tiles + j) * 16 * D * 2; }
};

#if defined(PDSERVE_AMX)
template <int64_t D>
void make_value_tiles(const c10::BFloat16* v_ptr, const int64_t* table, int64_t tokens, int64_t num_kv_heads,
                      int64_t block_size, ValueTiles<D>& v) {
  const int64_t token_stride = num_kv_heads * D, block_stride = block_size * token_stride;
  v.tiles = (tokens + 31) / 32;
  grow(v.pairs, num_kv_heads * v.tiles * 16 * D * 2);
  at::parallel_for(0, num_kv_heads * v.tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t h = k / v.tiles, j = k % v.tiles;
      const auto row = [&](int64_t t) {
        return v_ptr + table[t / block_size] * block_stride + (t % block_size) * token_stride + h * D;
      };
      value_pairs<D>(row, 16 * j, 16 * (j + 1), tokens, v.at(h, j));
    }
  });
}
#endif

#if defined(__AVX512BF16__)
constexpr int kRows = 16;  // query rows scored together against one group of keys in lanes

#if defined(PDSERVE_AMX)
// The unscaled sums (AMX's chain over the D/2 pairs, 16 a tile, in order: the decode kernel's
// score_sequence_amx bits, which the bf16 softmax takes: exp_to_bf16 applies the scale) of rows [from, rows) of `qbuf` (D
// apart, padded with zero rows to a multiple of kRows; `from` a multiple of kRows) against one
// group of 16 keys in lanes `kt`, stored as they come off the tiles: row block b's 16 rows of
// 16 lanes (those past the group's tokens too) at sums + b * block_step, 64 bytes a row. Up to
// 4 row blocks at a time, each in its own C tile (0, 3, 4, 5), so that their chains of
// instructions overlap; A tiles 1 and 6 and B tiles 2 and 7 in turn. The calling thread's
// TileScope has 16 rows a tile.
template <int64_t D>
inline void score_group_amx(const __m512i* kt, const c10::BFloat16* qbuf, int64_t from, int64_t rows, float* sums,
                            int64_t block_step) {
  constexpr int64_t P = D / 2;
  static_assert(P % 16 == 0, "whole tiles of pairs");
  for (int64_t r0 = from; r0 < rows; r0 += 4 * kRows) {
    const int blocks = static_cast<int>(std::min<int64_t>(4, (rows - r0 + kRows - 1) / kRows));
    float* out = sums + r0 / kRows * block_step;
    constexpr int64_t out_stride = 64;
    const int64_t block = block_step;
    // tile numbers must be constants: each count of row blocks is its own sequence
    auto run = [&](auto count) {
      constexpr int nb = decltype(count)::value;
      _tile_zero(0);
      if constexpr (nb >= 2) _tile_zero(3);
      if constexpr (nb >= 3) _tile_zero(4);
      if constexpr (nb >= 4) _tile_zero(5);
      for (int64_t c = 0; c < P; c += 16) {
        const c10::BFloat16* a = qbuf + r0 * D + 2 * c;
        const int bt = (c / 16) % 2 == 0 ? 2 : 7;  // B tiles by turns (tile numbers are immediates: branches)
        if (bt == 2) _tile_loadd(2, kt + c, 64); else _tile_loadd(7, kt + c, 64);
        _tile_loadd(1, a, D * 2);
        if (bt == 2) _tile_dpbf16ps(0, 1, 2); else _tile_dpbf16ps(0, 1, 7);
        if constexpr (nb >= 2) {
          _tile_loadd(6, a + kRows * D, D * 2);
          if (bt == 2) _tile_dpbf16ps(3, 6, 2); else _tile_dpbf16ps(3, 6, 7);
        }
        if constexpr (nb >= 3) {
          _tile_loadd(1, a + 2 * kRows * D, D * 2);
          if (bt == 2) _tile_dpbf16ps(4, 1, 2); else _tile_dpbf16ps(4, 1, 7);
        }
        if constexpr (nb >= 4) {
          _tile_loadd(6, a + 3 * kRows * D, D * 2);
          if (bt == 2) _tile_dpbf16ps(5, 6, 2); else _tile_dpbf16ps(5, 6, 7);
        }
      }
      _tile_stored(0, out, out_stride);
      if constexpr (nb >= 2) _tile_stored(3, out + block, out_stride);
      if constexpr (nb >= 3) _tile_stored(4, out + 2 * block, out_stride);
      if constexpr (nb >= 4) _tile_stored(5, out + 3 * block, out_stride);
    };
    switch (blocks) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{});
    }
  }
}
#endif

// A call's keys put in lanes once for all its query tiles (keys_in_lanes_of each group of 16
// positions, 16g to 16g + 15, per kv head): made per query tile, the transposes and the
// scattered reads of K behind them were repeated by every tile.
template <int64_t D>
struct LaneKeys {
  std::vector<__m512i> groups;  // [kv_head][group][D / 2]
  int64_t num_groups = 0;
  const __m512i* at(int64_t h, int64_t g) const { return groups.data() + (h * num_groups + g) * (D / 2); }
  __m512i* at(int64_t h, int64_t g) { return groups.data() + (h * num_groups + g) * (D / 2); }
};

template <int64_t D>
void make_lane_keys(const c10::BFloat16* k_ptr, const int64_t* table, int64_t tokens, int64_t num_kv_heads,
                    int64_t block_size, LaneKeys<D>& keys) {
  const int64_t token_stride = num_kv_heads * D, block_stride = block_size * token_stride;
  keys.num_groups = (tokens + 15) / 16;
  grow(keys.groups, num_kv_heads * keys.num_groups * (D / 2));
  at::parallel_for(0, num_kv_heads * keys.num_groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t h = k / keys.num_groups, first = k % keys.num_groups * 16;
      const auto row = [&](int64_t t) {
        const int64_t pos = first + t;
        return k_ptr + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + h * D;
      };
      keys_in_lanes_of<D>(row, std::min<int64_t>(16, tokens - first), keys.at(h, k % keys.num_groups));
    }
  });
}

// The tile's rows of kv head `kv_head`'s group (query i's head kv_head * group + j is row
// i * group + j) from `q` (the tile's first query's row of head 0) into `qbuf`, padded with
// zero rows to a multiple of kRows.
template <int64_t D>
inline void tile_rows(const c10::BFloat16* q, int64_t nq, int64_t num_heads, int64_t group, int64_t kv_head,
                      std::vector<c10::BFloat16>& qbuf) {
  qbuf.assign((nq * group + kRows - 1) / kRows * kRows * D, c10::BFloat16(0.f));
  for (int64_t i = 0; i < nq; ++i)
    std::copy_n(q + (i * num_heads + kv_head * group) * D, group * D, qbuf.data() + i * group * D);
}

// The first row (a multiple of kRows) whose query reaches the key at `pos`: query i attends to
// the first ctx0 + i tokens, and row r is query r / group.
inline int64_t first_row(int64_t pos, int64_t ctx0, int64_t group) {
  return std::max<int64_t>(0, pos + 1 - ctx0) * group / kRows * kRows;
}

// The scaled scores of the rows of `qbuf` (tile_rows; `rows` of them, query i attending to the
// first ctx0 + i tokens, the last to ctx_max) for kv head `kv_head`, keys in lanes (score_rows,
// as the decode kernel scores): row r's at scores + r * stride, each group of 16 keys scored
// against all the rows that reach it, kRows at a time.
template <int64_t D>
inline void score_kv_head_bf16(const c10::BFloat16* qbuf, int64_t rows, int64_t group, int64_t kv_head,
                               const LaneKeys<D>& keys, int64_t ctx0, int64_t ctx_max, float scale, float* scores,
                               int64_t stride) {
  for (int64_t pos = 0; pos < ctx_max; pos += 16) {
    const __m512i* kt = keys.at(kv_head, pos / 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, ctx_max - pos)) - 1);
    for (int64_t r0 = first_row(pos, ctx0, group); r0 < rows; r0 += kRows) {
      __m512 s[1][kRows];
      score_rows<D, kRows, 1>(kt, qbuf + r0 * D, D, scale, s);
      for (int r = 0; r < kRows && r0 + r < rows; ++r) _mm512_mask_storeu_ps(scores + (r0 + r) * stride + pos, mask, s[0][r]);
    }
  }
}

#if defined(PDSERVE_AMX)
constexpr int64_t kBlocksAtOnce = 2;  // row blocks of 16 taken through all three passes together (weigh_tile_pair_amx)

// The largest unscaled sum of each of a block's 16 rows over its own first len[i] tokens
// (`sums`: group g's 16 rows of 16 lanes at sums + 256 g; exact in any order): the groups all
// the rows take, 16 rows at a time from contiguous memory (16 independent chains, where one
// row's walk waited on a load 1 KB from the last for every group), then each row's last ones.
inline void block_row_max(const float* sums, const int64_t (&len)[kRows], float (&max)[kRows]) {
  __m512 m[kRows];
  for (auto& x : m) x = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t shortest = *std::min_element(len, len + kRows);
  int64_t t = 0;
  for (; t + 16 <= shortest; t += 16)
    for (int i = 0; i < kRows; ++i) m[i] = _mm512_max_ps(m[i], _mm512_loadu_ps(sums + t * 16 + i * 16));
  for (int i = 0; i < kRows; ++i) {
    for (int64_t u = t; u < len[i]; u += 16) {
      const __mmask16 k = len[i] - u >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len[i] - u)) - 1);
      m[i] = _mm512_mask_max_ps(m[i], k, m[i], _mm512_loadu_ps(sums + u * 16 + i * 16));
    }
    max[i] = _mm512_reduce_max_ps(m[i]);
  }
}

// One row's unscaled sums (`sums`: 16 lanes a group of keys, group g's at sums + 256 g; its
// first `len` tokens its own, the largest `max_sum`) to its bf16 weights as rows of A tiles
// (`probs`: tokens 32j to 32j + 31 at probs + 512 j), zero from `len` up to `reach` (a multiple
// of 32), by exp_to_bf16, the arithmetic of exp_row_to_bf16 on the decode kernel's scores.
// Returns 1/sum of the weights.
inline float tile_row_weights(const float* sums, int64_t len, float max_sum, int64_t reach, float scale,
                              uint16_t* probs) {
  float inv_sum = 0.f;
  if (len > 0)  // whole rows of 32 (zero past len)
    inv_sum = exp_to_bf16([&](int64_t t, __mmask16 m) { return _mm512_maskz_loadu_ps(m, sums + t * 16); }, len,
                          max_sum, scale,
                          [&](int64_t t, __m512i w, __mmask32) { _mm512_storeu_si512(probs + t * 16, w); });
  for (int64_t t = (len + 31) / 32 * 32; t < reach; t += 32)  // past its tokens: zero
    _mm512_storeu_si512(probs + t * 16, _mm512_setzero_si512());
  return inv_sum;
}

constexpr int64_t kTilesAhead = 4;  // tiles of V (or groups of keys) fetched ahead of their use

// Into L1: `lines` cache lines from each of a tile's 16 rows (`p` the first, rows `stride` bytes apart).
inline void prefetch_lines(const void* p, int64_t stride, int64_t lines) {
  const char* c = static_cast<const char*>(p);
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(c + r * stride + 64 * l, _MM_HINT_T0);
}

// weigh_tiles_amx for two blocks of 16 rows at once, each tile of V pairs loaded once for both
// (`probs0_of(j)`, `probs1_of(j)`: the blocks' weights of tile j as A tiles, rows 64 bytes
// apart; sums into acc0 and acc1): 16 dims x 2 at a time, C tiles 0 and 3 the first block's,
// 4 and 5 the second's; A tiles 1 and 6, B tiles 2 and 7. Per C tile the same instructions in
// the same order as weigh_tiles_amx, so the same bits; a block's weights past its own reach
// must be zero up to `tiles`. Taken one block at a time, every 16 rows read all of their V
// again: at 8,000 tokens, from L3.
template <int64_t D, typename ProbsOf, typename PairsOf>
inline void weigh_tile_pair_amx(const ProbsOf& probs0_of, const ProbsOf& probs1_of, const PairsOf& pairs_of,
                                int64_t tiles, float* acc0, float* acc1) {
  constexpr int64_t C = D / 16;  // even: D is a multiple of 32
  constexpr int64_t kB = C * 64;  // bytes between a tile's pairs
  for (int64_t c0 = 0; c0 < C; c0 += 2) {
    float *a0 = acc0 + 16 * c0, *a1 = acc1 + 16 * c0;
    _tile_loadd(0, a0, D * 4);
    _tile_loadd(3, a0 + 16, D * 4);
    _tile_loadd(4, a1, D * 4);
    _tile_loadd(5, a1 + 16, D * 4);
    for (int64_t j = 0; j < tiles; ++j) {
      const uint16_t* b = pairs_of(j) + c0 * 32;
      if (j + kTilesAhead < tiles) prefetch_lines(pairs_of(j + kTilesAhead) + c0 * 32, kB, 2);
      _tile_loadd(2, b, kB);
      _tile_loadd(7, b + 32, kB);
      _tile_loadd(1, probs0_of(j), 64);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(3, 1, 7);
      _tile_loadd(6, probs1_of(j), 64);
      _tile_dpbf16ps(4, 6, 2);
      _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(0, a0, D * 4);
    _tile_stored(3, a0 + 16, D * 4);
    _tile_stored(4, a1, D * 4);
    _tile_stored(5, a1 + 16, D * 4);
  }
}

// prefill_tile_bf16's kv head on AMX, its rows in blocks of 16 as the tiles take them,
// kBlocksAtOnce blocks at a time through all three passes: their scores group by group
// (score_group_amx, into `buf.scores` [block][group][16 rows][16 lanes]), each row's weights
// (block_row_max, tile_row_weights, into `buf.probs16` [block][tile of 32 tokens][16 rows][32]),
// and P.V of the blocks over the tiles their last row reaches (weigh_tile_pair_amx, the sums
// kept on the tiles, V from `values`) into `buf.acc`; each row's 1/sum into `buf.norms`. The
// next key groups and V tiles are fetched kTilesAhead ahead. Every tile is
// stored and loaded as 1 KB of contiguous memory, and a block pair's scores (32 rows, 1 MB at
// 8,000 tokens) stay in L2 between the passes: rows of scores `ctx + 16` long, 16 lines
// 32 KB apart per tile, all 96 rows' at once (4.5 MB with their weights), went to L3 and back.
template <int64_t D>
inline void attend_kv_head_amx(const c10::BFloat16* qbuf, int64_t rows, int64_t group, int64_t kv_head,
                               const LaneKeys<D>& keys, const ValueTiles<D>& values, int64_t ctx0, int64_t ctx_max,
                               float scale, TileBuffers& buf) {
  const int64_t groups = (ctx_max + 15) / 16, tiles = (ctx_max + 31) / 32, blocks = (rows + kRows - 1) / kRows;
  buf.scores.resize(kBlocksAtOnce * groups * 256);
  buf.probs16.resize(kBlocksAtOnce * tiles * 512);
  for (int64_t b0 = 0; b0 < blocks; b0 += kBlocksAtOnce) {
    const int64_t b1 = std::min(blocks, b0 + kBlocksAtOnce), end = std::min(rows, b1 * kRows);
    for (int64_t g = 0; g < groups; ++g) {
      if (g + kTilesAhead < groups) prefetch_lines(keys.at(kv_head, g + kTilesAhead), 64 * (D / 32), D / 32);
      const int64_t from = std::max(first_row(16 * g, ctx0, group), b0 * kRows);
      if (from < end)
        score_group_amx<D>(keys.at(kv_head, g), qbuf + b0 * kRows * D, from - b0 * kRows, end - b0 * kRows,
                           buf.scores.data() + g * 256, groups * 256);
    }
    // the tokens the blocks' last row reaches, in whole tiles: every row's weights up to there
    const int64_t reach = (ctx0 + (end - 1) / group + 31) / 32 * 32;
    const auto probs_of = [&](int64_t b) { return buf.probs16.data() + (b - b0) * tiles * 512; };
    for (int64_t b = b0; b < b1; ++b) {
      const float* sums = buf.scores.data() + (b - b0) * groups * 256;
      int64_t len[kRows];  // each row's tokens (a padding row's none)
      for (int64_t i = 0; i < kRows; ++i) len[i] = b * kRows + i < rows ? ctx0 + (b * kRows + i) / group : 0;
      float max_sum[kRows];
      block_row_max(sums, len, max_sum);
      for (int64_t i = 0; i < kRows; ++i) {
        const float inv_sum = tile_row_weights(sums + i * 16, len[i], max_sum[i], reach, scale, probs_of(b) + i * 32);
        if (len[i] > 0) buf.norms[b * kRows + i] = inv_sum;
      }
    }
    const auto pairs_of = [&](int64_t j) { return values.at(kv_head, j); };
    const auto tile_of = [&](int64_t b) { return [p = probs_of(b)](int64_t j) { return p + j * 512; }; };
    if (b1 - b0 == 2)
      weigh_tile_pair_amx<D>(tile_of(b0), tile_of(b0 + 1), pairs_of, reach / 32, buf.acc.data() + b0 * kRows * D,
                             buf.acc.data() + (b0 + 1) * kRows * D);
    else
      weigh_tiles_amx<D>(tile_of(b0), 32, pairs_of, reach / 32, buf.acc.data() + b0 * kRows * D);
  }
}
#endif

// A tile of `nq` queries (`q0` the first, at position start_pos + q0) attended in bf16 with
// avx512_bf16 (D a multiple of 32), one kv head at a time so that the tile's scores (rows of
// its group only: nq * group, query-major) stay in the L2 cache between the passes: scores,
// bf16 exps, V weighed, the weighted sums times 1/sum into `out`. On AMX (`values` given)
// attend_kv_head_amx; otherwise score_kv_head_bf16, exp_row_to_bf16 and V weighed by spans
// (weigh_span_bf16). The arithmetic per token is the decode kernel's.
template <int64_t D>
inline void prefill_tile_bf16(const c10::BFloat16* q_ptr, const LaneKeys<D>& keys, const c10::BFloat16* v_ptr,
                              const ValueTiles<D>* values, const int64_t* table, c10::BFloat16* out_ptr, int64_t q0,
                              int64_t nq, int64_t start_pos, int64_t num_heads, int64_t num_kv_heads,
                              int64_t block_size, float scale, TileBuffers& buf) {
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride, rows = nq * group;
  const int64_t ctx0 = start_pos + q0 + 1, ctx_max = start_pos + q0 + nq;
  const int64_t num_blocks = (ctx_max + block_size - 1) / block_size;
  const int64_t span_blocks = block_size % 2 == 0 ? std::max<int64_t>(1, kSpanTokens / block_size) : 1;
  const int64_t p_stride = ctx_max + 1;
  buf.norms.resize(rows);
  buf.query_of.resize(rows);
  buf.row_of.resize(rows);
  for (int64_t r = 0; r < rows; ++r) buf.query_of[r] = r / group, buf.row_of[r] = r;
  for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
    tile_rows<D>(q_ptr + q0 * num_heads * D, nq, num_heads, group, kv_head, buf.qbuf);
#if defined(PDSERVE_AMX)
    if (values != nullptr) {
      buf.acc.assign((rows + kRows - 1) / kRows * kRows * D, 0.f);
      attend_kv_head_amx<D>(buf.qbuf.data(), rows, group, kv_head, keys, *values, ctx0, ctx_max, scale, buf);
    } else
#endif
    {
      buf.scores.resize(rows * ctx_max);
      buf.probs16.resize(rows * p_stride);
      score_kv_head_bf16<D>(buf.qbuf.data(), rows, group, kv_head, keys, ctx0, ctx_max, 1.f, buf.scores.data(),
                            ctx_max);  // unscaled: exp_row_to_bf16 scales
      for (int64_t r = 0; r < rows; ++r)
        buf.norms[r] = exp_row_to_bf16(buf.scores.data() + r * ctx_max, ctx0 + buf.query_of[r], scale,
                                       buf.probs16.data() + r * p_stride);
      buf.acc.assign(rows * D, 0.f);
      for (int64_t blk = 0; blk < num_blocks; blk += span_blocks) {
        const int64_t first = blk * block_size, nblocks = std::min(span_blocks, num_blocks - blk);
        const c10::BFloat16* spans[kSpanTokens];
        for (int64_t b = 0; b < nblocks; ++b) spans[b] = v_ptr + table[blk + b] * block_stride + kv_head * D;
        if (blk + nblocks < num_blocks)
          prefetch_head(v_ptr + table[blk + nblocks] * block_stride + kv_head * D, token_stride, block_size, D);
        const int64_t span_tokens = std::min(nblocks * block_size, ctx_max - first);
        weigh_span_bf16<D>(spans, token_stride, block_size, span_tokens, first, ctx0, nq, 0, group,
                           buf.probs16.data(), p_stride, buf.acc.data(), buf.full, buf.single, buf.query_of.data(),
                           buf.row_of.data());
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = buf.query_of[r], h = kv_head * group + r - i * group;
      c10::BFloat16* o = out_ptr + ((q0 + i) * num_heads + h) * D;
      alignas(64) float row[D];  // as the decode kernel: the weighted sum times 1/sum, then converted
      for (int64_t c = 0; c < D; c += 16)
        _mm512_store_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(buf.acc.data() + r * D + c), _mm512_set1_ps(buf.norms[r])));
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<c10::BFloat16>(row[d]);
    }
  }
}
#else
template <int64_t D>
struct LaneKeys {};  // (keys in lanes: bf16 with avx512_bf16 only)
#endif

// A tile of `nq` queries (`q0` the first) attended in the other dtypes (fp32, fp16; bf16 whose
// head size is not a multiple of 32), one kv head at a time as in bf16, so that the tile's
// scores are the rows of one head group (nq * group, query-major). Both passes walk the
// sequence a span of kSpanTokens at a time, every row taking the span while its K (or V) is
// in L1: each row's scores and probabilities are then read and written as runs of the span,
// not a block's 16 floats here and there in a buffer of megabytes (at 6,144 tokens, the
// probabilities times V ran 1.5x slower that way, waiting on those reads). Per token the
// arithmetic is the decode kernel's: its scores (bf16: score_rows, keys in lanes; else
// score_lanes_rows, two rows per load of a key with AVX-512), softmax_rows over the row, and V weighed token
// by token in position order (weigh_block, kRowsF rows that take the same tokens at a time).
template <typename T, int64_t D>
inline void prefill_tile(const T* q_ptr, const T* k_ptr, const LaneKeys<D>* keys, const T* v_ptr, const int64_t* table,
                         T* out_ptr, int64_t q0, int64_t nq, int64_t start_pos, int64_t num_heads, int64_t num_kv_heads,
                         int64_t block_size, float scale, TileBuffers& buf) {
  constexpr int64_t C = D / kLanes;  // vectors per head row
  constexpr int64_t kRowsF = std::clamp<int64_t>(kAccumulators / C, 1, 8);  // rows weighed together
  const int64_t group = num_heads / num_kv_heads, token_stride = num_kv_heads * D;
  const int64_t block_stride = block_size * token_stride, rows = nq * group;
  const int64_t ctx0 = start_pos + q0 + 1, ctx_max = start_pos + q0 + nq;  // the first and last query's context
  const int64_t num_blocks = (ctx_max + block_size - 1) / block_size;
  const int64_t span_blocks = std::max<int64_t>(1, kSpanTokens / block_size);
  buf.scores.resize(rows * ctx_max);
  buf.values.resize(span_blocks * block_size * D);
  std::vector<float> inv_sums(1);
  auto query_head = [&](int64_t r, int64_t kv_head) { return (q0 + r / group) * num_heads + kv_head * group + r % group; };
  for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      tile_rows<D>(q_ptr + q0 * num_heads * D, nq, num_heads, group, kv_head, buf.qbuf);
      score_kv_head_bf16<D>(buf.qbuf.data(), rows, group, kv_head, *keys, ctx0, ctx_max, scale, buf.scores.data(),
                            ctx_max);
    } else
#endif
    for (int64_t blk0 = 0; blk0 < num_blocks; blk0 += span_blocks) {  // scores, span by span
      const int64_t blk1 = std::min(num_blocks, blk0 + span_blocks), first = blk0 * block_size;
      for (int64_t b = blk1; b < std::min(num_blocks, blk1 + span_blocks); ++b)
        prefetch_row(k_ptr + table[b] * block_stride + kv_head * D, block_stride - kv_head * D);
      for (int64_t r = 0; r < rows; r += 2) {  // rows two at a time (score_block_rows)
        const bool two = r + 1 < rows;
        const int64_t ctx_a = ctx0 + r / group, ctx_b = two ? ctx0 + (r + 1) / group : ctx_a;
        if (ctx_b <= first) continue;
        const Dot<T, D> dots[2] = {Dot<T, D>(q_ptr + query_head(r, kv_head) * D),
                                   Dot<T, D>(q_ptr + query_head(two ? r + 1 : r, kv_head) * D)};
        float* row = buf.scores.data() + r * ctx_max;
        for (int64_t blk = blk0; blk < blk1 && blk * block_size < ctx_b; ++blk) {
          const int64_t at = blk * block_size;
          score_block_rows(dots, two, k_ptr + table[blk] * block_stride + kv_head * D, token_stride,
                           std::clamp<int64_t>(ctx_a - at, 0, block_size), std::min(block_size, ctx_b - at), scale,
                           row + at, two ? row + ctx_max + at : nullptr);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) softmax_rows(buf.scores.data() + r * ctx_max, 1, ctx0 + r / group, inv_sums);
    buf.acc.assign(rows * D, 0.f);
    for (int64_t blk0 = 0; blk0 < num_blocks; blk0 += span_blocks) {  // probabilities times V, span by span
      const int64_t blk1 = std::min(num_blocks, blk0 + span_blocks), first = blk0 * block_size;
      const int64_t span_tokens = std::min(blk1 * block_size, ctx_max) - first;
      for (int64_t t = 0; t < span_tokens; ++t) {  // the span's V rows of this kv head, in fp32
        const int64_t pos = first + t;
        const T* value = v_ptr + table[pos / block_size] * block_stride + (pos % block_size) * token_stride + kv_head * D;
        for (int64_t c = 0; c < C; ++c) vstore(&buf.values[t * D + kLanes * c], vload(value + kLanes * c));
      }
      for (int64_t b = blk1; b < std::min(num_blocks, blk1 + span_blocks); ++b)
        prefetch_row(v_ptr + table[b] * block_stride + kv_head * D, block_stride - kv_head * D);
      auto count_of = [&](int64_t r) { return std::clamp<int64_t>(ctx0 + r / group - first, 0, span_tokens); };
      auto weigh = [&](int64_t r, int64_t count, auto nrows) {
        constexpr int64_t NR = decltype(nrows)::value;
        const float* probs[NR];
        float* sums[NR];
        for (int64_t k = 0; k < NR; ++k) probs[k] = buf.scores.data() + (r + k) * ctx_max + first, sums[k] = buf.acc.data() + (r + k) * D;
        weigh_block<float, D, NR>(buf.values.data(), D, count, probs, sums);
      };
      for (int64_t r = 0; r < rows;) {  // kRowsF rows at a time where they take the same tokens
        const int64_t count = count_of(r);
        if (r + kRowsF <= rows && count > 0 && count_of(r + kRowsF - 1) == count) {
          weigh(r, count, std::integral_constant<int64_t, kRowsF>{});
          r += kRowsF;
          continue;
        }
        if (count > 0) weigh(r, count, std::integral_constant<int64_t, 1>{});
        ++r;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const float* a = buf.acc.data() + r * D;
      T* o = out_ptr + query_head(r, kv_head) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(a[d]);
    }
  }
}

template <typename T, int64_t D>
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, int64_t start_pos, double scale, int64_t tile_size,
                       at::Tensor& out) {
  const int64_t n = q.size(0), num_heads = q.size(1), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const T *q_ptr = q.data_ptr<T>(), *k_ptr = k_cache.data_ptr<T>(), *v_ptr = v_cache.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const int64_t num_tiles = (n + tile_size - 1) / tile_size;
  // K in lanes and V in AMX tiles for the whole prefix, made once for every tile (bf16)
  // (the calling thread's, kept from call to call: allocated afresh, their pages were faulted
  // in and zeroed for every layer's call; bound to references here, which the threads' lambda
  // captures: by their own names the threads would reach their own, empty, thread_locals)
  static thread_local LaneKeys<D> thread_keys;
  static thread_local ValueTiles<D> thread_values;
  LaneKeys<D>& keys = thread_keys;
  ValueTiles<D>& values = thread_values;
  bool on_tiles = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    make_lane_keys<D>(k_ptr, table, start_pos + n, num_kv_heads, block_size, keys);
#if defined(PDSERVE_AMX)
    if constexpr (D % 32 == 0) {
      on_tiles = values_on_tiles<D>();
      if (on_tiles) make_value_tiles<D>(v_ptr, table, start_pos + n, num_kv_heads, block_size, values);
    }
#endif
  }
#endif
  at::parallel_for(0, num_tiles, 1, [&](int64_t begin, int64_t end) {
    const TileScope tiles;
    TileBuffers buf;
    for (int64_t k = begin; k < end; ++k) {
      const int64_t q0 = balanced_tile(k, num_tiles) * tile_size, nq = std::min(tile_size, n - q0);
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16> && D % 32 == 0) {
        prefill_tile_bf16<D>(q_ptr, keys, v_ptr, on_tiles ? &values : nullptr, table, out_ptr, q0, nq, start_pos,
                             num_heads, num_kv_heads, block_size, fscale, buf);
        continue;
      }
#endif
      prefill_tile<T, D>(q_ptr, k_ptr, &keys, v_ptr, table, out_ptr, q0, nq, start_pos, num_heads, num_kv_heads,
                         block_size, fscale, buf);
    }
  });
}

}  // namespace fast
#endif  // PDSERVE_VECTOR_ATTENTION

}  // namespace

// Whether this build tiles the prefill (a vector build: AVX-512, or AVX2 with FMA and F16C).
bool tiled_prefill() {
#if defined(PDSERVE_VECTOR_ATTENTION)
  return true;
#else
  return false;
#endif
}

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
#if defined(PDSERVE_VECTOR_ATTENTION)
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
