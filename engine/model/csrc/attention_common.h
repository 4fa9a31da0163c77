// What the CPU attention kernels share (paged_attention.cpp: decode; paged_prefill.cpp:
// prefill): the softmax's row operations, the vector loads, dot products and score
// reduction. A token's attention output must be the same bits whichever kernel computes it,
// so every operation that touches its numbers lives here, once.
//
// The vector kernels are written once over `vfloat`, kLanes fp32 lanes: 16 (__m512) in an
// AVX-512 build, 8 (__m256) in an AVX2 build (with FMA and F16C, as every AVX2 CPU since
// Haswell has). A build with neither runs the portable decode kernel. Bits agree between the
// kernels of one build; an AVX2 build's bits differ from an AVX-512 build's (the lanes add up
// in another tree).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PDSERVE_VECTOR_ATTENTION 1
#include <immintrin.h>
#endif

#include "amx.h"
#include "vector_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace pdserve_attention {


template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// Blocks sit at random places in the cache; fetch the next block's row while this one is used.
template <typename T>
inline void prefetch_row(const T* row, int64_t count) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
}
// The same into L2 only: for blocks needed after the current pass (this sequence's V while its
// K is scored, the next sequence's K while this one's V is weighed), so the memory system
// stays busy across passes. 12% faster over randomly placed blocks, no change when in order.
template <typename T>
inline void prefetch_l2(const T* row, int64_t count) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 2);
}

// Into L1, one kv head's rows (`width` elements each, `stride` apart) of `tokens` tokens from `first`:
// the lines a pass over that head reads, not the block's other heads'.
template <typename T>
inline void prefetch_head(const T* first, int64_t stride, int64_t tokens, int64_t width) {
  for (int64_t t = 0; t < tokens; ++t) prefetch_row(first + t * stride, width);
}

// Reads one word of every cache line of `count` elements at `p`, in ascending order, and
// nothing more. The kernels read a block's rows one kv head at a time, which jumps through
// the block in strides of a token's row; the hardware's stream prefetcher does not follow
// that pattern, and memory then waits on the arithmetic. Touching the block's lines in
// order first starts the stream, so the lines after them arrive while this block is
// computed (software prefetches of the same lines, in place of the touch, were slower:
// benchmarks/README.md, "decode attention").
template <typename T>
inline void touch_in_order(const T* p, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(p);
  int32_t sink = 0;
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(T)); off += 64) {
    int32_t word;
    __builtin_memcpy(&word, bytes + off, sizeof(word));
    sink |= word;
  }
  asm volatile("" : : "r"(sink));
}

#if defined(PDSERVE_VECTOR_ATTENTION)
// The vector operations the kernels are written in, one definition per instruction set.
namespace simd {

#if defined(__AVX512F__)
using vfloat = __m512;
constexpr int64_t kLanes = 16;
constexpr int64_t kAccumulators = 16;  // registers a kernel keeps sums in: half of the 32

inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vfloat vload(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void vstore(float* p, vfloat x) { _mm512_storeu_ps(p, x); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }
// The first n (< kLanes) floats at p; the other lanes `fill`.
inline vfloat vload_first(const float* p, int64_t n, vfloat fill) {
  return _mm512_mask_loadu_ps(fill, first_lanes(n), p);
}
inline void vstore_first(float* p, vfloat x, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), x); }
inline vfloat vkeep_first(vfloat x, int64_t n) { return _mm512_maskz_mov_ps(first_lanes(n), x); }  // others 0
inline float vsum(vfloat x) { return _mm512_reduce_add_ps(x); }
inline float vmax_of(vfloat x) { return _mm512_reduce_max_ps(x); }
inline vfloat vexp(vfloat x) { return _ZGVeN16v_expf(x); }
// `x`, held in a register: a value loaded once and used by several FMAs is not folded into
// each of them as a load of its own (which the compiler prefers, and which left weigh_block
// bound by loads: 1.45x slower on a Zen 4 EPYC, benchmarks/README.md).
inline vfloat in_register(vfloat x) {
  asm("" : "+v"(x));
  return x;
}
#else
using vfloat = __m256;
constexpr int64_t kLanes = 8;
constexpr int64_t kAccumulators = 8;  // half of the 16 registers
extern "C" __m256 _ZGVdN8v_expf(__m256);  // libmvec

