// The small per-token operations of a Llama-family decoder layer, for the fused CPU forward
// (kvserve/models/fused_llama.py): RMSNorm (optionally after the residual add), rotary embedding and the
// dense KV write.
//
// Each is one call per layer where Hugging Face's modeling code dispatches six to twelve torch ops, which
// is most of a small model's decode step on CPU. They compute what the modeling code computes, with the
// same rounding points in bf16:
//   rms_norm:      y = w * dtype(x * rsqrt(mean(x^2) + eps))   (x^2 summed in fp32)
//   add_rms_norm_: residual = dtype(residual + x); y = rms_norm(residual)
//   rope_:         q = dtype(dtype(q * cos) + dtype(rotate_half(q) * sin)), the same for k, in place
// The rotary products and sums are bitwise those of torch's elementwise ops (one rounding each, no fused
// multiply-add: the extension is compiled with -ffp-contract=off). The sum of squares has an order of its
// own (kLanes partial sums, then csrc/cpu/vec.h's fixed halving), so norms agree with torch's to rounding,
// not bitwise. Every row is computed by the same sequence of operations whatever the other rows: batch
// invariant, like the linear and attention kernels.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "parallel.h"
#include "vec.h"

namespace {

using namespace kvserve_cpu;

constexpr int64_t kMinElementsPerThread = 1 << 16;  // below this a row range stays on the calling thread

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}
template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);  // c10::BFloat16: to nearest even; float: exact
}

template <typename T>
float inv_rms(const T* x, int64_t n, float eps) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = f32(x[i + l]);
      lanes[l] += v * v;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = f32(x[i]);
    lanes[l] += v * v;
  }
  const float mean = hsum(loadu(lanes)) / static_cast<float>(n);
  return 1.0f / std::sqrt(mean + eps);
}

template <typename T>
void norm_row(const T* x, const T* w, T* y, int64_t n, float eps) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) y[i] = round_to<T>(f32(w[i]) * f32(round_to<T>(f32(x[i]) * r)));
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name, " must be a 2-D CPU tensor with contiguous rows");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), "the norm weight must be [", x.size(1), "]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "the norm weight's dtype ", w.scalar_type(), " is not ", name, "'s ",
              x.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", x.scalar_type());
}

template <typename F>
void for_rows(int64_t rows, int64_t cols, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerThread / std::max<int64_t>(cols, 1));
  parallel_chunks(rows, grain, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "x");
  auto y = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t r) { norm_row(xp + r * x.stride(0), wp, yp + r * n, n, static_cast<float>(eps)); });
  });
  return y;
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(residual, weight, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() && x.stride(1) == 1,
              "x must match the residual's shape and dtype, with contiguous rows");
  auto y = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    for_rows(rows, n, [&](int64_t r) {
      scalar_t* res = rp + r * residual.stride(0);
      const scalar_t* xr = xp + r * x.stride(0);
      for (int64_t i = 0; i < n; ++i) res[i] = round_to<scalar_t>(f32(res[i]) + f32(xr[i]));
      norm_row(res, wp, yp + r * n, n, static_cast<float>(eps));
    });
  });
  return y;
}

// qk: [rows, heads * head_dim] columns of q and k heads (a view into the fused qkv projection is fine:
// rows may have any stride); cos, sin: [rows, head_dim] as the model's rotary embedding returns them.
void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qk.device().is_cpu() && qk.dim() == 2 && qk.stride(1) == 1 && qk.size(1) >= heads * head_dim,
              "qk must be a 2-D CPU tensor with contiguous rows of at least heads * head_dim columns");
  TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(qk.scalar_type() == at::kFloat || qk.scalar_type() == at::kBFloat16,
              "qk must be float32 or bfloat16, got ", qk.scalar_type());
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == qk.size(0) && cos.size(1) == head_dim &&
                  cos.stride(1) == 1 && sin.stride(1) == 1,
              "cos and sin must be [rows, head_dim] with contiguous rows");
  TORCH_CHECK(cos.scalar_type() == qk.scalar_type() && sin.scalar_type() == qk.scalar_type(),
              "cos and sin must have qk's dtype");
  const int64_t rows = qk.size(0), half = head_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qk.scalar_type(), "rope_", [&] {
    scalar_t* base = qk.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    for_rows(rows, heads * head_dim, [&](int64_t r) {
      const scalar_t* c = cp + r * cos.stride(0);
      const scalar_t* s = sp + r * sin.stride(0);
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* x = base + r * qk.stride(0) + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = f32(x[i]), b = f32(x[i + half]);  // rotate_half(x) = [-x2, x1]
          const float lo = f32(round_to<scalar_t>(a * f32(c[i]))) + f32(round_to<scalar_t>(-b * f32(s[i])));
          const float hi = f32(round_to<scalar_t>(b * f32(c[i + half]))) + f32(round_to<scalar_t>(a * f32(s[i + half])));
          x[i] = round_to<scalar_t>(lo);
          x[i + half] = round_to<scalar_t>(hi);
        }
      }
    });
  });
}

