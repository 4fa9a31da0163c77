// The token-wise ops of a decoder layer, fused: one pass over each row instead of one torch
// op (and one temporary) per arithmetic step. Each computes what the torch code in
// engine/model/fused.py computes, in the same precision: fp32 arithmetic with a rounding to
// the tensor's dtype wherever the torch code holds a value in that dtype. Rows are
// independent, so a row's result never depends on the batch it is in.
// (Pragmas are written _Pragma: AT_DISPATCH takes the loops as a macro argument.)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <tuple>

#include "elementwise.h"

namespace {

// Rows per parallel chunk: a few hundred KB of work each, so a decode batch stays on one
// thread only when it is small.
int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }


// out = weight * T(x * rsqrt(mean(x^2) + eps)), x in fp32
template <typename T>
inline void norm_row(const T* x, const T* weight, int64_t n, float eps, T* out) {
  float sum = 0.f;
  _Pragma("omp simd reduction(+ : sum)")
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    sum += v * v;
  }
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  _Pragma("omp simd")
  for (int64_t i = 0; i < n; ++i)
    out[i] = round_to<T>(static_cast<float>(weight[i]) * static_cast<float>(round_to<T>(static_cast<float>(x[i]) * r)));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
}

}  // namespace

// `hidden += delta` (in hidden's dtype) when delta is given, then RMSNorm of hidden.
// Returns the normalised rows; hidden is updated in place.
at::Tensor add_rms_norm(at::Tensor hidden, c10::optional<at::Tensor> delta, at::Tensor weight,
                           double eps) {
  check_rows(hidden, weight);
  const bool add = delta.has_value();
  if (add) TORCH_CHECK(delta->sizes() == hidden.sizes() && delta->is_contiguous() &&
                       delta->scalar_type() == hidden.scalar_type(), "delta must match hidden");
  auto out = at::empty_like(hidden);
  const int64_t n = hidden.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, hidden.scalar_type(), "add_rms_norm", [&] {
    scalar_t* h = hidden.data_ptr<scalar_t>();
    const scalar_t* d = add ? delta->data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, hidden.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        scalar_t* hr = h + row * n;
        if (add) {
          const scalar_t* dr = d + row * n;
          _Pragma("omp simd")
          for (int64_t i = 0; i < n; ++i)
            hr[i] = round_to<scalar_t>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
        }
        norm_row(hr, w, n, static_cast<float>(eps), o + row * n);
      }
    });
  });
  return out;
}

// [rows, 2I] gate and up side by side -> T(T(silu(gate)) * up), [rows, I].
at::Tensor silu_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "expected a contiguous [rows, 2 * intermediate] tensor");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* g = in + row * 2 * n;
        silu_mul_row(g, g + n, o + row * n, n);
      }
    });
  });
  return out;
}