inline vfloat vzero() { return _mm256_setzero_ps(); }
inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
inline vfloat vload(const float* p) { return _mm256_loadu_ps(p); }
inline vfloat vload(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vfloat vload(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vstore(float* p, vfloat x) { _mm256_storeu_ps(p, x); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
inline vfloat vfmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vfloat vload_first(const float* p, int64_t n, vfloat fill) {
  const __m256i m = first_lanes(n);
  return _mm256_blendv_ps(fill, _mm256_maskload_ps(p, m), _mm256_castsi256_ps(m));
}
inline void vstore_first(float* p, vfloat x, int64_t n) {  // (vmaskmovps is slow: a plain store where it can)
  if (n == kLanes) _mm256_storeu_ps(p, x);
  else _mm256_maskstore_ps(p, first_lanes(n), x);
}
inline vfloat vkeep_first(vfloat x, int64_t n) { return _mm256_and_ps(x, _mm256_castsi256_ps(first_lanes(n))); }
inline float vsum(vfloat x) {  // halves, then pairs of the four, then the two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vmax_of(vfloat x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vfloat vexp(vfloat x) { return _ZGVdN8v_expf(x); }
inline vfloat in_register(vfloat x) {
  asm("" : "+x"(x));
  return x;
}
#endif
inline vfloat vload_first(const float* p, int64_t n) { return vload_first(p, n, vzero()); }
// A row's vector loaded for `Users` FMAs: held in a register (in_register) where several
// rows share it, or with AVX-512's 32 registers; with AVX2 and one user, left for the
// compiler to fold into the FMA, so the other operand can stay in registers instead.
template <int64_t Users, typename T>
inline vfloat load_for(const T* p) {
  if constexpr (Users > 1 || kLanes == 16) return in_register(vload(p));
  else return vload(p);
}

}  // namespace simd
#endif  // PDSERVE_VECTOR_ATTENTION

// The largest of `len` >= 1 floats (exact in any order, so taken kLanes at a time where the
// build has vectors; std::max_element is not vectorised).
inline float row_max(const float* s, int64_t len) {
#if defined(PDSERVE_VECTOR_ATTENTION)
  using namespace simd;
  vfloat m = vset1(s[0]);
  int64_t t = 0;
  for (; t + kLanes <= len; t += kLanes) m = vmax(m, vload(s + t));
  if (t < len) m = vmax(m, vload_first(s + t, len - t, m));
  return vmax_of(m);
#else
  return *std::max_element(s, s + len);
#endif
}

// Each of `rows` rows of `len` scores becomes, in place, exp(score - the row's max); the
// reciprocal of each row's sum goes to inv_sums[row]. With vectors every element goes
// through libmvec's kLanes-wide expf and the sum is taken kLanes lanes at a time from the
// row's first element, so a row's numbers never depend on where in memory it lies (a
// compiler's vectorised loop may peel a few elements to align them, through scalar expf and
// into another grouping of the sum: a prefill and a decode of one token then differed in the
// last bit).
inline void exp_rows(float* scores, int64_t rows, int64_t len, float* inv_sums) {
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * len;
#if defined(PDSERVE_VECTOR_ATTENTION)
    using namespace simd;
    const vfloat max_score = vset1(row_max(s, len));
    vfloat sum = vzero();
    int64_t t = 0;
    for (; t + kLanes <= len; t += kLanes) {
      const vfloat e = vexp(vsub(vload(s + t), max_score));
      vstore(s + t, e);
      sum = vadd(sum, e);
    }
    if (t < len) {
      const vfloat e = vexp(vsub(vload_first(s + t, len - t), max_score));
      vstore_first(s + t, e, len - t);
      sum = vadd(sum, vkeep_first(e, len - t));
    }
    inv_sums[h] = 1.f / vsum(sum);
#else
    const float max_score = row_max(s, len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {  // vectorised expf (libmvec)
      s[t] = expf(s[t] - max_score);
      sum += s[t];
    }
    inv_sums[h] = 1.f / sum;
#endif
  }
}

// Each of `rows` rows of `len` scores, in place, becomes its softmax.
inline void softmax_rows(float* scores, int64_t rows, int64_t len, std::vector<float>& inv_sums) {
  inv_sums.resize(rows);
  exp_rows(scores, rows, len, inv_sums.data());
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * len;
    const float inv = inv_sums[h];
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
}

// The tensors of one call as raw pointers and sizes, shared by both kernels.
template <typename T>
struct Operands {
  const T* q;
  const T* k;
  const T* v;
  const int64_t* tables;
  const int64_t* lens;
  T* out;
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, group, max_blocks, token_stride;
  Operands(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
           const at::Tensor& block_tables, const at::Tensor& ctx_lens, at::Tensor& out_)
      : q(q_.data_ptr<T>()), k(k_cache.data_ptr<T>()), v(v_cache.data_ptr<T>()),
        tables(block_tables.data_ptr<int64_t>()), lens(ctx_lens.data_ptr<int64_t>()), out(out_.data_ptr<T>()),
        num_seqs(q_.size(0)), num_heads(q_.size(1)), head_dim(q_.size(2)), block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)), group(num_heads / num_kv_heads), max_blocks(block_tables.size(1)),
        token_stride(num_kv_heads * head_dim) {}
};

// AMX's tiles configured on a thread while its share of a kernel runs (score_rows scores on
// them where the CPU has AMX); nothing elsewhere.
#if defined(PDSERVE_AMX)
using TileScope = amx::Scope;
#else
struct TileScope {
  explicit TileScope(int = 0) {}
};
#endif
constexpr int kDecodeTileRows = 4;  // the decode kernel's rows per tile (tiles 0, 1, 3-5): weigh_sequence_amx takes up to 4 heads

// `fn(begin, end)` on ranges of sequences [0, num_seqs), one range per thread, cut where the
// work (cached tokens to attend, plus kSequenceCost for a sequence's own overheads) is
// shared out evenly rather than the count of sequences: a batch whose long contexts sit
// together (a decode batch in arrival order) otherwise left one thread idle for a part of
// the step (benchmarks/README.md). A sequence's arithmetic does not depend on its range.
template <typename Fn>
inline void for_balanced_ranges(const int64_t* lens, int64_t num_seqs, Fn fn) {
  constexpr int64_t kSequenceCost = 32;
  const int64_t parts = std::min<int64_t>(at::get_num_threads(), num_seqs);
  if (parts <= 1) {
    const TileScope tiles(kDecodeTileRows);
    return fn(int64_t{0}, num_seqs);
  }
  std::vector<int64_t> cuts(parts + 1, num_seqs);
  int64_t total = 0, done = 0;
  for (int64_t b = 0; b < num_seqs; ++b) total += lens[b] + kSequenceCost;
  cuts[0] = 0;
  for (int64_t b = 0, p = 1; b < num_seqs && p < parts; ++b) {
    done += lens[b] + kSequenceCost;
    while (p < parts && done * parts >= total * p) cuts[p++] = b + 1;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    const TileScope tiles(kDecodeTileRows);
    for (int64_t p = begin; p < end; ++p)
      if (cuts[p] < cuts[p + 1]) fn(cuts[p], cuts[p + 1]);
  });
}

