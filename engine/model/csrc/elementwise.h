// Element-wise row functions shared by the fused ops (fused_ops.cpp) and the gated panel
// product's epilogue (panel_linear.cpp): one definition, so the two give the same bits.
// (Pragmas are written _Pragma: AT_DISPATCH takes the loops as a macro argument.)
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vector_bf16.h"

namespace {

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

constexpr int64_t kSiluBlock = 16;  // features silu_mul_row takes at a time

// SwiGLU's T(T(silu(gate)) * up) over n <= kSiluBlock features, in fp32 with T roundings where
// the torch code (engine/model/fused.py) holds a value in T. Always kSiluBlock lanes (the
// rest zero): a fixed trip count the compiler vectorises whole, so every feature goes through
// the same expf wherever it sits in a row (a loop of n features took scalar expf for some
// tails and vector expf elsewhere, whose last bits differ).
template <typename T>
inline void silu_mul_block(const T* gate, const T* up, T* out, int64_t n) {
  float g[kSiluBlock] = {}, u[kSiluBlock] = {}, o[kSiluBlock];
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(gate[i]), u[i] = static_cast<float>(up[i]);
  _Pragma("omp simd")
  for (int64_t i = 0; i < kSiluBlock; ++i) {
    const float silu = static_cast<float>(round_to<T>(g[i] / (1.f + expf(-g[i]))));
    o[i] = static_cast<float>(round_to<T>(silu * u[i]));
  }
  for (int64_t i = 0; i < n; ++i) out[i] = round_to<T>(o[i]);
}

#if defined(__AVX512F__)
// bf16 to fp32 (exact): the first lanes of `mask` from p, the rest zero.
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 mask) { return widen_bf16(_mm256_maskz_loadu_epi16(mask, p)); }

// fp32 to bf16 as c10::BFloat16 rounds: to nearest, ties to even, NaN to 0x7FC0.
inline __m256i narrow_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// bf16 with AVX-512: the same arithmetic and roundings on one vector of 16 features, through
// libmvec's 16-lane expf. The generic loop, compiled for 256-bit vectors, took libmvec's
// 8-lane expf twice and spent most of its time converting (benchmarks/README.md).
template <>
inline void silu_mul_block<c10::BFloat16>(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out,
                                          int64_t n) {
  const __mmask16 mask = n >= kSiluBlock ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  const __m512 g = load_bf16(gate, mask), u = load_bf16(up, mask);
  const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m256i silu = narrow_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
  _mm256_mask_storeu_epi16(out, mask, narrow_bf16(_mm512_mul_ps(widen_bf16(silu), u)));
}
#endif

// silu_mul_block over n features, kSiluBlock at a time.
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += kSiluBlock) silu_mul_block(gate + i, up + i, out + i, std::min(kSiluBlock, n - i));
}

}  // namespace
