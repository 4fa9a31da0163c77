// bf16 products on panel-packed weights through AMX tiles (Intel Xeon with amx_bf16), for
// panel_linear.cpp: sums of 16 rows of x times one panel of 48 outputs, in fp32.
//
// The panels are panel_linear's own (a panel's k-th row: the 48 outputs' weights for the input
// pair (2k, 2k+1), 192 bytes), which is AMX's pair-interleaved layout already: the weights of
// 16 pairs for 16 outputs are a B tile of 16 rows of 64 bytes, 192 bytes apart. A tile of 16
// rows of x (32 inputs each, K * 2 bytes apart) is the A tile; a panel keeps its three
// vectors' sums of each 16 rows in three C tiles (amx.h has the tiles' configuration).
//
// Rows are always 16: fewer rows are padded with zeros by the caller, and a row's sums depend
// only on its own inputs and the weight (a tile's rows never mix), so a row's bits are the same
// at any row count. They are not the bits of vdpbf16ps (the AVX-512 path), which sums a pair's
// two products in the other order: a weight runs on one path or the other, by its shape alone.
// Each output sums all K's pairs on its C tile, with no K blocks: the AVX-512 path's blocks
// of 512 or 1,024 inputs are oneDNN's order there, which the tiles do not give anyway, and
// storing and adding each block's sums cost 5-9% of a product (benchmarks/README.md). At 2,048
// rows of SmolLM2's shapes these are the bits of oneDNN's own AMX product.
#pragma once

#include "amx.h"

#if defined(PDSERVE_AMX)

namespace amx {

constexpr int64_t kUnits = 16;   // input pairs per tile (32 inputs): K must be a multiple of 32
constexpr int kVectors = 3;      // C tiles per panel row block (48 outputs)

constexpr int64_t kRowBytes = 192;  // a panel's unit row: 48 outputs x 2 inputs x 2 bytes
constexpr int64_t kSumsBytes = kVectors * 16 * 4;  // a row of sums: 48 fp32

// `tiles` row blocks of 16 rows (x0's, and x1's when `tiles` is 2; rows `ldx` elements apart)
// times units [0, units) of the panel at `w`, into C tiles 0-2 (x0) and 3-5 (x1).
// One row block: C 0-2, A 6, B 3-5. Two: C 0-5, each B (tile 7) feeding both A tiles (6).
template <int tiles>
inline void panel_tiles(const uint16_t* x0, const uint16_t* x1, int64_t ldx, const uint16_t* w, int64_t units) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  if (tiles == 2) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
  }
  for (int64_t k = 0; k < units; k += kUnits) {
    const char* b = reinterpret_cast<const char*>(w) + k * kRowBytes;
    if (tiles == 1) {
      _tile_loadd(6, x0 + 2 * k, ldx * 2);
      _tile_loadd(3, b, kRowBytes);
      _tile_loadd(4, b + 64, kRowBytes);
      _tile_loadd(5, b + 128, kRowBytes);
      _tile_dpbf16ps(0, 6, 3);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(2, 6, 5);
    } else {
      _tile_loadd(7, b, kRowBytes);
      _tile_loadd(6, x0 + 2 * k, ldx * 2);
      _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(6, x1 + 2 * k, ldx * 2);
      _tile_dpbf16ps(3, 6, 7);
      _tile_loadd(7, b + 64, kRowBytes);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(6, x0 + 2 * k, ldx * 2);
      _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(7, b + 128, kRowBytes);
      _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(6, x1 + 2 * k, ldx * 2);
      _tile_dpbf16ps(5, 6, 7);
    }
  }
}

// `tiles` (1 or 2) row blocks of 16 rows of x (x0's, then x1's; rows `ldx` elements apart) times
// units [0, units) of the panel at `w`, into `sums` [16 * tiles][48] (fp32).
template <int tiles>
inline void panel_sums(const uint16_t* x0, const uint16_t* x1, int64_t ldx, const uint16_t* w, int64_t units,
                       float (*sums)[kVectors * 16]) {
  panel_tiles<tiles>(x0, x1, ldx, w, units);
  float* out = &sums[0][0];
  _tile_stored(0, out, kSumsBytes);
  _tile_stored(1, out + 16, kSumsBytes);
  _tile_stored(2, out + 32, kSumsBytes);
  if (tiles == 2) {
    _tile_stored(3, out + kRows * kVectors * 16, kSumsBytes);
    _tile_stored(4, out + kRows * kVectors * 16 + 16, kSumsBytes);
    _tile_stored(5, out + kRows * kVectors * 16 + 32, kSumsBytes);
  }
}

}  // namespace amx
#endif