#if defined(PDSERVE_VECTOR_ATTENTION)
namespace simd {

// A query row in fp32 registers, for score_lanes_rows.
template <typename T, int64_t D>
struct Dot {
  vfloat q[D / kLanes];
  explicit Dot(const T* query) {
    for (int64_t c = 0; c < D / kLanes; ++c) q[c] = vload(query + kLanes * c);
  }
};

// The first `count` tokens of one block of V (`value`: the first token's row of one kv head,
// rows `token_stride` apart) weighed into NH fp32 output rows (`acc[j]`, D floats each) by
// their probabilities (`probs[j][t]` for token t), token by token in order, one FMA per token
// and kLanes dims. Both kernels weigh fp32 and fp16 V through this one function (the decode
// kernel NH heads of a sequence, the prefill kernel rows of several queries that reach the
// same tokens), so a token's output is the same bits in either; the NH x D/kLanes independent
// chains keep the FMA units busy where one row's D/kLanes would wait on the FMA's latency.
template <typename T, int64_t D, int64_t NH>
inline void weigh_block(const T* value, int64_t token_stride, int64_t count, const float* const (&probs)[NH],
                        float* const (&acc)[NH]) {
  constexpr int64_t C = D / kLanes;
  vfloat sum[NH][C];
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) sum[j][c] = vload(acc[j] + kLanes * c);
  for (int64_t i = 0; i < count; ++i, value += token_stride) {
    vfloat v[C];
    for (int64_t c = 0; c < C; ++c) v[c] = load_for<NH>(value + kLanes * c);
    for (int64_t j = 0; j < NH; ++j) {
      const vfloat p = vset1(probs[j][i]);
      for (int64_t c = 0; c < C; ++c) sum[j][c] = vfmadd(p, v[c], sum[j][c]);
    }
  }
  for (int64_t j = 0; j < NH; ++j)
    for (int64_t c = 0; c < C; ++c) vstore(acc[j] + kLanes * c, sum[j][c]);
}

