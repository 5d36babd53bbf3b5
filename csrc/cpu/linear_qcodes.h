// The row format of linear_qcodes.cpp's packed codes, shared by its packer (linear_qcodes_pack.cpp) and
// its kernels (linear_qcodes.cpp, whose header comment describes the planes).
#pragma once

#include <cstdint>

namespace kvserve_cpu {
namespace qcodes {

constexpr int32_t kMagic = 0x3151564b;  // "KVQ1"
enum Kind : int32_t { kF32 = 0, kF16 = 1, kSuper = 2 };

// A packed row's first 64 bytes: the format and the byte offset of each plane within the row (0: absent).
struct Format {
  int32_t magic, bits, zero, in, group, kind, offsets, super_groups;
  int32_t nib, hi, a, o, a_sub, o_sub, row_bytes, reserved;
};
static_assert(sizeof(Format) == 64, "the header is 64 bytes");

}  // namespace qcodes
}  // namespace kvserve_cpu
