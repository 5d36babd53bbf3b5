// y = x W^T (+ b) in fp32 on CPU, for any number of rows, each row's result independent of the others.
//
// Every y[m, o] is one fused multiply-add chain over i = 0 .. in - 1 in order, started at 0, and then
// the bias is added. Nothing in that depends on how many rows the call has, how they are tiled or how
// many threads run, so a token's projections are bitwise the same in a decode step of 1 or 8 rows
// and in a prefill of 2,000. (torch's GEMM is not: on the dev machine its fp32 result for a row
// differed between 1 and 4+ rows.)
//
// W is packed once (`pack_linear_weight`) into panels of kLanes output features, [panels, in, kLanes]
// (the last panel zero-padded), so that vector lanes are outputs: y[m, panel] += x[m, i] * W[panel, i]
// needs one broadcast of x and one contiguous load of W per FMA of kLanes outputs, and no horizontal
// sum. Many rows: register tiles of 8 rows x 3 panels (24 accumulators, 11 loads per 24 FMAs; AVX2's
// 16 registers take 4 x 3, linear_tiles.h) over cache blocks of 96 rows x 3 panels (the block's panels, 3 x in x kLanes floats, stay in L2 while the
// rows stream past). Up to 16 rows (decode steps): W streamed from memory once, panel by panel. Work
// runs on torch's threads in chunks taken from a shared counter (parallel.h). (Measured on the dev
// machine's AVX-512 core: about 1.4x the throughput of the same chains over W read in place with
// per-output horizontal sums.)
//
// bf16 (`row_linear_bf16`, W packed by `pack_linear_weight_bf16`): the same tiles, with inputs taken two
// at a time. W is packed [panels, in / 2, kLanes, 2] (input features in pairs, zero-padded to even), so
// one 64-byte load holds a pair of weights for each of 16 outputs; x's pair is broadcast as one 32-bit
// value. Where the CPU has AVX-512 BF16, one `vdpbf16ps` per pair adds both products into the fp32
// accumulator; elsewhere the pair is widened to fp32 and added by two FMAs. Either way every y[m, o] is
// one fixed chain over the pairs in order, then the bias (fp32), then one rounding to bf16 (to nearest
// even): batch invariant as in fp32, and half the weight bytes per decode step. Where the CPU has AMX
// and in_features is a multiple of 32, the same packed weight is read by AMX tiles instead
// (linear_amx.h; one path for every row count, so still batch invariant).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "linear_amx.h"
#include "linear_tiles.h"

namespace {

using namespace kvserve_cpu;

bool amx_for(int64_t in_features) {
#ifdef KVSERVE_HAVE_AMX
  return in_features % amx::kTileInputs == 0 && amx::on();
#else
  (void)in_features;
  return false;
#endif
}

// One step of input: fp32 (Fp32, linear_tiles.h) takes one input feature (x a float, W's step kLanes
// floats), bf16 a pair (x two bf16 in a uint32, W's step kLanes such pairs). Both a W step and a
// broadcast x are one vf.
// AVX2 widens each bf16 pair to fp32 (dot_pairs): two registers per weight step and per x
struct Bf16 : WideningTileShape {
  static constexpr int64_t kMinMacsPerThread = Fp32::kMinMacsPerThread;
  using X = uint32_t;
  using W = uint32_t;
  using Y = at::BFloat16;
  static vf broadcast(uint32_t x) { return splat_pair(x); }
  static vf load_w(const uint32_t* panel, int64_t i, int64_t) { return load_pairs(panel + i * kLanes); }
  // acc + x0 * w0 + x1 * w1 lane-wise (lane = output feature) for the pair in each 32-bit lane
  static vf step(vf acc, vf x, vf w) { return dot_pairs(acc, x, w); }
  // rounded as at::BFloat16(v) rounds
  static void store(at::BFloat16* dst, vf v, int64_t n) { store_bf16_bits(dst, bf16_bits_of(v), n); }
  // the gated MLP's activation of bf16 g and u (each rounded as store rounds it), as torch's bf16 ops
  // compute it (vec.h glu_bf16), rounded once more
  static void store_glu(at::BFloat16* dst, vf g, vf u) {
    store_bf16_bits(dst, bf16_bits_of(glu_bf16(widen_bits(bf16_bits_of(g)), widen_bits(bf16_bits_of(u)))), kLanes);
  }
};

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t in_per_step) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "row_linear runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be contiguous [rows, in_features]");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kLanes * in_per_step &&
                  packed.size(0) * kLanes >= out_features && (packed.size(0) - 1) * kLanes < out_features,
              "packed must be the packed weight of a weight with out_features rows");
  TORCH_CHECK((x.size(1) + in_per_step - 1) / in_per_step == packed.size(1), "in_features of x (", x.size(1),
              ") and weight differ");
}

}  // namespace

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be an fp32 CPU tensor [out_features, in_features]");
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + kLanes - 1) / kLanes;
  auto padded = at::zeros({panels * kLanes, in}, weight.options());
  padded.narrow(0, 0, out).copy_(weight);
  return padded.view({panels, kLanes, in}).transpose(1, 2).contiguous();  // [panels, in, kLanes]
}