#if defined(__AVX512BF16__)
// 16 rows of 16 dwords transposed in registers: afterwards r[j] lane i is what r[i] lane j was.
inline void transpose16x16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane L: rows 2k, 2k+1 at columns 4L..4L+3, interleaved
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k + m] lane L: rows 4k..4k+3 at column 4L + m
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // column 4L + m gathers lane L of u[m], u[4+m], u[8+m], u[12+m]
    const __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), w0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
    const __m512i v1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88),
                  w1 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_i32x4(v0, v1, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(v0, v1, 0xDD);
    r[4 + m] = _mm512_shuffle_i32x4(w0, w1, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(w0, w1, 0xDD);
  }
}

// Keys in lanes: up to 16 cached tokens' bf16 K rows of one kv head (`row(t)`: token t's row
// for that head) rearranged so that kt[p] (p < D/2) holds, in lane t, dims 2p and 2p+1 of
// token t; lanes past `n` are zero (those rows are never read).
template <int64_t D, typename Row>
inline void keys_in_lanes_of(const Row& row, int64_t n, __m512i* kt) {
  constexpr int64_t P = D / 2;  // bf16 pairs (dwords) per row
  for (int64_t c = 0; c < P; c += 16) {
    const __mmask16 cols = P - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (P - c)) - 1);
    __m512i r[16];
    for (int64_t t = 0; t < 16; ++t)
      r[t] = t < n ? _mm512_maskz_loadu_epi32(cols, row(t) + 2 * c) : _mm512_setzero_si512();
    transpose16x16(r);
    // stored one by one, unrolled: as a loop, the compiler made it a memcpy of the rows spilled
    // to the stack (with a vzeroupper), which took 9% of the decode kernel's time
#pragma GCC unroll 16
    for (int64_t j = 0; j < 16; ++j)
      if (j < P - c) _mm512_store_si512(kt + c + j, r[j]);
  }
}

// The same for keys `token_stride` apart from `key`.
template <int64_t D>
inline void keys_in_lanes(const c10::BFloat16* key, int64_t token_stride, int64_t n, __m512i* kt) {
  keys_in_lanes_of<D>([&](int64_t t) { return key + t * token_stride; }, n, kt);
}

// Two neighbouring bf16 (or uint16) values as one 32-bit word, the first in the low half.
inline int32_t pair_word(const void* p) {
  int32_t word;
  __builtin_memcpy(&word, p, sizeof(word));
  return word;
}

// acc + x . w in every lane, x's bf16 pairs times the pair `w` (the same in every lane): the
// one form in which both kernels multiply pairs, so that their bits agree. `w` comes second
// so that a pair read from memory becomes the instruction's broadcast operand.
inline __m512 dot_pair(__m512 acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); }
inline __m512bh pair_at(const void* p) { return (__m512bh)_mm512_set1_epi32(pair_word(p)); }

