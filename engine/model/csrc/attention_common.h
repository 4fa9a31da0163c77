// What the CPU attention kernels share (paged_attention.cpp: decode; paged_prefill.cpp:
// prefill): the softmax's row operations, the AVX-512 loads, dot products and score
// reduction. A token's attention output must be the same bits whichever kernel computes it,
// so every operation that touches its numbers lives here, once.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// The largest of `len` >= 1 floats (exact in any order, so taken 16 at a time where the
// build has AVX-512; std::max_element is not vectorised).
inline float row_max(const float* s, int64_t len) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(s[0]);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  if (t < len) m = _mm512_mask_max_ps(m, static_cast<__mmask16>((1u << (len - t)) - 1), m, _mm512_maskz_loadu_ps(
      static_cast<__mmask16>((1u << (len - t)) - 1), s + t));
  return _mm512_reduce_max_ps(m);
#else
  return *std::max_element(s, s + len);
#endif
}

// Each of `rows` rows of `len` scores becomes, in place, exp(score - the row's max); the
// reciprocal of each row's sum goes to inv_sums[row]. With AVX-512 every element goes
// through libmvec's 16-wide expf and the sum is taken 16 lanes at a time from the row's
// first element, so a row's numbers never depend on where in memory it lies (a compiler's
// vectorised loop may peel a few elements to align them, through scalar expf and into
// another grouping of the sum: a prefill and a decode of one token then differed in the
// last bit).
#if defined(__AVX512F__)
extern "C" __m512 _ZGVeN16v_expf(__m512);  // libmvec
inline void exp_rows(float* scores, int64_t rows, int64_t len, float* inv_sums) {
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * len;
    const __m512 max_score = _mm512_set1_ps(row_max(s, len));
    __m512 sum = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
      const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(s + t), max_score));
      _mm512_storeu_ps(s + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (t < len) {
      const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
      const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), max_score));
      _mm512_mask_storeu_ps(s + t, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    inv_sums[h] = 1.f / _mm512_reduce_add_ps(sum);
  }
}
#else
inline void exp_rows(float* scores, int64_t rows, int64_t len, float* inv_sums) {
  for (int64_t h = 0; h < rows; ++h) {
    float* s = scores + h * len;
    const float max_score = row_max(s, len);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {  // vectorised expf (libmvec)
      s[t] = expf(s[t] - max_score);
      sum += s[t];
    }
    inv_sums[h] = 1.f / sum;
  }
}
#endif

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

#if defined(__AVX512F__)
namespace simd {


inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane i of the result is the sum of the 16 lanes of v[i].
inline __m512 transpose_sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: (v0+v2, w0+w2, v1+v3, w1+w3) of v=v[2j], w=v[2j+1]
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane: the lane's sum for each of v[4j..4j+3]
    const __m512d x = _mm512_castps_pd(a[2 * j]), y = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int j = 0; j < 2; ++j)  // fold the four 128-bit lanes pairwise
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// 16 partial sums of q.k over D dims: k converted to fp32 and multiplied with q in fp32.
template <typename T, int64_t D>
struct Dot {
  __m512 q[D / 16];
  explicit Dot(const T* query) {
    for (int64_t c = 0; c < D / 16; ++c) q[c] = load16(query + 16 * c);
  }
  inline __m512 partial(const T* k) const {
    __m512 acc = _mm512_mul_ps(q[0], load16(k));
    for (int64_t c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(q[c], load16(k + 16 * c), acc);
    return acc;
  }
};

#if defined(__AVX512BF16__)
// bf16 q and k multiplied in pairs as they are (exact products, fp32 sums): no conversion.
template <int64_t D>
struct DotBf16 {
  __m512bh q[D / 32];
  explicit DotBf16(const c10::BFloat16* query) {
    for (int64_t c = 0; c < D / 32; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + 32 * c);
  }
  inline __m512 partial(const c10::BFloat16* k) const {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    return acc;
  }
};
template <typename T, int64_t D>
struct DotFor { using type = Dot<T, D>; };
template <int64_t D>
struct DotFor<c10::BFloat16, D> { using type = std::conditional_t<D % 32 == 0, DotBf16<D>, Dot<c10::BFloat16, D>>; };
#else
template <typename T, int64_t D>
struct DotFor { using type = Dot<T, D>; };
#endif


// The scaled scores of one query head against `n` <= 16 consecutive cached tokens (`key`:
// the first one's row for this head), stored to `out[0..n)`: 16 partial sums per token,
// reduced together by transpose_sum16. Both kernels score through this one function, so a
// token's scores are the same bits in a decode and in a prefill.
template <typename DotT, typename T>
inline void score16(const DotT& dot, const T* key, int64_t token_stride, int64_t n, float scale, float* out) {
  __m512 partial[16];
  if (n == 16) {  // the common case, kept free of per-token branches
    for (int64_t i = 0; i < 16; ++i) partial[i] = dot.partial(key + i * token_stride);
  } else {
    for (int64_t i = 0; i < 16; ++i) partial[i] = i < n ? dot.partial(key + i * token_stride) : _mm512_setzero_ps();
  }
  const __m512 s = _mm512_mul_ps(transpose_sum16(partial), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), s);
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

// One row of `len` exps times `inv` (the row's 1/sum: the softmax, as softmax_rows computes
// it) rounded to bf16, into `out`, `len + 1` long (the last entry 0).
inline void round_row_to_bf16(const float* s, float inv_sum, int64_t len, uint16_t* o) {
  const __m512 inv = _mm512_set1_ps(inv_sum);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + t),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + t), inv)));
  if (t < len) {
    const __mmask16 m = static_cast<__mmask16>((1u << (len - t)) - 1);
    _mm256_mask_storeu_epi16(o + t, m,
                             (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv)));
  }
  o[len] = 0;
}

// `rows` rows of `len` exps (round_row_to_bf16 each), into rows `len + 1` long.
inline void round_rows_to_bf16(const float* exps, const float* inv_sums, int64_t rows, int64_t len,
                               std::vector<uint16_t>& out) {
  out.resize(rows * (len + 1));
  for (int64_t h = 0; h < rows; ++h) round_row_to_bf16(exps + h * len, inv_sums[h], len, out.data() + h * (len + 1));
}
#endif

}  // namespace simd
#endif  // __AVX512F__

}  // namespace pdserve_attention