// RopeRotator.apply (kvserve/kvcache/rope.py) in one call: post-RoPE keys [rows, heads, head_dim] moved to new
// positions, a new tensor. cos, sin: [rows, rotary_dim / 2] float32, the rotation by each row's delta. Per
// pair (x1, x2) = (x[i], x[i + half]): x1' = x1 * c - x2 * s, x2' = x2 * c + x1 * s, each product and sum
// rounded in float32 as torch's elementwise ops round them (no fused multiply-add: -ffp-contract=off), the
// result rounded once to the key's dtype; dimensions past rotary_dim are copied. Bitwise the torch path.
at::Tensor rotate_keys(const at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim) {
  TORCH_CHECK(key.device().is_cpu() && key.dim() == 3 && key.is_contiguous(), "key must be a contiguous CPU [rows, heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16 || key.scalar_type() == at::kHalf,
              "key must be float32, bfloat16 or float16, got ", key.scalar_type());
  const int64_t rows = key.size(0), heads = key.size(1), head_dim = key.size(2), half = rotary_dim / 2;
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rotary_dim must be even and at most head_dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == rows * half && sin.numel() == rows * half,
              "cos and sin must be contiguous float32 [rows, rotary_dim / 2]");
  auto out = at::empty_like(key);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "rotate_keys", [&] {
    const scalar_t* kp = key.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    for_rows(rows, heads * head_dim, [&](int64_t r) {
      const float* c = cp + r * half;
      const float* s = sp + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* x = kp + (r * heads + h) * head_dim;
        scalar_t* y = op + (r * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = f32(x[i]), x2 = f32(x[i + half]);
          const float a = x1 * c[i], b = x2 * s[i], d = x2 * c[i], e = x1 * s[i];
          y[i] = static_cast<scalar_t>(a - b);
          y[i + half] = static_cast<scalar_t>(d + e);
        }
        for (int64_t i = rotary_dim; i < head_dim; ++i) y[i] = x[i];
      }
    });
  });
  return out;
}

// DenseLayerKV.write in one call: each row of key and value [rows, kv_heads, head_dim] into the flat slot
// it maps to in the pool [num_blocks, block_size, kv_heads, head_dim], in place; a slot below 0 (a row
// whose KV is not kept) is skipped, and every slot is checked before anything is written. key and value
// may have any strides (the fused forward's are column views of the fused qkv projection: rows strided,
// each row's heads contiguous, copied whole). The pool's dtype: a copy, no conversion.
void kv_write_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& key,
               const at::Tensor& value) {
  TORCH_CHECK(k_cache.device().is_cpu() && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must be contiguous CPU pools [num_blocks, block_size, kv_heads, head_dim] alike");
  const int64_t heads = k_cache.size(2), head_dim = k_cache.size(3), capacity = k_cache.size(0) * k_cache.size(1);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(1) == heads && t->size(2) == head_dim &&
                    t->scalar_type() == k_cache.scalar_type(),
                "key and value must be [rows, kv_heads, head_dim] CPU tensors in the pool's dtype");
  }
  TORCH_CHECK(slots.device().is_cpu() && slots.dim() == 1 && slots.size(0) == key.size(0) &&
                  value.size(0) == key.size(0),
              "slots must be [rows], one per row of key and value");
  const at::Tensor sl = slots.to(at::kLong).contiguous();
  const int64_t rows = key.size(0), elem = k_cache.element_size(), row = heads * head_dim;
  const int64_t* s = sl.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {  // all checked before any is written
    TORCH_CHECK(s[r] < capacity, "slot ", s[r], " is past the pool's ", capacity, " rows");
  }
  const auto copy_rows = [&](at::Tensor& pool, const at::Tensor& src) {
    auto* dst = static_cast<char*>(pool.data_ptr());
    const auto* base = static_cast<const char*>(src.data_ptr());
    const bool whole = src.stride(2) == 1 && src.stride(1) == head_dim;
    for (int64_t r = 0; r < rows; ++r) {
      if (s[r] < 0) continue;
      char* out = dst + s[r] * row * elem;
      if (whole) {
        std::memcpy(out, base + r * src.stride(0) * elem, row * elem);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) {
          std::memcpy(out + (h * head_dim + d) * elem,
                      base + (r * src.stride(0) + h * src.stride(1) + d * src.stride(2)) * elem, elem);
        }
      }
    }
  };
  copy_rows(k_cache, key);
  copy_rows(v_cache, value);
}