// The scaled scores of R query rows (bf16, `q_stride` elements apart) against NB groups of
// keys in lanes (group b at kt + b * D/2): out[b][r] lane t = scale * the chain of vdpbf16ps
// over the D/2 pairs in order (from zero) of row r with token t. A score depends only on its
// query row and its token's K row, not on R, NB, the grouping of tokens or the other rows,
// so every kernel that scores through this function gives a token the same bits. (The
// chain runs one instruction per pair; its latency is hidden by the R x NB independent
// chains, and no horizontal reduction is needed: 64 FLOPs per instruction.)
//
// With AMX (where the kernel grants it, and D a multiple of 32) both kernels score bf16 on
// tiles instead, AMX's chain for every score: the prefill kernel's score_group_amx
// (paged_prefill.cpp), the decode kernel's score_sequence_amx (paged_attention.cpp).
template <int64_t D, int R, int NB>
inline void score_rows(const __m512i* kt, const c10::BFloat16* q, int64_t q_stride, float scale,
                       __m512 (&out)[NB][R]) {
  constexpr int64_t P = D / 2;
  __m512 acc[NB][R];
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int64_t p = 0; p < P; ++p) {
    __m512bh k[NB];
    for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_loadu_si512(kt + b * P + p);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = pair_at(q + r * q_stride + 2 * p);
      for (int b = 0; b < NB; ++b) acc[b][r] = dot_pair(acc[b][r], k[b], w);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int b = 0; b < NB; ++b)
    for (int r = 0; r < R; ++r) out[b][r] = _mm512_mul_ps(acc[b][r], s);
}

#endif

// The steps of the tree that adds up a token's kLanes partial sums (score_lanes_rows): lanes
// 4m+{0,2} and 4m+{1,3} of two tokens' vectors (pair_step), those two of two pairs
// (quad_step: each 128-bit quarter then holds four tokens' sums of its lanes), then the
// quarters of the kLanes / 4 quads pairwise (quarters_sum: lane t the sum for token t).
inline vfloat pair_step(vfloat a, vfloat b) {
#if defined(__AVX512F__)
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
#else
  return _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
#endif
}
inline vfloat quad_step(vfloat a, vfloat b) {
#if defined(__AVX512F__)
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
#else
  const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
#endif
}
inline vfloat quarters_sum(const vfloat (&b)[kLanes / 4]) {
#if defined(__AVX512F__)
  __m512 c[2];
  for (int j = 0; j < 2; ++j)
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
#else
  return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
#endif
}

// The scaled scores of R query heads of one kv head (`dots[r]`: their q rows) against `n` <=
// kLanes consecutive cached tokens (`key`: the first one's row for that kv head), stored to
// outs[r][0..n): per token and head kLanes partial sums (lane l: q.k over dims l, l+kLanes,
// ... in order, from a product), then the lanes added by a fixed tree of in-register
// transposes (pair_step, quad_step, quarters_sum), built up four tokens at a time so that the
// R heads share each load of a key row (R = 2 halves the loads that the FMAs feed on). Both
// kernels score through this one function and a score's association is the same whatever R
// is, so a token's scores are the same bits in a decode and in a prefill, with one head or two.
template <int R, typename T, int64_t D>
inline void score_lanes_rows(const Dot<T, D>* dots, const T* key, int64_t token_stride, int64_t n, float scale,
                             float* const (&outs)[R]) {
  constexpr int64_t C = D / kLanes;
  vfloat b[R][kLanes / 4];
  for (int quad = 0; quad < kLanes / 4; ++quad) {  // tokens 4 quad .. 4 quad + 3
    vfloat a[R][2];
    for (int pair = 0; pair < 2; ++pair) {
      vfloat v[2][R];
      for (int u = 0; u < 2; ++u) {
        const int64_t t = 4 * quad + 2 * pair + u;
        if (n < kLanes && t >= n) {  // past the tokens: zero partial sums (the common n = kLanes skips the test)
          for (int r = 0; r < R; ++r) v[u][r] = vzero();
          continue;
        }
        vfloat k[C];
        const T* row = key + t * token_stride;
        for (int64_t c = 0; c < C; ++c) k[c] = load_for<R>(row + kLanes * c);
        for (int r = 0; r < R; ++r) {
          vfloat acc = vmul(dots[r].q[0], k[0]);
          for (int64_t c = 1; c < C; ++c) acc = vfmadd(dots[r].q[c], k[c], acc);
          v[u][r] = acc;
        }
      }
      for (int r = 0; r < R; ++r) a[r][pair] = pair_step(v[0][r], v[1][r]);
    }
    for (int r = 0; r < R; ++r) b[r][quad] = quad_step(a[r][0], a[r][1]);
  }
  const vfloat sc = vset1(scale);
  for (int r = 0; r < R; ++r) vstore_first(outs[r], vmul(quarters_sum(b[r]), sc), n);
}

