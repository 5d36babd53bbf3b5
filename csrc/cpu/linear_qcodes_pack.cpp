// pack_linear_qcodes: a GGUF linear's codes and factors (models/code_layout.py chose the layout) into the
// rows linear_qcodes.cpp reads; its header comment describes them.
#include <torch/extension.h>

#include <cstring>
#include <vector>

#include "linear_qcodes.h"
#include "vec.h"

namespace {

using namespace kvserve_cpu;
using namespace kvserve_cpu::qcodes;

// plane [out, n] (any dtype) -> [panels, n * kLanes * itemsize] bytes: lane l of element j of panel p is
// plane[p * kLanes + l, j], padded outputs zero
at::Tensor lanes_of(const at::Tensor& plane, int64_t panels) {
  const int64_t out = plane.size(0), n = plane.size(1);
  auto padded = at::zeros({panels * kLanes, n}, plane.options());
  padded.narrow(0, 0, out).copy_(plane);
  return padded.view({panels, kLanes, n}).transpose(1, 2).contiguous().view({panels, -1}).view(at::kByte);
}

// uint32 words [out, in / per] of u [out, in] int64: the low `width` bits of u >> shift of step s at bits
// width * (s % per) of word s / per
at::Tensor words_of(const at::Tensor& u, int64_t per, int64_t width, int64_t shift) {
  const int64_t out = u.size(0), in = u.size(1);
  const auto pos = at::arange(per, u.options()).mul_(width);
  const auto bits = u.view({out, in / per, per}).bitwise_right_shift(shift).bitwise_and_((1 << width) - 1);
  const auto word = bits.bitwise_left_shift(pos).sum(2);                       // < 2^32
  return (word - word.ge(int64_t{1} << 31).to(at::kLong) * (int64_t{1} << 32)).to(at::kInt);  // its bits
}

// [panels, in * planes * 2] bytes: per step, for k < planes, a 16-bit mask whose bit l is bit 4 + k of u
// of lane l (u [panels * kLanes, in] int64)
at::Tensor lane_masks(const at::Tensor& u, int64_t planes, int64_t panels) {
  const int64_t in = u.size(1);
  const auto lane_bit = at::arange(kLanes, u.options()).view({1, kLanes, 1});
  std::vector<at::Tensor> masks;
  for (int64_t k = 0; k < planes; ++k) {
    const auto bits = u.view({panels, kLanes, in}).bitwise_right_shift(4 + k).bitwise_and_(1);
    masks.push_back(bits.bitwise_left_shift(lane_bit).sum(1));  // [panels, in] < 2^16
  }
  const auto m = at::stack(masks, 2);                                      // [panels, in, planes]
  return (m - m.ge(1 << 15).to(at::kLong) * (1 << 16)).to(at::kShort).view({panels, -1}).view(at::kByte);
}


}  // namespace

