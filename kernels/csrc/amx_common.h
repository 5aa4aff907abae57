// What the AMX kernels (amx_linear_cpu.cpp, attention_amx.h) share: whether the process may use
// AMX, and the tile configuration.
#pragma once
#include <cstdint>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TANDEM_AMX 1
#endif

namespace tandem_cpu::amx {

inline bool usable() {
#ifdef TANDEM_AMX
  // Linux hands out AMX's tile state per process on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

#ifdef TANDEM_AMX
// rows[t] x colsb[t] bytes per tile register; a tile with no rows is configured empty (touching it is #UD)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int64_t tile_rows, int64_t bytes) {
    rows[tile] = uint8_t(tile_rows);
    colsb[tile] = tile_rows > 0 ? uint16_t(bytes) : 0;
  }
  void load() const {
    // GCC does not see that ldtilecfg reads the struct and drops the stores before it: make them stay
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};
#endif
}  // namespace tandem_cpu::amx