// Whether two rows share each load of a key (score_lanes_rows<2>): with AVX-512's 32
// registers; AVX2's 16 cannot hold two rows of q beside the key, and its loads then outnumber
// its FMAs, so there each row is scored alone.
constexpr bool kPairRows = kLanes == 16;

// Two query heads of one kv head (`dots[0]`, `dots[1]`; `two` false: the first alone) scored
// against the tokens of one block (`key`: its first token's row for that kv head), the first
// against `count_a` of them into out_a, the second against `count_b` >= count_a into out_b:
// kLanes at a time, both heads together where they take the same tokens.
template <typename T, int64_t D>
inline void score_block_rows(const Dot<T, D> (&dots)[2], bool two, const T* key, int64_t token_stride,
                             int64_t count_a, int64_t count_b, float scale, float* out_a, float* out_b) {
  const int64_t count = two ? count_b : count_a;
  for (int64_t i0 = 0; i0 < count; i0 += kLanes) {
    const int64_t na = std::clamp<int64_t>(count_a - i0, 0, kLanes);
    const int64_t nb = two ? std::min<int64_t>(count_b - i0, kLanes) : 0;
    const T* k = key + i0 * token_stride;
    if (nb == na && kPairRows) {
      float* const outs[2] = {out_a + i0, out_b + i0};
      score_lanes_rows<2>(dots, k, token_stride, na, scale, outs);
      continue;
    }
    if (na > 0) {
      float* const outs[1] = {out_a + i0};
      score_lanes_rows<1>(dots, k, token_stride, na, scale, outs);
    }
    if (nb > 0) {
      float* const outs[1] = {out_b + i0};
      score_lanes_rows<1>(dots + 1, k, token_stride, nb, scale, outs);
    }
  }
}

#if defined(__AVX512BF16__)
// Two tokens' bf16 V rows (`second` null: a zero row) interleaved for vdpbf16ps: lanes 2i,
// 2i+1 of pairs[c] are dim 16c+i of the first row and of the second, so that one
// vdpbf16ps with (p[t], p[t+1]) in every lane weighs both tokens into 16 dims.
template <int64_t D>
inline void pair_rows(const c10::BFloat16* row, const c10::BFloat16* second, __m512bh (&pairs)[D / 16]) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t c = 0; c < D / 32; ++c) {
    const __m512i a = _mm512_loadu_si512(row + 32 * c);
    const __m512i b = second == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(second + 32 * c);
    pairs[2 * c] = (__m512bh)_mm512_permutex2var_epi16(a, lo, b);
    pairs[2 * c + 1] = (__m512bh)_mm512_permutex2var_epi16(a, hi, b);
  }
}

// The probability word of a pair: p[0] low, p[1] high; a single token's high half is 0.
inline __m512bh pair_weights(const uint16_t* p, bool single) {
  const uint32_t word = single ? p[0] : (static_cast<uint32_t>(p[1]) << 16) | p[0];
  return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(word));
}

