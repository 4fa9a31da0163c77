// Linear layers on the CPU with AVX-512, on weights packed into panels: y = x @ W^T (+ bias),
// fp32 accumulation, in bf16 (with avx512_bf16) or fp32.
//
// The weight is packed once at load into panels of 48 output features (three vectors of 16).
// A panel's k-th row holds the 48 features' weights for input unit k side by side: a pair of
// inputs (k, k+1) in bf16 (two bf16 per lane, for vdpbf16ps), one input in fp32. Either way a
// row is 192 contiguous bytes and the whole panel is one stream. A tile of up to 8 rows of x
// times one panel keeps its 24 accumulators in registers: each unit loads the panel's three
// vectors once and feeds them to every row (vdpbf16ps or an FMA, with the row's unit broadcast).
//
// Decode's products (up to 64 rows) read each panel from memory once for all their tiles: the
// panel is walked a chunk of 32 units (6 KB) at a time, every tile taking the chunk in turn
// while it sits in L1, its sums stored between chunks (fp32, so storing them changes nothing),
// and the first tile fetches the next chunk into L2 as it goes. Tile by tile instead, the
// first tile waited on memory and the others computed from cache after it, so the read and
// the arithmetic added up rather than overlapping (benchmarks/README.md). Larger products,
// compute-bound, take their tiles one at a time through the whole panel, which stays in L2.
//
// The summation order is fixed by the weight alone, never by the number of rows: each output
// sums its products unit by unit, in order, within blocks of block_of(K) input features (512
// when K <= 1024, else 1024), and adds the block sums in order. So a row's bits do not depend on
// how many rows share the product (batch invariance), and they are the bits oneDNN's product
// (torch.ops.mkldnn._linear_pointwise on a packed weight, at 2 rows or more) gives in either
// dtype on AVX-512 without AMX, whose brgemm kernels block K the same way (measured on an AMD
// EPYC, Zen 5, torch 2.13's oneDNN; tests/unit/test_panel_linear.py holds it).
//
// With AMX (amx_bf16, granted by the kernel: panel_amx.h), a bf16 weight whose inputs are a
// multiple of 32 runs on tiles instead, at every row count: 32 rows (two tiles of 16, a last
// one padded with zero rows) through a whole panel at a time, all of K summed on the tiles (no
// K blocks: panel_amx.h), each block of rows taken by a group of 8 panels in turn so that a
// long prompt's rows are read from memory once a group. A row's bits are the tiles' (not
// vdpbf16ps'), the same at any row count.
//
// Why not oneDNN: decode-sized products (few rows) stream the weights faster this way; the
// two are compared side by side in benchmarks/linear_bf16.py.
//
// SwiGLU's gate and up projections run as one gated product (panel_silu_mul): the panels come
// in pairs, a gate panel and the up panel of the same 48 features. In decode's products (up to
// 64 rows) each pair's outputs go through silu(gate) * up (elementwise.h's silu_mul_row, as
// fused_ops.cpp's silu_mul) while they sit in L1, so the [rows, 2I] product is never written
// and read back; larger products write it and call silu_mul (fused, they ran slower).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include <string>
#include <vector>

#include "elementwise.h"
#include "panel_amx.h"

at::Tensor silu_mul(at::Tensor gate_up);  // fused_ops.cpp

namespace {
constexpr int64_t kLanes = 16;              // outputs per vector
constexpr int64_t kPanelVectors = 3;        // vectors per panel
constexpr int64_t kPanel = kLanes * kPanelVectors;  // outputs per panel
}  // namespace

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int kTileRows = 8;                // rows of x per tile: 8 x 3 accumulators
constexpr int kBlockTiles = 8;              // products of up to this many tiles share each chunk of a panel
constexpr int64_t kChunkUnits = 32;         // units per chunk (6 KB of a panel); also how far ahead it is fetched
constexpr int64_t kAmxRows = 16;            // rows of x per AMX tile (panel_amx.h)
constexpr int64_t kAmxPanelGroup = 8;       // panels sharing each block of rows with AMX (0.4-1.2 MB of weights)

int64_t block_of(int64_t in_features) { return in_features <= 1024 ? 512 : 1024; }

