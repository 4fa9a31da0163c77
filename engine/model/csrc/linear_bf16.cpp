// bf16 linear layers on the CPU with avx512_bf16: y = x @ W^T (+ bias), fp32 accumulation.
//
// The weight is packed once at load into panels of 48 output features (three vectors of 16):
// panel p holds, for every pair of input features (k, k+1), the 48 features' pairs side by
// side, so a step down K reads one contiguous 192-byte row and the whole panel is a single
// stream for the hardware prefetcher. A tile of up to 8 rows of x times one panel keeps its
// 24 accumulators in registers: each k-pair loads the panel's three vectors once and feeds
// them to every row (vdpbf16ps with the row's pair broadcast).
//
// The summation order is fixed by the weight alone, never by the number of rows: each output
// sums its products pair by pair, in order, within blocks of block_of(K) input features (512
// when K <= 1024, else 1024), and adds the block sums in order. So a row's bits do not depend on
// how many rows share the product (batch invariance), and they are the bits oneDNN's bf16
// product (torch.ops.mkldnn._linear_pointwise on a packed weight, at 2 rows or more) gives on
// avx512_bf16 without AMX, whose brgemm kernel blocks K the same way (measured on an AMD EPYC,
// Zen 5, torch 2.13's oneDNN; tests/unit/test_linear_bf16.py holds it).
//
// Why not oneDNN: decode-sized products (few rows) stream the weights faster this way; the
// two are compared side by side in benchmarks/linear_bf16.py.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kLanes = 16;              // outputs per vector
constexpr int64_t kPanelVectors = 3;        // vectors per panel
constexpr int64_t kPanel = kLanes * kPanelVectors;  // outputs per panel
constexpr int kTileRows = 8;                // rows of x per tile: 8 x 3 accumulators
constexpr int64_t kPrefetchPairs = 16;      // k-pairs ahead the panel's stream is prefetched

int64_t block_of(int64_t in_features) { return in_features <= 1024 ? 512 : 1024; }

// One tile: rows [0, R) of x (rows `ldx` apart) times the panel at `w` (its first `J` vectors
// used), outputs n0.. of y (rows `ldy` apart; `N` outputs in all, the last panel's beyond N
// not stored), `bias` (fp32, or null) added to the sums before rounding.
template <int R, int J>
void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, int64_t block_pairs,
          const float* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t N) {
  constexpr int64_t row_stride = kPanel * 2;  // bf16 lanes per k-pair row of the panel
  __m512 acc[R][J];
  alignas(64) float total[R][J][kLanes];
  for (int64_t k0 = 0; k0 < pairs; k0 += block_pairs) {
    const int64_t k1 = std::min(pairs, k0 + block_pairs);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      const uint16_t* row = w + k * row_stride;
      for (int j = 0; j < J; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetchPairs * row_stride + j * 2 * kLanes), _MM_HINT_T0);
      __m512bh wv[J];
      for (int j = 0; j < J; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(row + j * 2 * kLanes);
      for (int r = 0; r < R; ++r) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + 2 * k));
        for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < J; ++j)
        _mm512_store_ps(total[r][j], k0 ? _mm512_add_ps(_mm512_load_ps(total[r][j]), acc[r][j]) : acc[r][j]);
  }
  for (int j = 0; j < J; ++j) {
    const int64_t n = n0 + j * kLanes, left = N - n;
    const __mmask16 mask = left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 sum = bias ? _mm512_add_ps(_mm512_load_ps(total[r][j]), b) : _mm512_load_ps(total[r][j]);
      _mm256_mask_storeu_epi16(y + r * ldy + n, mask, (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}

template <int J>
void tile_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, int64_t block_pairs,
               const float* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t N) {
  switch (rows) {
    case 1: return tile<1, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
    case 2: return tile<2, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
    case 3: return tile<3, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
    case 4: return tile<4, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
    case 5: return tile<5, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
    case 6: return tile<6, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
    case 7: return tile<7, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
    default: return tile<kTileRows, J>(x, ldx, w, pairs, block_pairs, bias, y, ldy, n0, N);
  }
}

}  // namespace

// `weight` [N, K] bf16 (K even) -> [ceil(N / 48), K / 2, 48, 2]: the panels described above,
// features past N zero.
torch::Tensor pack_linear_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "pack_linear_bf16 takes a 2-D bf16 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_linear_bf16 needs an even number of input features, got ", K);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K / 2, 2}, weight.options());
  padded.narrow(0, 0, N).copy_(weight.reshape({N, K / 2, 2}));
  return padded.view({panels, kPanel, K / 2, 2}).transpose(1, 2).contiguous();
}

// x [M, K] bf16 times the packed weight of `out_features` outputs (+ `bias` [N], any float
// dtype) -> [M, N] bf16. Panels are shared out among threads; every row of a panel is
// computed by the thread that owns it, in the same order whatever M is.
torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_bf16 takes 2-D bf16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(1) * 2 == x.size(1),
              "linear_bf16: the packed weight (", packed.sizes(), ") does not take rows of ", x.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = out_features, pairs = K / 2;
  const int64_t panels = packed.size(0);
  TORCH_CHECK(N <= panels * kPanel && N > (panels - 1) * kPanel, "linear_bf16: ", N, " outputs for ", panels,
              " panels");
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();
  const float* b = bias.has_value() ? bias32.data_ptr<float>() : nullptr;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t block_pairs = block_of(K) / 2, panel_size = pairs * kPanel * 2;
  if (M == 0) return y;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, vectors = std::min<int64_t>(kPanelVectors, (N - n0 + kLanes - 1) / kLanes);
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        const uint16_t* xr = xs + m0 * K;
        uint16_t* yr = ys + m0 * N;
        const uint16_t* w = ws + p * panel_size;
        if (vectors == 3) tile_rows<3>(rows, xr, K, w, pairs, block_pairs, b, yr, N, n0, N);
        else if (vectors == 2) tile_rows<2>(rows, xr, K, w, pairs, block_pairs, b, yr, N, n0, N);
        else tile_rows<1>(rows, xr, K, w, pairs, block_pairs, b, yr, N, n0, N);
      }
    }
  });
  return y;
}
#else
torch::Tensor pack_linear_bf16(torch::Tensor) { TORCH_CHECK(false, "pack_linear_bf16 needs avx512_bf16"); }
torch::Tensor linear_bf16(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "linear_bf16 needs avx512_bf16");
}
#endif