// 2^x for x <= ~0, 16 lanes, inline (a call to libmvec spills the caller's registers):
// 2^n * 2^f with n = round(x), |f| <= 1/2, and 2^f by its degree-4 minimax polynomial
// (relative error 2.7e-6, a thousandth of bf16's rounding step); vscalefps gives 0 where 2^n
// underflows. The arithmetic's order is fixed here, so every caller gets the same bits.
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.570102207e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591785907e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402474433e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217909e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847e-1f));
  return _mm512_scalef_ps(p, n);
}

// 32 weights of a row as bf16 (tokens t to t + 31: the low 16 words from `lo`, the high from
// `hi`): 2^(sum * c - max_sum * c) for each unscaled sum, c = scale * log2 e, one FMA from the
// sum to the exponent (the scale and the max folded in).
inline __m512i exp_pair_to_bf16(__m512 lo, __m512 hi, __m512 c, __m512 bias) {
  return (__m512i)_mm512_cvtne2ps_pbh(exp2_16(_mm512_fmadd_ps(hi, c, bias)), exp2_16(_mm512_fmadd_ps(lo, c, bias)));
}

// One row of `len` unscaled scores (q.k sums; the largest `max_sum`) to the weights of bf16
// P.V: exp(scale * (sum - max_sum)) rounded to bf16, in one pass, 32 tokens at a time (the
// sum of the weights taken from the 32 words as they are, the even and the odd ones in two
// vectors, from the row's first element: the row's address changes nothing). Returns 1/sum of
// the rounded weights: the caller scales the weighted sum of V by it (as flash attention
// normalises at the end), so the rounded weights of a row sum to exactly one. `sums(t, mask)`:
// the 16 sums from t (those in `mask`; the row is read through it); `store(t, weights, mask)`:
// the 32 weights from t, zero from `len` on (`mask`: those before len). The scale is applied
// here, not to the sums: a rounded multiply and a subtraction per score fewer.
template <typename Sums, typename Store>
inline float exp_to_bf16(const Sums& sums, int64_t len, float max_sum, float scale, const Store& store) {
  const float c = scale * 1.44269504f;
  const __m512 vc = _mm512_set1_ps(c), bias = _mm512_set1_ps(-(max_sum * c));
  const __m512i high_words = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  const auto add = [&](__m512i w) {
    even = _mm512_add_ps(even, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    odd = _mm512_add_ps(odd, _mm512_castsi512_ps(_mm512_and_si512(w, high_words)));
  };
  constexpr __mmask16 kAll = static_cast<__mmask16>(0xFFFF);
  int64_t t = 0;
  for (; t + 32 <= len; t += 32) {
    const __m512i w = exp_pair_to_bf16(sums(t, kAll), sums(t + 16, kAll), vc, bias);
    store(t, w, static_cast<__mmask32>(0xFFFFFFFFu));
    add(w);
  }
  if (t < len) {
    const int64_t n = len - t;
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << n) - 1);
    const __mmask16 lo = static_cast<__mmask16>(m), hi = static_cast<__mmask16>(m >> 16);
    const __m512i w = _mm512_maskz_mov_epi16(m, exp_pair_to_bf16(sums(t, lo), sums(t + 16, hi), vc, bias));
    store(t, w, m);
    add(w);
  }
  return 1.f / _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
}

// The weights of a row of scores `s` (unscaled sums) into a row `o` (`len + 1` long, the last entry 0).
inline float exp_row_to_bf16(const float* s, int64_t len, float scale, uint16_t* o) {
  const float inv = exp_to_bf16([s](int64_t t, __mmask16 m) { return _mm512_maskz_loadu_ps(m, s + t); }, len,
                                row_max(s, len), scale,
                                [o](int64_t t, __m512i w, __mmask32 m) { _mm512_mask_storeu_epi16(o + t, m, w); });
  o[len] = 0;
  return inv;
}

#if defined(PDSERVE_AMX)
// Whether bf16 P.V runs on AMX tiles (weigh_tiles_amx) for head size D, in both kernels
// alike: where the kernel grants AMX and D is a multiple of 32 (whole tiles of pairs). Both
// kernels lay V out by token position (value_pairs), so any block size will do.
template <int64_t D>
inline bool values_on_tiles() {
  return D % 32 == 0 && amx::permitted();
}