#if defined(__AVX512BF16__)
// bf16: a unit is a pair of inputs, multiplied as they are by vdpbf16ps (exact products, fp32
// sums); outputs rounded to bf16.
struct Bf16 {
  using Elem = uint16_t;
  using Value = c10::BFloat16;  // what an Elem holds, for the element-wise epilogue
  using Unit = __m512bh;
  static constexpr int64_t kInputs = 2;
  static constexpr bool kAmx = false;
  static Unit weights(const Elem* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static Unit broadcast(const Elem* x) { return (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)); }
  static __m512 madd(__m512 acc, Unit w, Unit x) { return _mm512_dpbf16_ps(acc, w, x); }
  static void store(Elem* y, __mmask16 mask, __m512 sum) {
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(sum));
  }
};

#if defined(PDSERVE_AMX)
// bf16 through AMX tiles (panel_amx.h): the same panels and outputs, 16 rows at a time.
struct AmxBf16 : Bf16 {
  static constexpr bool kAmx = true;
};
#endif
#endif

// fp32: a unit is one input, one FMA per product.
struct Fp32 {
  using Elem = float;
  using Value = float;
  using Unit = __m512;
  static constexpr int64_t kInputs = 1;
  static constexpr bool kAmx = false;
  static Unit weights(const Elem* w) { return _mm512_loadu_ps(w); }
  static Unit broadcast(const Elem* x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 acc, Unit w, Unit x) { return _mm512_fmadd_ps(w, x, acc); }
  static void store(Elem* y, __mmask16 mask, __m512 sum) { _mm512_mask_storeu_ps(y, mask, sum); }
};

// A tile's sums ([row][vector][lane], fp32) between chunks: the current K block's so far, and
// the finished blocks' total, added in order.
struct TileSums {
  alignas(64) float block[kTileRows][kPanelVectors][kLanes];
  alignas(64) float total[kTileRows][kPanelVectors][kLanes];
};

// Rows [0, R) of x (rows `ldx` apart) times units [c0, c1) of the panel at `w` (its first `J`
// vectors used), continuing the tile's block sums (`first`: [c0, c1) opens a K block; `last`:
// it closes one, whose sums then go into the total, started by `first_block`). `prefetch`:
// fetch the panel kChunkUnits ahead into L2 on the way.
template <typename E, int R, int J>
void tile_chunk(const typename E::Elem* x, int64_t ldx, const typename E::Elem* w, int64_t c0, int64_t c1, bool first,
                bool last, bool first_block, bool prefetch, TileSums& sums) {
  constexpr int64_t row_stride = kPanel * E::kInputs;  // elements per unit row of the panel
  constexpr int64_t vector_stride = kLanes * E::kInputs;
  __m512 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(sums.block[r][j]);
  for (int64_t k = c0; k < c1; ++k) {
    const typename E::Elem* row = w + k * row_stride;
    if (prefetch)
      for (int j = 0; j < J; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row + kChunkUnits * row_stride + j * vector_stride), _MM_HINT_T1);
    typename E::Unit wv[J];
    for (int j = 0; j < J; ++j) wv[j] = E::weights(row + j * vector_stride);
    for (int r = 0; r < R; ++r) {
      const typename E::Unit xb = E::broadcast(x + r * ldx + E::kInputs * k);
      for (int j = 0; j < J; ++j) acc[r][j] = E::madd(acc[r][j], wv[j], xb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) {
      if (!last) _mm512_store_ps(sums.block[r][j], acc[r][j]);
      else if (first_block) _mm512_store_ps(sums.total[r][j], acc[r][j]);
      else _mm512_store_ps(sums.total[r][j], _mm512_add_ps(_mm512_load_ps(sums.total[r][j]), acc[r][j]));
    }
}

template <typename E, int J>
void tile_chunk_rows(int rows, const typename E::Elem* x, int64_t ldx, const typename E::Elem* w, int64_t c0,
                     int64_t c1, bool first, bool last, bool first_block, bool prefetch, TileSums& sums) {
  switch (rows) {
    case 1: return tile_chunk<E, 1, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 2: return tile_chunk<E, 2, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 3: return tile_chunk<E, 3, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 4: return tile_chunk<E, 4, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 5: return tile_chunk<E, 5, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 6: return tile_chunk<E, 6, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    case 7: return tile_chunk<E, 7, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
    default: return tile_chunk<E, kTileRows, J>(x, ldx, w, c0, c1, first, last, first_block, prefetch, sums);
  }
}

// Rows [0, rows) of a panel's fp32 sums (`sums`: a row's 48 outputs side by side, rows 48 apart),
// plus `bias` (fp32, at the panel's first output, or null), rounded to E into rows of y `ldy`
// apart: the first `valid` outputs, of the first J vectors.
template <typename E, int J>
void store_rows(int rows, const float* sums, const float* bias, typename E::Elem* y, int64_t ldy, int64_t valid) {
  for (int j = 0; j < J; ++j) {
    const int64_t n = j * kLanes, left = valid - n;
    const __mmask16 mask = left >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      const __m512 total = _mm512_load_ps(sums + r * kPanel + n);
      E::store(y + r * ldy + n, mask, bias ? _mm512_add_ps(total, b) : total);
    }
  }
}