at::Tensor row_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "row_linear is fp32");
  check_packed(x, packed, out_features, 1);
  const int64_t rows = x.size(0), panels = packed.size(0);
  const at::Tensor b = padded_bias(bias, panels, out_features);
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
  const Shape<Fp32> s{x.data_ptr<float>(), packed.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                      y.data_ptr<float>(), x.size(1), out_features};
  run_blocks(s, rows, panels, x.size(1));
  return y;
}

at::Tensor pack_linear_weight_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "weight must be a bf16 CPU tensor [out_features, in_features]");
  const int64_t out = weight.size(0), in = weight.size(1), panels = (out + kLanes - 1) / kLanes;
  const int64_t in2 = (in + 1) / 2;
  auto padded = at::zeros({panels * kLanes, in2 * 2}, weight.options());
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(weight);
  // [panels, kLanes, in2, 2] -> [panels, in2, kLanes * 2]
  return padded.view({panels, kLanes, in2, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, in2, kLanes * 2});
}

at::Tensor row_linear_bf16(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t out_features) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "row_linear_bf16 takes bf16 x and a bf16 packed weight");
  check_packed(x_in, packed, out_features, 2);
  at::Tensor x = x_in;
  if (x.size(1) % 2) x = at::constant_pad_nd(x, {0, 1});  // the zero weight of the pad pairs with it
  const int64_t rows = x.size(0), panels = packed.size(0);
  const at::Tensor b = padded_bias(bias, panels, out_features);
  auto y = at::empty({rows, out_features}, x.options());
  if (rows == 0 || out_features == 0) return y;
#ifdef KVSERVE_HAVE_AMX
  if (amx_for(x.size(1))) {
    amx::run(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), b.defined() ? b.data_ptr<float>() : nullptr,
             y.data_ptr<at::BFloat16>(), rows, x.size(1), out_features, panels);
    return y;
  }
#endif
  const Shape<Bf16> s{reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()),
                      b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<at::BFloat16>(), x.size(1) / 2,
                      out_features};
  run_blocks(s, rows, panels, x.size(1));
  return y;
}

// The gated MLP's first half in one call: silu(x G^T + bg) * (x U^T + bu), over packed = G's and U's
// packed weights concatenated (inter outputs each, whole panels), as the fused forward's gate|up
// projection and activation. Each element is the unfused path's value: g and u are row_linear(_bf16)'s
// outputs (bf16: rounded, bias included), then SiLU and product as torch's ops of that dtype round
// them (vec.h glu_bf16; fp32 rounds nothing). The activation is the GEMM's epilogue, and the
// [rows, 2 inter] product is never stored: on AMX tiles (linear_amx.h store_glu) and on the lanes, whose
// register tiles take a gate panel with the up panel of the same outputs (linear_tiles.h, Glu). At 1,800
// rows of Qwen2.5-0.5B that product is 35 MB, past this machine's 32 MB L3: the stored product ran the
// lanes' gate|up at 718 GF/s where its halves ran at 955 (AMD EPYC, 2026-12-02). Each row's result
// depends on that row alone: batch invariant.
// linear_codes.cpp
at::Tensor row_linear_glu_codes(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                int64_t inter);

