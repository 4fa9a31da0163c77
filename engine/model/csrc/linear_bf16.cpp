// bf16 linear layers on the CPU with avx512_bf16: y = x @ W^T (+ bias), fp32 accumulation.
//
// The weight is packed once at load into panels of 48 output features (three vectors of 16):
// panel p holds, for every pair of input features (k, k+1), the 48 features' pairs side by
// side, so a step down K reads one contiguous 192-byte row and the whole panel is a single
// stream for the hardware prefetcher. A tile of up to 8 rows of x times one panel keeps its
// 24 accumulators in registers: each k-pair loads the panel's three vectors once and feeds
// them to every row (vdpbf16ps with the row's pair broadcast).
//
// Decode's products (up to 64 rows) read each panel from memory once for all their tiles: the
// panel is walked a chunk of 32 k-pairs (6 KB) at a time, every tile taking the chunk in turn
// while it sits in L1, its sums stored between chunks (fp32, so storing them changes nothing),
// and the first tile fetches the next chunk into L2 as it goes. Tile by tile instead, the
// first tile waited on memory and the others computed from cache after it, so the read and
// the arithmetic added up rather than overlapping (1.1-1.2x at 16-32 rows,
// benchmarks/README.md). Larger products, compute-bound, take their tiles one at a time
// through the whole panel, which stays in L2 between them.
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
constexpr int kBlockTiles = 8;              // products of up to this many tiles share each chunk of a panel
constexpr int64_t kChunkPairs = 32;         // k-pairs per chunk (6 KB of a panel); also how far ahead it is fetched

int64_t block_of(int64_t in_features) { return in_features <= 1024 ? 512 : 1024; }

// A tile's sums ([row][vector][lane], fp32) between chunks: the current K block's so far, and
// the finished blocks' total, added in order.
struct TileSums {
  alignas(64) float block[kTileRows][kPanelVectors][kLanes];
  alignas(64) float total[kTileRows][kPanelVectors][kLanes];
};

// Rows [0, R) of x (rows `ldx` apart) times k-pairs [c0, c1) of the panel at `w` (its first
// `J` vectors used), continuing the tile's block sums (`first`: [c0, c1) opens a K block;
// `last`: it closes one, whose sums then go into the total, started by `first_block`).
// `prefetch`: fetch the panel kChunkPairs ahead into L2 on the way.
template <int R, int J>
void tile_chunk(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t c0, int64_t c1, bool first, bool last,
                bool first_block, bool prefetch, TileSums& sums) {
  constexpr int64_t row_stride = kPanel * 2;  // bf16 lanes per k-pair row of the panel
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(sums.block[r][j]);
  for (int64_t k = c0; k < c1; ++k) {
    const uint16_t* row = w + k * row_stride;
    if (prefetch)
      for (int j = 0; j < J; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row + kChunkPairs * row_stride + j * 2 * kLanes), _MM_HINT_T1);
    __m512bh wv[J];
    for (int j = 0; j < J; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(row + j * 2 * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + r * ldx + 2 * k));
      for (int j = 0; j < J; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      if (!last) _mm512_store_ps(sums.block[r][j], acc[r][j]);
      else if (first_block) _mm512_store_ps(sums.total[r][j], acc[r][j]);
      else _mm512_store_ps(sums.total[r][j], _mm512_add_ps(_mm512_load_ps(sums.total[r][j]), acc[r][j]));
    }
}

template <int J>
void tile_chunk_rows(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t c0, int64_t c1, bool first,
                     bool last, bool first_block, bool prefetch, TileSums& sums) {
  switch (rows) {
    case 1: return tile_chunk<1, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 2: return tile_chunk<2, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 3: return tile_chunk<3, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 4: return tile_chunk<4, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 5: return tile_chunk<5, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 6: return tile_chunk<6, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 7: return tile_chunk<7, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    default: return tile_chunk<kTileRows, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
  }
}

// `rows` rows of x (at most kBlockTiles tiles, rows `K` apart) times the panel at `w`, outputs
// n0.. (of `N`; the last panel's beyond N not stored) into rows of y `N` apart, plus `bias`
// (fp32, or null) before rounding. The panel is walked `chunk` k-pairs at a time, every tile
// taking each chunk in turn (so a chunk of a K block's length or more: tile after tile).
template <int J>
void row_block(int rows, const uint16_t* x, int64_t K, const uint16_t* w, int64_t pairs, int64_t block_pairs,
               int64_t chunk, const float* bias, uint16_t* y, int64_t N, int64_t n0) {
  TileSums sums[kBlockTiles];
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  auto tile_rows = [&](int t) { return std::min(kTileRows, rows - t * kTileRows); };
  for (int64_t k0 = 0; k0 < pairs; k0 += block_pairs) {
    const int64_t k1 = std::min(pairs, k0 + block_pairs);
    for (int64_t c0 = k0; c0 < k1; c0 += chunk) {
      const int64_t c1 = std::min(k1, c0 + chunk);
      for (int t = 0; t < tiles; ++t)
        tile_chunk_rows<J>(tile_rows(t), x + t * kTileRows * K, K, w, c0, c1, c0 == k0, c1 == k1, k0 == 0, t == 0,
                           sums[t]);
    }
  }
  for (int t = 0; t < tiles; ++t)
    for (int j = 0; j < J; ++j) {
      const int64_t n = n0 + j * kLanes, left = N - n;
      const __mmask16 mask = left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
      for (int r = 0; r < tile_rows(t); ++r) {
        const __m512 total = _mm512_load_ps(sums[t].total[r][j]);
        _mm256_mask_storeu_epi16(y + (t * kTileRows + r) * N + n, mask,
                                 (__m256i)_mm512_cvtneps_pbh(bias ? _mm512_add_ps(total, b) : total));
      }
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
  // decode-sized products share each chunk among all their tiles; larger ones go tile by tile
  const bool shared = M <= kBlockTiles * kTileRows;
  const int64_t block_rows = shared ? M : kTileRows, chunk = shared ? kChunkPairs : block_pairs;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, vectors = std::min<int64_t>(kPanelVectors, (N - n0 + kLanes - 1) / kLanes);
      const uint16_t* w = ws + p * panel_size;
      for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
        const int rows = static_cast<int>(std::min(block_rows, M - m0));
        const uint16_t* xr = xs + m0 * K;
        uint16_t* yr = ys + m0 * N;
        if (vectors == 3) row_block<3>(rows, xr, K, w, pairs, block_pairs, chunk, b, yr, N, n0);
        else if (vectors == 2) row_block<2>(rows, xr, K, w, pairs, block_pairs, chunk, b, yr, N, n0);
        else row_block<1>(rows, xr, K, w, pairs, block_pairs, chunk, b, yr, N, n0);
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