// `rows` rows of x (at most kBlockTiles tiles, rows `K` apart) times the panel at `w`: its first
// `valid` outputs (the rest not stored) into rows of y `ldy` apart, plus `bias` (fp32, at the
// panel's first output, or null) before rounding. The panel is walked `chunk` units at a time,
// every tile taking each chunk in turn (so a chunk of a K block's length or more: tile after tile).
template <typename E, int J>
void row_block(int rows, const typename E::Elem* x, int64_t K, const typename E::Elem* w, int64_t units,
               int64_t block_units, int64_t chunk, const float* bias, typename E::Elem* y, int64_t ldy,
               int64_t valid) {
  TileSums sums[kBlockTiles];
  const int tiles = (rows + kTileRows - 1) / kTileRows;
  auto tile_rows = [&](int t) { return std::min(kTileRows, rows - t * kTileRows); };
  for (int64_t k0 = 0; k0 < units; k0 += block_units) {
    const int64_t k1 = std::min(units, k0 + block_units);
    for (int64_t c0 = k0; c0 < k1; c0 += chunk) {
      const int64_t c1 = std::min(k1, c0 + chunk);
      for (int t = 0; t < tiles; ++t)
        tile_chunk_rows<E, J>(tile_rows(t), x + t * kTileRows * K, K, w, c0, c1, c0 == k0, c1 == k1, k0 == 0, t == 0,
                              sums[t]);
    }
  }
  for (int t = 0; t < tiles; ++t)
    store_rows<E, J>(tile_rows(t), &sums[t].total[0][0][0], bias, y + t * kTileRows * ldy, ldy, valid);
}

// How a product of M rows walks each panel: decode-sized products (up to kBlockTiles tiles)
// share each chunk among all their tiles; larger ones go tile by tile through whole K blocks.
// With AMX, 32 rows at a time through whole panels, all of K in one block (amx::panel_sums),
// each block of rows taken by a group of panels in turn (kAmxPanelGroup: their weights stay in
// L2 while the rows come from L1), so a long prompt's rows are read from memory once a group,
// not once a panel.
struct Walk {
  int64_t units, block_units, block_rows, chunk, panel_group;
  template <typename E>
  static Walk of(int64_t M, int64_t K) {
    const int64_t units = K / E::kInputs;
    if (E::kAmx) return {units, units, 2 * kAmxRows, units, kAmxPanelGroup};
    const bool shared = M <= kBlockTiles * kTileRows;
    const int64_t block_units = block_of(K) / E::kInputs;
    return {units, block_units, shared ? M : kTileRows, shared ? kChunkUnits : block_units, 1};
  }
};

// Where row block m0's rows of x [M, K] are: in x, or, for AMX's tiles of 16 rows, a last block
// of fewer rows in a copy padded with zero rows (in a buffer of the calling thread's, kept from
// call to call: a decode step's products at batch 1 all take this path, where a tensor allocated
// and zeroed per call cost more than the product of a small layer).
template <typename E>
struct RowSource {
  using Elem = typename E::Elem;
  const Elem* x;
  int64_t M, K;
  const Elem* padded = nullptr;
  explicit RowSource(const torch::Tensor& rows)
      : x(reinterpret_cast<const Elem*>(rows.data_ptr())), M(rows.size(0)), K(rows.size(1)) {
    if (!E::kAmx || M % kAmxRows == 0) return;
    thread_local std::vector<Elem> buffer;
    thread_local int64_t filled = 0;  // rows of the buffer that may not be zero (a row is K long)
    const int64_t tail = M % kAmxRows;
    if (static_cast<int64_t>(buffer.size()) != kAmxRows * K) buffer.assign(kAmxRows * K, Elem{}), filled = 0;
    std::copy_n(x + (M - tail) * K, tail * K, buffer.data());
    // rows past the tail zeroed only where an earlier call left rows: the others' lines, unwritten,
    // stay in the cache of the threads that read them
    if (filled > tail) std::fill(buffer.begin() + tail * K, buffer.begin() + filled * K, Elem{});
    filled = tail;
    padded = buffer.data();
  }
  const Elem* at(int64_t m0) const { return padded != nullptr && m0 + kAmxRows > M ? padded : x + m0 * K; }
};

