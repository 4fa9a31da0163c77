// AMX tiles (Intel Xeon with amx_tile and amx_bf16), for the kernels that multiply bf16 on
// them: panel_amx.h (linear layers) and attention_common.h (attention scores). Every kernel
// uses one configuration, all 8 tiles 16 rows of 64 bytes: a C tile is 16 rows x 16 fp32
// sums, an A tile 16 rows of 32 bf16 inputs, a B tile 16 input pairs x 16 outputs (pairs
// interleaved, as vdpbf16ps takes them).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

constexpr int kRows = 16;  // rows of a tile

// Whether this process may use the tiles: Linux grants AMX's state on request (once, for every
// thread of the process); where it refuses, the kernels keep their AVX-512 paths.
inline bool permitted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

// `rows` rows in tiles 0, 1, 3, 4 and 5 (the attention kernels' C and A tiles), 16 in tiles 2,
// 6 and 7 (their B tiles): a tile's rows are independent, so fewer rows change no row's bits
// and cost less where a kernel has fewer (a decode step's heads of one kv head).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int short_rows) {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = (t == 2 || t >= 6) ? kRows : short_rows;
  }
};

// The tiles configured on the calling thread for the scope's lifetime (where permitted):
// around a thread's share of a kernel's work, since other libraries' AMX kernels (oneDNN's)
// load their own configuration between ours. `short_rows`: TileConfig's.
struct Scope {
  const bool on = permitted();
  explicit Scope(int short_rows = kRows) {
    const TileConfig config(short_rows);
    // GCC's ldtilecfg builtin does not tell the compiler that it reads the config, whose
    // stores it then dropped (a fault at -O2): the empty asm says the memory is read.
    asm volatile("" : : "r"(&config) : "memory");
    if (on) _tile_loadconfig(&config);
  }
  ~Scope() {
    if (on) _tile_release();
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;
};

}  // namespace amx
#endif
