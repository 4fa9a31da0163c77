// Element-wise row functions shared by the fused ops (fused_ops.cpp) and the gated panel
// product's epilogue (panel_linear.cpp): one definition, so the two give the same bits.
// (Pragmas are written _Pragma: AT_DISPATCH takes the loops as a macro argument.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

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

// silu_mul_block over n features, kSiluBlock at a time.
template <typename T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  for (int64_t i = 0; i < n; i += kSiluBlock) silu_mul_block(gate + i, up + i, out + i, std::min(kSiluBlock, n - i));
}

}  // namespace