// Runs `body(begin, end)` over [0, n) on the thread pool, each thread's share between its tile
// configuration and release where E runs on AMX tiles.
template <typename E, typename Body>
void parallel_panels(int64_t n, const Body& body) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
#if defined(PDSERVE_AMX)
    if (E::kAmx) {
      const amx::Scope tiles;
      return body(begin, end);
    }
#endif
    body(begin, end);
  });
}

// row_block for a panel whose first `valid` outputs are used (its vectors past them skipped),
// on rows [m0, m0 + rows) of `xs`; with AMX, up to 32 rows through amx::panel_sums, as one or two
// tiles of 16 (a last one padded with zero rows: RowSource).
template <typename E>
void panel_rows(const Walk& walk, int rows, const RowSource<E>& xs, int64_t m0, const typename E::Elem* w,
                const float* bias, typename E::Elem* y, int64_t ldy, int64_t valid) {
  const int64_t K = xs.K;
  // the panel's vectors that hold used outputs, fixed at compile time for `run`
  const auto with_vectors = [valid](auto run) {
    const int64_t vectors = std::min<int64_t>(kPanelVectors, (valid + kLanes - 1) / kLanes);
    if (vectors == 3) return run(std::integral_constant<int, 3>{});
    if (vectors == 2) return run(std::integral_constant<int, 2>{});
    return run(std::integral_constant<int, 1>{});
  };
#if defined(PDSERVE_AMX)
  if constexpr (E::kAmx) {
    alignas(64) float sums[2 * kAmxRows][kPanel];
    if (rows > kAmxRows)
      amx::panel_sums<2>(xs.at(m0), xs.at(m0 + kAmxRows), K, w, walk.units, sums);
    else
      amx::panel_sums<1>(xs.at(m0), nullptr, K, w, walk.units, sums);
    return with_vectors([&](auto v) { store_rows<E, decltype(v)::value>(rows, &sums[0][0], bias, y, ldy, valid); });
  }
#endif
  const typename E::Elem* x = xs.x + m0 * K;
  with_vectors([&](auto v) {
    row_block<E, decltype(v)::value>(rows, x, K, w, walk.units, walk.block_units, walk.chunk, bias, y, ldy, valid);
  });
}

// `bias` (any float dtype, or none) as fp32 in `holder`; its data (null for none).
const float* bias_fp32(const c10::optional<torch::Tensor>& bias, torch::Tensor& holder) {
  if (!bias.has_value()) return nullptr;
  holder = bias->to(at::kFloat).contiguous();
  return holder.data_ptr<float>();
}

// Which panel runs i-th and where its outputs go: panel_linear's panels in order, side by side
// (panel i's first output is i * 48), or, `gated` (pack_gated_panels' pairs for I = N / 2
// features each), the gate panels (q = 2p) then the up panels (q = 2p + 1), at p * 48 and
// I + p * 48: the order and places of the plain panels of the same weight.
struct Placement {
  int64_t N;
  bool gated;
  int64_t panel(int64_t i) const { return !gated ? i : i < panels() / 2 ? 2 * i : 2 * (i - panels() / 2) + 1; }
  int64_t panels() const { return gated ? 2 * ((N / 2 + kPanel - 1) / kPanel) : (N + kPanel - 1) / kPanel; }
  int64_t column(int64_t q) const { return gated ? (q % 2) * (N / 2) + (q / 2) * kPanel : q * kPanel; }
  int64_t valid(int64_t q) const { return gated ? std::min(kPanel, N / 2 - (q / 2) * kPanel) : N - q * kPanel; }
};

// x [M, K] times the panels `packed` of `out_features` outputs (+ `bias` [N], any float
// dtype) -> [M, N] in x's dtype, the panels' outputs placed by `placement`. Panels are shared
// out among threads; every row of a panel is computed by the thread that owns it, in the same
// order whatever M is.
template <typename E>
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, int64_t N,
                      const c10::optional<torch::Tensor>& bias, Placement placement) {
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0), panel_size = K * kPanel;
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor bias32;
  const float* b = bias_fp32(bias, bias32);
  const auto* ws = reinterpret_cast<const typename E::Elem*>(packed.data_ptr());
  auto* ys = reinterpret_cast<typename E::Elem*>(y.data_ptr());
  if (M == 0) return y;
  const RowSource<E> xs(x);
  const Walk walk = Walk::of<E>(M, K);
  parallel_panels<E>(panels, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; g += walk.panel_group)
      for (int64_t m0 = 0; m0 < M; m0 += walk.block_rows) {
        const int rows = static_cast<int>(std::min(walk.block_rows, M - m0));
        for (int64_t i = g; i < std::min(end, g + walk.panel_group); ++i) {
          const int64_t p = placement.panel(i), n0 = placement.column(p), valid = placement.valid(p);
          panel_rows<E>(walk, rows, xs, m0, ws + p * panel_size, b ? b + n0 : nullptr, ys + m0 * N + n0, N,
                        valid);
        }
      }
  });
  return y;
}