// codes int8 [out, in] (C), bits in {4, 5, 6, 8} (8: zero must be 0), C - zero in [0, 2^bits), group 16 or
// 32; kind 0: a, o fp32 [out, groups]; 1: a, o fp16 [out, groups]; 2: a, o fp32 [out, groups /
// super_groups] and a_sub, o_sub int8 [out, groups]. o (and o_sub) undefined: no offsets (O = -0.0).
at::Tensor pack_linear_qcodes(const at::Tensor& codes, int64_t bits, int64_t zero, int64_t group, int64_t kind,
                              int64_t super_groups, const at::Tensor& a, const c10::optional<at::Tensor>& o,
                              const c10::optional<at::Tensor>& a_sub, const c10::optional<at::Tensor>& o_sub) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == at::kChar && codes.dim() == 2,
              "codes must be an int8 CPU tensor [out_features, in_features]");
  const int64_t out = codes.size(0), in = codes.size(1), panels = (out + kLanes - 1) / kLanes;
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8, not ", bits);
  TORCH_CHECK(group == 16 || group == 32, "codes come in groups of 16 or 32 inputs, not ", group);
  TORCH_CHECK(in > 0 && in % group == 0 && in % (bits == 5 ? 32 : 16) == 0, "in_features ", in,
              " is not a multiple of the group and of the code words' steps");
  TORCH_CHECK(kind >= kF32 && kind <= kSuper, "kind must be 0 (fp32), 1 (fp16) or 2 (super-blocks)");
  const int64_t groups = in / group;
  const bool offsets = o.has_value() && o->defined();
  const at::ScalarType main_dtype = kind == kF16 ? at::kHalf : at::kFloat;
  const int64_t main_cols = kind == kSuper ? groups / std::max<int64_t>(super_groups, 1) : groups;
  TORCH_CHECK(kind != kSuper || (super_groups > 0 && groups % super_groups == 0), "super_groups must divide ", groups);
  auto check_main = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == main_dtype && t.dim() == 2 && t.size(0) == out && t.size(1) == main_cols, name,
                " must be ", main_dtype, " [out_features, ", main_cols, "]");
  };
  auto check_sub = [&](const c10::optional<at::Tensor>& t, const char* name) {
    TORCH_CHECK(t.has_value() && t->defined() && t->scalar_type() == at::kChar && t->dim() == 2 &&
                    t->size(0) == out && t->size(1) == groups,
                name, " must be int8 [out_features, ", groups, "]");
  };
  check_main(a, "a");
  if (offsets) check_main(*o, "o");
  if (kind == kSuper) {
    check_sub(a_sub, "a_sub");
    if (offsets) check_sub(o_sub, "o_sub");
  }
  TORCH_CHECK(bits < 8 || zero == 0, "8-bit codes are stored as they are: zero must be 0");
  // padded outputs get C = 0 (and zero factors): weights +0.0, as pack_linear_weight pads
  at::Tensor u;
  if (bits < 8) {
    u = at::zeros({panels * kLanes, in}, at::kLong);
    u.narrow(0, 0, out).copy_(codes);
    u.sub_(zero);
    TORCH_CHECK(u.min().item<int64_t>() >= 0 && u.max().item<int64_t>() < (int64_t{1} << bits), "codes minus ", zero,
                " do not fit in ", bits, " bits (0 among them: padded outputs)");
  }

  std::vector<at::Tensor> parts;  // each [panels, bytes], in the row's order
  Format f{kMagic, static_cast<int32_t>(bits), static_cast<int32_t>(zero), static_cast<int32_t>(in),
           static_cast<int32_t>(group), static_cast<int32_t>(kind), offsets, static_cast<int32_t>(super_groups),
           0, 0, 0, 0, 0, 0, 0, 0};
  int64_t at_byte = sizeof(Format);
  auto add = [&](const at::Tensor& bytes) {
    parts.push_back(bytes);
    const int64_t start = at_byte;
    at_byte += bytes.size(1);
    return static_cast<int32_t>(start);
  };
  if (bits == 8) {
    f.nib = add(lanes_of(codes, panels));
  } else {
    f.nib = add(lanes_of(words_of(u, 8, 4, 0), panels));
#if defined(__AVX512F__)
    if (bits > 4) f.hi = add(lane_masks(u, bits - 4, panels));
#else
    if (bits == 5) f.hi = add(lanes_of(words_of(u, 32, 1, 4), panels));
    if (bits == 6) f.hi = add(lanes_of(words_of(u, 16, 2, 4), panels));
#endif
  }
  f.a = add(lanes_of(a, panels));
  if (kind == kSuper) f.a_sub = add(lanes_of(*a_sub, panels));
  if (offsets) {
    f.o = add(lanes_of(*o, panels));
    if (kind == kSuper) f.o_sub = add(lanes_of(*o_sub, panels));
  }
  f.row_bytes = static_cast<int32_t>((at_byte + 63) / 64 * 64);
  auto header = at::empty({1, static_cast<int64_t>(sizeof(Format))}, at::kByte);
  std::memcpy(header.data_ptr<uint8_t>(), &f, sizeof f);
  parts.insert(parts.begin(), header.expand({panels, -1}));
  parts.push_back(at::zeros({panels, f.row_bytes - at_byte}, at::kByte));
  return at::cat(parts, 1).contiguous();
}