namespace {

// Lanes [i, i + kLanes) of a row as fp32 (a bf16 row's bits widened: exact).
inline vf load_lanes(const float* row, int64_t i) { return loadu(row + i); }
inline vf load_lanes(const c10::BFloat16* row, int64_t i) {
  typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
  vh h;
  std::memcpy(&h, row + i, sizeof(vh));
  return widen_bits(__builtin_convertvector(h, vu));
}

// Bit j set where lane j of a comparison's result is true (all ones).
inline uint32_t lane_mask(vi hit) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask(reinterpret_cast<__m512i>(hit), reinterpret_cast<__m512i>(hit));
#elif defined(__AVX2__)
  return static_cast<uint32_t>(_mm256_movemask_ps(reinterpret_cast<__m256>(hit)));
#else
  uint32_t mask = 0;
  for (int j = 0; j < kLanes; ++j) mask |= hit[j] ? 1u << j : 0u;
  return mask;
#endif
}

// torch.argmax of one row: the index of its first maximum, or of its first NaN when it has one (a NaN
// is larger than everything to torch.argmax). Two passes of kLanes at a time: the max (and whether a
// NaN occurs), then the first index equal to it (-0 equals +0, as the comparisons of torch's argmax).
template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  const int64_t whole = n / kLanes * kLanes;
  vf mx = splat(-INFINITY);
  vi nan{};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const vf v = load_lanes(row, i);
    nan |= v != v;
    mx = v > mx ? v : mx;
  }
  float m = hmax(mx);
  bool has_nan = false;
  for (int j = 0; j < kLanes; ++j) has_nan = has_nan || nan[j] != 0;
  for (int64_t i = whole; i < n; ++i) {
    const float v = f32(row[i]);
    has_nan = has_nan || v != v;
    m = v > m ? v : m;
  }
  const vf target = splat(m);
  for (int64_t i = 0; i < whole; i += kLanes) {
    const vf v = load_lanes(row, i);
    const uint32_t hit = lane_mask(has_nan ? vi(v != v) : vi(v == target));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t i = whole; i < n; ++i) {
    const float v = f32(row[i]);
    if (has_nan ? v != v : v == m) return i;
  }
  return 0;  // an all -inf row: -inf == m at index 0 above; only n == 0 gets here (torch raises)
}

}  // namespace

// torch.argmax(x, dim=-1) of a float32 or bf16 [rows, n] tensor with contiguous rows, the same indices
// (the first maximum; the first NaN of a row that has one), vectorized where torch's reduction is scalar
// (10 ms at [128, 49152] on this project's CPUs; this: about a read of the rows).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be a non-empty 2-D CPU tensor with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16, got ",
              x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kFloat) {
    const float* xp = x.data_ptr<float>();
    for_rows(rows, n, [&](int64_t r) { o[r] = row_argmax(xp + r * stride, n); });
  } else {
    const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
    for_rows(rows, n, [&](int64_t r) { o[r] = row_argmax(xp + r * stride, n); });
  }
  return out;
}