// SwiGLU's first half: x [M, K] times the gated panels `packed` (pairs of a gate panel and the
// up panel of the same 48 intermediate features, from pack_gated_panels), plus `bias` [2I]
// (gate's then up's, or none), then silu(gate) * up -> [M, I] in x's dtype. Each pair's gate
// and up outputs are rounded to x's dtype into a small buffer, as the plain product would store
// them, and silu_mul_row (fused_ops.cpp's silu_mul) runs on them there, while they sit in L1:
// the same bits as panel_linear followed by silu_mul, without writing and re-reading [M, 2I].
// That is for decode's products (up to kBlockTiles tiles of rows). Larger ones, tile by tile,
// ran slower fused (benchmarks/README.md); they write [M, 2I] and call silu_mul, the same bits.
template <typename E>
torch::Tensor gated_product(const torch::Tensor& x, const torch::Tensor& packed, int64_t I,
                            const c10::optional<torch::Tensor>& bias) {
  using Value = typename E::Value;
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(0) / 2, panel_size = K * kPanel;
  if (M > kBlockTiles * kTileRows) return silu_mul(product<E>(x, packed, 2 * I, bias, Placement{2 * I, true}));
  auto y = torch::empty({M, I}, x.options());
  torch::Tensor bias32;
  const float* b = bias_fp32(bias, bias32);
  const auto* ws = reinterpret_cast<const typename E::Elem*>(packed.data_ptr());
  auto* ys = reinterpret_cast<Value*>(y.data_ptr());
  if (M == 0) return y;
  const RowSource<E> xs(x);
  const Walk walk = Walk::of<E>(M, K);
  parallel_panels<E>(pairs, [&](int64_t begin, int64_t end) {
    alignas(64) typename E::Elem gate[kBlockTiles * kTileRows * kPanel], up[kBlockTiles * kTileRows * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, valid = std::min(kPanel, I - n0);
      const typename E::Elem* w = ws + 2 * p * panel_size;
      for (int64_t m0 = 0; m0 < M; m0 += walk.block_rows) {
        const int rows = static_cast<int>(std::min(walk.block_rows, M - m0));
        panel_rows<E>(walk, rows, xs, m0, w, b ? b + n0 : nullptr, gate, kPanel, valid);
        panel_rows<E>(walk, rows, xs, m0, w + panel_size, b ? b + I + n0 : nullptr, up, kPanel, valid);
        for (int r = 0; r < rows; ++r)
          silu_mul_row(reinterpret_cast<const Value*>(gate + r * kPanel), reinterpret_cast<const Value*>(up + r * kPanel),
                       ys + (m0 + r) * I + n0, valid);
      }
    }
  });
  return y;
}

}  // namespace
#endif

// The dtypes panel_linear runs in this build.
std::vector<std::string> panel_linear_dtypes() {
#if defined(__AVX512BF16__)
  return {"bfloat16", "float32"};
#elif defined(__AVX512F__)
  return {"float32"};
#else
  return {};
#endif
}

// Whether bf16 panels run on AMX tiles here: built for amx_bf16 and granted by the kernel.
bool panel_linear_amx() {
#if defined(PDSERVE_AMX) && defined(__AVX512BF16__)
  return amx::permitted();
#else
  return false;
#endif
}

namespace {
int64_t inputs_per_unit(const torch::Tensor& t) { return t.scalar_type() == at::kBFloat16 ? 2 : 1; }

// Whether a bf16 product of K input features runs on AMX tiles (panel_linear_amx, and K a
// multiple of a tile's 32 inputs), else vdpbf16ps: by the weight's shape alone, never the rows.
bool amx_runs(int64_t K) { return K % 32 == 0 && panel_linear_amx(); }

void check_dtype(const torch::Tensor& t, const char* what) {
  static const std::vector<std::string> dtypes = panel_linear_dtypes();  // checked on every product
  const std::string name = t.scalar_type() == at::kBFloat16 ? "bfloat16" : t.scalar_type() == at::kFloat ? "float32" : "";
  TORCH_CHECK(!name.empty() && std::find(dtypes.begin(), dtypes.end(), name) != dtypes.end(), what,
              " runs in this build's dtypes only (", c10::Join(", ", dtypes), "), got ", t.scalar_type());
}
}  // namespace