at::Tensor row_linear_glu(const at::Tensor& x_in, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t inter) {
  if (packed.scalar_type() == at::kByte) return row_linear_glu_codes(x_in, packed, bias, inter);  // GGUF codes
  TORCH_CHECK(inter > 0 && inter % 16 == 0 && packed.dim() == 3 && packed.size(0) * kLanes == 2 * inter,
              "row_linear_glu: packed must be gate's and up's packed weights of inter (a multiple of 16) outputs each");
  const bool bf16 = x_in.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x_in.scalar_type() == at::kFloat, "row_linear_glu takes fp32 or bf16 x");
  TORCH_CHECK(packed.scalar_type() == x_in.scalar_type(), "row_linear_glu: x and the packed weight differ in dtype");
  check_packed(x_in, packed, 2 * inter, bf16 ? 2 : 1);
  at::Tensor x = x_in;
  if (bf16 && x.size(1) % 2) x = at::constant_pad_nd(x, {0, 1});  // the zero weight of the pad pairs with it
  const int64_t rows = x.size(0), panels = packed.size(0);
  const at::Tensor b = padded_bias(bias, panels, 2 * inter);
  auto y = at::empty({rows, inter}, x.options());
  if (rows == 0) return y;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
#ifdef KVSERVE_HAVE_AMX
  if (bf16 && amx_for(x.size(1))) {
    amx::run(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), bp, y.data_ptr<at::BFloat16>(), rows,
             x.size(1), inter, panels / 2, panels / 2);
    return y;
  }
#endif
  if (bf16) {
    Shape<Bf16> s{reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()), bp, y.data_ptr<at::BFloat16>(),
                  x.size(1) / 2, inter};
    s.glu_half = panels / 2;
    run_blocks<Bf16, true>(s, rows, panels / 2, x.size(1));
  } else {
    Shape<Fp32> s{x.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), x.size(1), inter};
    s.glu_half = panels / 2;
    run_blocks<Fp32, true>(s, rows, panels / 2, x.size(1));
  }
  return y;
}

// argmax_rows(row_linear_bf16(x, packed, bias, out_features)[:, :limit]) without the logits: a greedy step's
// LM head on AMX tiles (linear_amx.h Argmax), the same indices bitwise. AMX only (linear_amx(in) says).
at::Tensor row_linear_bf16_argmax(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                  int64_t out_features, int64_t limit) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "row_linear_bf16_argmax takes bf16 x and a bf16 packed weight");
  check_packed(x, packed, out_features, 2);
  TORCH_CHECK(limit > 0 && limit <= out_features, "limit must be in [1, out_features]");
  auto ids = at::empty({x.size(0)}, x.options().dtype(at::kLong));
#ifdef KVSERVE_HAVE_AMX
  TORCH_CHECK(amx_for(x.size(1)), "row_linear_bf16_argmax runs on AMX tiles only (linear_amx(in_features))");
  if (x.size(0) == 0) return ids;
  const int64_t panels = packed.size(0);
  const at::Tensor b = padded_bias(bias, panels, out_features);
  amx::run(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), b.defined() ? b.data_ptr<float>() : nullptr,
           nullptr, x.size(0), x.size(1), out_features, panels, 0, ids.data_ptr<int64_t>(), limit);
  return ids;
#else
  TORCH_CHECK(false, "row_linear_bf16_argmax: this build of the extension has no AMX tiles");
#endif
}

bool linear_amx(int64_t in_features) { return amx_for(in_features); }

bool set_amx(bool enabled) {
#ifdef KVSERVE_HAVE_AMX
  const bool before = amx::enabled;
  amx::enabled = enabled;
  return before;
#else
  (void)enabled;
  return false;
#endif
}