// V of one kv head (`row(t)`: token t's bf16 row; n tokens) as AMX B tiles: pair p holds
// tokens 2p and 2p + 1 (pair_rows' vectors: lanes 2i, 2i + 1 of vector c are dim 16c + i of
// each), a last token's missing partner and the pairs past n zero, a tile 16 pairs
// ([16][D / 16][32]: tile j takes tokens 32j to 32j + 31). Writes pairs [p0, p1) to `to`
// (pair p0 first).
template <int64_t D, typename Row>
inline void value_pairs(const Row& row, int64_t p0, int64_t p1, int64_t n, uint16_t* to) {
  constexpr int64_t C = D / 16;
  for (int64_t p = p0; p < p1; ++p, to += C * 32) {
    if (2 * p >= n) {
      std::fill_n(to, C * 32, uint16_t{0});
      continue;
    }
    __m512bh v[C];
    pair_rows<D>(row(2 * p), 2 * p + 1 < n ? row(2 * p + 1) : nullptr, v);
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_si512(to + c * 32, (__m512i)v[c]);
  }
}

// A tile's rows (16, or TileScope's) of fp32 accumulators (`acc`, rows D apart) plus their
// bf16 probabilities times `tiles` tiles of V pairs, on AMX (the calling thread's TileScope):
// per 16 dims, one instruction per tile of 32 tokens, in order. `probs_of(j)`: the rows'
// probabilities of tokens 32j to 32j + 31 (rows `p_stride` apart, zero past a row's tokens);
// `pairs_of(j)`: tile j's 16 pairs (value_pairs' layout), asked for once per tile per 64 dims.
// A row's sums depend only on its own probabilities and the tokens' V: zero probabilities add
// nothing, whatever the V beside them, so a query weighed among others (prefill) or alone
// (decode) gets the same bits. Up to 4 groups of 16 dims at a time, each in its own C tile
// (0, 3, 4, 5), so that their chains of instructions overlap and each tile of probabilities
// (A: tile 1) is loaded once for them; B tiles 2, 6, 7 in turn.
template <int64_t D, typename ProbsOf, typename PairsOf>
inline void weigh_tiles_amx(const ProbsOf& probs_of, int64_t p_stride, const PairsOf& pairs_of, int64_t tiles,
                            float* acc) {
  constexpr int64_t C = D / 16;  // even: D is a multiple of 32
  constexpr int64_t kB = C * 64;  // bytes between a tile's pairs
  for (int64_t c0 = 0; c0 < C; c0 += 4) {
    const bool four = C - c0 >= 4;
    float* a = acc + 16 * c0;
    _tile_loadd(0, a, D * 4);
    _tile_loadd(3, a + 16, D * 4);
    if (four) {
      _tile_loadd(4, a + 32, D * 4);
      _tile_loadd(5, a + 48, D * 4);
    }
    for (int64_t j = 0; j < tiles; ++j) {
      const uint16_t* b = pairs_of(j) + c0 * 32;
      _tile_loadd(1, probs_of(j), p_stride * 2);
      _tile_loadd(2, b, kB);
      _tile_dpbf16ps(0, 1, 2);
      _tile_loadd(6, b + 32, kB);
      _tile_dpbf16ps(3, 1, 6);
      if (four) {
        _tile_loadd(7, b + 64, kB);
        _tile_dpbf16ps(4, 1, 7);
        _tile_loadd(2, b + 96, kB);
        _tile_dpbf16ps(5, 1, 2);
      }
    }
    _tile_stored(0, a, D * 4);
    _tile_stored(3, a + 16, D * 4);
    if (four) {
      _tile_stored(4, a + 32, D * 4);
      _tile_stored(5, a + 48, D * 4);
    }
  }
}
#endif
#endif

}  // namespace simd
#endif  // PDSERVE_VECTOR_ATTENTION

}  // namespace pdserve_attention
