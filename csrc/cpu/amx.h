// What the AMX paths share (linear_amx.h, attention_amx.h): whether the tiles may be used here, and the
// one tile configuration they run under. Built only with -mamx-tile -mamx-bf16 (the extension's
// AVX512_BF16_AMX build, kvserve/kernels/cpu_ext.py); KVSERVE_HAVE_AMX says so.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVSERVE_HAVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvserve_cpu {
namespace amx {

constexpr int64_t kTileRows = 16;  // every tile is 16 rows of 64 bytes

// set_amx(False): the AVX-512 paths on an AMX machine (tests, benchmarks, KVSERVE_CPU_AMX=0). One flag
// for the process: a path is chosen per call, never per row.
inline bool enabled = true;

// The OS hands a process the tile registers' state only on request (Linux 5.16+: arch_prctl
// ARCH_REQ_XCOMP_PERM for XTILEDATA); without it the first tile instruction faults. Asked once.
inline bool available() {
  static const bool ok = [] {
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes (palette 1). The configuration is per thread and other libraries on
// the same thread (oneDNN) load their own, so each worker loads it at the start of every call.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  _tile_loadconfig(&config);
}

// The tiles may run here and now (the CPU has them, the OS granted them, set_amx did not turn them off).
inline bool on() { return enabled && available(); }

}  // namespace amx
}  // namespace kvserve_cpu

#endif