// RoPE (rotate-half) on the q and k heads of the fused projection's output seen as heads,
// `qkv` [tokens, q_heads + 2 kv_heads, D] (rows may be strided), with the cos/sin tables
// [max_len, D] indexed by positions. Returns q [tokens, q_heads, D] and k [tokens, kv_heads,
// D], each contiguous: T(T(x * cos) + T(rotate_half(x) * sin)); and v, the last kv_heads heads
// of `qkv` as they are (a view): the layer's split and views in one call.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope(at::Tensor qkv, at::Tensor positions, at::Tensor cos,
                                                    at::Tensor sin, int64_t num_q_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2), "qkv rows must hold contiguous heads");
  TORCH_CHECK(num_q_heads > 0 && num_kv_heads > 0 && qkv.size(1) == num_q_heads + 2 * num_kv_heads,
              "qkv must hold ", num_q_heads, " q heads and ", num_kv_heads, " k and v heads each, got ", qkv.size(1));
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == qkv.size(0),
              "positions must be int64 [tokens]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == qkv.size(2) &&
              cos.scalar_type() == qkv.scalar_type() && sin.sizes() == cos.sizes(), "cos/sin must be [max_len, D]");
  const int64_t tokens = qkv.size(0), heads = num_q_heads + num_kv_heads, dim = qkv.size(2), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0, "RoPE needs an even head size, got ", dim);
  auto q = at::empty({tokens, num_q_heads, dim}, qkv.options());
  auto k = at::empty({tokens, num_kv_heads, dim}, qkv.options());
  auto pos = positions.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope", [&] {
    const scalar_t* in = qkv.data_ptr<scalar_t>();
    const scalar_t* cos_t = cos.data_ptr<scalar_t>();
    const scalar_t* sin_t = sin.data_ptr<scalar_t>();
    const int64_t* p = pos.data_ptr<int64_t>();
    scalar_t* q_out = q.data_ptr<scalar_t>();
    scalar_t* k_out = k.data_ptr<scalar_t>();
    const int64_t row_stride = qkv.stride(0), max_len = cos.size(0);
    for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(p[t] >= 0 && p[t] < max_len, "position out of range");
    at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cos_t + p[t] * dim;
        const scalar_t* s = sin_t + p[t] * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* x = in + t * row_stride + h * dim;
          scalar_t* o = h < num_q_heads ? q_out + (t * num_q_heads + h) * dim
                                        : k_out + (t * (heads - num_q_heads) + h - num_q_heads) * dim;
          _Pragma("omp simd")
          for (int64_t i = 0; i < dim; ++i) {
            const float rotated = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
            const float a = static_cast<float>(round_to<scalar_t>(static_cast<float>(x[i]) * static_cast<float>(c[i])));
            const float b = static_cast<float>(round_to<scalar_t>(rotated * static_cast<float>(s[i])));
            o[i] = round_to<scalar_t>(a + b);
          }
        }
      }
    });
  });
  return {q, k, qkv.narrow(1, heads, num_kv_heads)};
}

// The index of the first maximum of `n` floats (a NaN counts as the maximum: the first NaN's),
// as torch's max(dim=-1).indices gives it: one pass finds the maximum (and whether there is a
// NaN, on the bits: -ffast-math lets the compiler assume none), a second its first position,
// with the row still in L2.
namespace {
uint32_t magnitude_bits(const float* x) {  // |x|'s bits: above 0x7f800000 only for a NaN
  uint32_t b;
  std::memcpy(&b, x, sizeof(b));
  return b & 0x7fffffffu;
}

int64_t first_max(const float* row, int64_t n) {
  auto is_nan = [&](int64_t i) { return magnitude_bits(row + i) > 0x7f800000u; };
  int64_t i = 0, at = 0;
  float m = row[0];
  uint32_t magnitude = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(row[0]);
  __m512i vmag = _mm512_setzero_si512();
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  for (; i + 16 <= n; i += 16) {
    vm = _mm512_max_ps(vm, _mm512_loadu_ps(row + i));
    vmag = _mm512_max_epu32(vmag, _mm512_and_si512(_mm512_castps_si512(_mm512_loadu_ps(row + i)), abs_mask));
  }
  m = _mm512_reduce_max_ps(vm);
  magnitude = _mm512_reduce_max_epu32(vmag);
#endif
  for (; i < n; ++i) {
    m = m > row[i] ? m : row[i];
    magnitude = std::max(magnitude, magnitude_bits(row + i));
  }
  if (magnitude > 0x7f800000u) {  // rare: scalar
    while (!is_nan(at)) ++at;
    return at;
  }
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(m);
  for (; at + 16 <= n; at += 16)
    if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + at), target, _CMP_EQ_OQ))
      return at + __builtin_ctz(hit);
#endif
  while (row[at] != m) ++at;
  return at;
}
}  // namespace

// Each fp32 row's first_max: the greedy sampler's pick (faster than torch's max with indices:
// benchmarks/README.md, "Decode's dispatch").
at::Tensor row_argmax(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "row_argmax takes contiguous fp32 rows [rows, n > 0], got ", logits.scalar_type(), " ", logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) index[r] = first_max(x + r * n, n);
  });
  return out;
}