// `weight` [N, K] (bf16: K even) -> [ceil(N / 48), K / u, 48, u] with u inputs per unit (2 in
// bf16, 1 in fp32): the panels described above, features past N zero.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_panels takes a 2-D CPU weight");
  check_dtype(weight, "pack_panels");
  const int64_t N = weight.size(0), K = weight.size(1), u = inputs_per_unit(weight);
  TORCH_CHECK(K % u == 0, "pack_panels needs an even number of input features in bf16, got ", K);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K / u, u}, weight.options());
  padded.narrow(0, 0, N).copy_(weight.reshape({N, K / u, u}));
  return padded.view({panels, kPanel, K / u, u}).transpose(1, 2).contiguous();
}

// `gate_up` [2I, K], the gate and up projections stacked -> pairs of panels, gate's then up's of
// the same 48 intermediate features: [2 * ceil(I / 48), K / u, 48, u], for panel_silu_mul.
torch::Tensor pack_gated_panels(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(0) % 2 == 0, "pack_gated_panels takes the gate and up projections "
              "stacked, [2 * intermediate, in], got ", gate_up.sizes());
  const auto halves = gate_up.chunk(2, 0);
  return torch::stack({pack_panels(halves[0]), pack_panels(halves[1])}, 1).flatten(0, 1);
}

namespace {
// Checks rows `x` against a packed weight of `panels` panels for `out_features` outputs; x
// contiguous.
torch::Tensor checked_rows(const char* op, torch::Tensor x, const torch::Tensor& packed, int64_t panels,
                           int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, op, " takes 2-D rows");
  check_dtype(x, op);
  const int64_t u = inputs_per_unit(x);
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.dim() == 4 && packed.size(2) == kPanel &&
                  packed.size(3) == u && packed.size(1) * u == x.size(1),
              op, ": the packed weight (", packed.sizes(), ", ", packed.scalar_type(), ") does not take rows of ",
              x.size(1), " ", x.scalar_type());
  TORCH_CHECK(out_features <= panels * kPanel && out_features > (panels - 1) * kPanel, op, ": ", out_features,
              " outputs for ", panels, " panels");
  return x.contiguous();
}
}  // namespace

// x [M, K] times the weight `pack_panels` made of `out_features` outputs (+ `bias` [N]) -> [M, N].
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                           c10::optional<torch::Tensor> bias) {
  x = checked_rows("panel_linear", x, packed, packed.size(0), out_features);
#if defined(PDSERVE_AMX) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && amx_runs(x.size(1)))
    return product<AmxBf16>(x, packed, out_features, bias, {out_features, false});
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return product<Bf16>(x, packed, out_features, bias, {out_features, false});
#endif
#if defined(__AVX512F__)
  return product<Fp32>(x, packed, out_features, bias, {out_features, false});
#else
  TORCH_CHECK(false, "panel_linear needs AVX-512");
#endif
}

// silu(gate) * up of x [M, K] times the weight `pack_gated_panels` made of the gate and up
// projections of `intermediate` features each (+ `bias` [2 * intermediate]) -> [M, intermediate]:
// panel_linear then silu_mul in one pass, with their bits.
torch::Tensor panel_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t intermediate,
                             c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) % 2 == 0, "panel_silu_mul takes pack_gated_panels' pairs, got ",
              packed.sizes());
  x = checked_rows("panel_silu_mul", x, packed, packed.size(0) / 2, intermediate);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == 2 * intermediate),
              "panel_silu_mul: the bias must be [2 * ", intermediate, "] (gate's then up's)");
#if defined(PDSERVE_AMX) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && amx_runs(x.size(1)))
    return gated_product<AmxBf16>(x, packed, intermediate, bias);
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return gated_product<Bf16>(x, packed, intermediate, bias);
#endif
#if defined(__AVX512F__)
  return gated_product<Fp32>(x, packed, intermediate, bias);
#else
  TORCH_CHECK(false, "panel_silu_mul needs AVX-512");
#endif
}
