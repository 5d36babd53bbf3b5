// Paged decode attention on CPU, reading the block table in place (no gathered copy of the history).
//
// One decode row per sequence: query [B, H, D]; K/V through the block table [B, max_blocks] of a
// pool [num_blocks, block_size, H_kv, D]. Work items are (sequence, split of the context); an item
// walks its blocks once, and for each block every KV head and every query head of its GQA group,
// so a block's K/V bytes are read from memory once, together, with an online softmax per query
// head (flash-decoding). Splits are merged through their log-sum-exp. Items run in parallel with
// at::parallel_for (torch's thread pool). The inner loops use GCC vector extensions (16 fp32 lanes
// with AVX-512, 8 with AVX2, else 4); kvserve/kernels/cpu_ext.py compiles it with the ISA flags of
// torch's CPU capability.
//
// KV formats (a `Reader` each) hand the kernel fp32 rows of one (block, KV head): dense fp32 in
// place; bf16 / fp16, fp8_e4m3 and int8 KIVI converted into a block-sized scratch (fp8's per-token
// scale is folded into the score and the probability instead). Layouts: kvserve/quant/.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using namespace kvserve_cpu;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (scores minus their running max), lane-wise: Cephes expf polynomial, about 1 ulp.
// Below -87 it returns ~1e-38 rather than 0, which no softmax sum can notice.
inline vf exp_nonpositive(vf x) {
  const vf lo = splat(-87.0f);
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf poly = splat(1.9875691500e-4f);
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  poly = poly * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf pow2;
  std::memcpy(&pow2, &bits, sizeof(vf));
  return poly * pow2;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// kLanes e4m3fn codes -> floats with integer operations: the code's exponent and mantissa bits are
// placed at fp32's bit 20, which reads as 2^(e - 127) (1 + m/8) (or m 2^-129 for e = 0), and a multiply
// by 2^120 rebiases that to e4m3's 2^(e - 7) (1 + m/8) (or m 2^-9: subnormals come out right too).
// 0x7f / 0xff are NaN as in float8_e4m3fn.
inline vi widen_u8(const uint8_t* p) {  // kLanes bytes -> int32 lanes (intrinsics: GCC's generic
                                        // convertvector of a byte vector is a scalar mess)
#if defined(__AVX512F__)
  return reinterpret_cast<vi>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<vi>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  vi out;
  for (int i = 0; i < kLanes; ++i) out[i] = p[i];
  return out;
#endif
}

inline vf e4m3_to_float(const uint8_t* codes) {
  const vi c = widen_u8(codes);
  const vi bits = ((c & 0x80) << 24) | ((c & 0x7f) << 20);
  vf f;
  std::memcpy(&f, &bits, sizeof(vf));
  f = f * 0x1p120f;
  return (c & 0x7f) == 0x7f ? splat(std::numeric_limits<float>::quiet_NaN()) : f;
}

// The fp32 rows of one (block, KV head): row t of K at k + t * stride (same for V), and optional
// per-token multipliers (null = 1): score_t = k_mult[t] * q.k_t, and p_t * v_mult[t] weighs v_t.
struct BlockRows {
  const float* k;
  const float* v;
  int64_t stride;
  const float* k_mult;
  const float* v_mult;
};

// Per-thread scratch a Reader converts rows into: [block_size, D] each, plus multipliers.
struct Scratch {
  std::vector<float> k, v, k_mult, v_mult;
  Scratch(int64_t block_size, int64_t d) : k(block_size * d), v(block_size * d), k_mult(block_size), v_mult(block_size) {}
};

template <typename T>
struct DenseReader {
  const T* k;
  const T* v;  // [num_blocks, block_size, H_kv, D]
  int64_t block_size, h_kv, d;

  BlockRows rows(int64_t block, int64_t h, int64_t n, Scratch& sc) const {
    const int64_t first = (block * block_size * h_kv + h) * d, stride = h_kv * d;
    if constexpr (std::is_same_v<T, float>) {
      return {k + first, v + first, stride, nullptr, nullptr};
    } else {
      for (int64_t t = 0; t < n; ++t) {
        to_float(k + first + t * stride, sc.k.data() + t * d, d);
        to_float(v + first + t * stride, sc.v.data() + t * d, d);
      }
      return {sc.k.data(), sc.v.data(), d, nullptr, nullptr};
    }
  }
};

struct Fp8Reader {
  const uint8_t* k_codes;  // [num_blocks, block_size, H_kv, D]
  const uint8_t* v_codes;
  const float* k_scale;  // [num_blocks, block_size, H_kv]
  const float* v_scale;
  int64_t block_size, h_kv, d;

  BlockRows rows(int64_t block, int64_t h, int64_t n, Scratch& sc) const {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token_head = (block * block_size + t) * h_kv + h;
      const uint8_t* kc = k_codes + token_head * d;
      const uint8_t* vc = v_codes + token_head * d;
      float* kd = sc.k.data() + t * d;
      float* vd = sc.v.data() + t * d;
      for (int64_t i = 0; i < d; i += kLanes) {
        storeu(kd + i, e4m3_to_float(kc + i));
        storeu(vd + i, e4m3_to_float(vc + i));
      }
      sc.k_mult[t] = k_scale[token_head];
      sc.v_mult[t] = v_scale[token_head];
    }
    return {sc.k.data(), sc.v.data(), d, sc.k_mult.data(), sc.v_mult.data()};
  }
};

// int8 KIVI: x = code * scale + zero. K: scale / zero per (block, head, channel); a block still open
// has its K in full precision in shadow[slot_of_block[block]]. V: per (token, head, channel group).
template <typename S>  // the shadow pool's dtype (the compute dtype)
struct Int8KiviReader {
  const uint8_t* k_codes;  // [num_blocks, block_size, H_kv, D]
  const at::Half* k_scale;  // [num_blocks, H_kv, D]
  const at::Half* k_zero;
  const S* shadow;  // [capacity, block_size, H_kv, D]
  const int32_t* slot_of_block;  // [num_blocks], -1 = closed
  const uint8_t* v_codes;  // [num_blocks, block_size, H_kv, D]
  const at::Half* v_scale;  // [num_blocks, block_size, H_kv, D / group]
  const at::Half* v_zero;
  int64_t block_size, h_kv, d, group;

  BlockRows rows(int64_t block, int64_t h, int64_t n, Scratch& sc) const {
    const int64_t stride = h_kv * d;
    const int64_t slot = slot_of_block[block];
    if (slot >= 0) {
      const S* src = shadow + (slot * block_size * h_kv + h) * d;
      for (int64_t t = 0; t < n; ++t) to_float(src + t * stride, sc.k.data() + t * d, d);
    } else {
      float ks[512], kz[512];  // d <= 256
      to_float(k_scale + (block * h_kv + h) * d, ks, d);
      to_float(k_zero + (block * h_kv + h) * d, kz, d);
      for (int64_t t = 0; t < n; ++t) {
        const uint8_t* c = k_codes + (block * block_size * h_kv + h) * d + t * stride;
        float* dst = sc.k.data() + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(c[i]) * ks[i] + kz[i];
      }
    }
    const int64_t groups = d / group;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t token_head = (block * block_size + t) * h_kv + h;
      const uint8_t* c = v_codes + token_head * d;
      float* dst = sc.v.data() + t * d;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float s = static_cast<float>(v_scale[token_head * groups + gi]);
        const float z = static_cast<float>(v_zero[token_head * groups + gi]);
#pragma omp simd
        for (int64_t i = gi * group; i < (gi + 1) * group; ++i) dst[i] = static_cast<float>(c[i]) * s + z;
      }
    }
    return {sc.k.data(), sc.v.data(), d, nullptr, nullptr};
  }
};

struct Problem {
  int64_t num_seqs, num_heads, h_kv, d, block_size, max_blocks, tokens_per_split, num_splits;
  float scale;
  const int32_t* block_tables;
  const int32_t* seq_lens;
};

// One item: sequence b, tokens [split * tokens_per_split, ...), every head. Writes, per query head,
// the unnormalised accumulator acc [H, D], the running max m [H] and the sum l [H] (m = -inf: the
// split is empty). D is a template parameter so the row loops are unrolled into registers.
template <int D, typename Reader>
void decode_item(const Problem& p, const Reader& reader, Scratch& sc, const float* q /* [H, D] scaled */,
                 int64_t b, int64_t split, float* acc, float* m, float* l) {
  constexpr int C = D / kLanes;
  const int64_t group = p.num_heads / p.h_kv, bs = p.block_size;
  const int64_t begin = split * p.tokens_per_split;
  const int64_t end = std::min<int64_t>(p.seq_lens[b], begin + p.tokens_per_split);
  std::fill(acc, acc + p.num_heads * D, 0.f);
  std::fill(m, m + p.num_heads, kNegInf);
  std::fill(l, l + p.num_heads, 0.f);
  std::vector<float> scores(bs + kLanes);
  float* s = scores.data();
  for (int64_t start = begin; start < end; start += bs) {
    const int64_t block = p.block_tables[b * p.max_blocks + start / bs];
    const int64_t n = std::min<int64_t>(bs, end - start);
    for (int64_t h = 0; h < p.h_kv; ++h) {
      const BlockRows rows = reader.rows(block, h, n, sc);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = h * group + g;
        vf qv[C];
        for (int c = 0; c < C; ++c) qv[c] = loadu(q + r * D + c * kLanes);
        float block_max = kNegInf;
        for (int64_t t = 0; t < n; ++t) {
          const float* k = rows.k + t * rows.stride;
          vf dot = qv[0] * loadu(k);
          for (int c = 1; c < C; ++c) dot += qv[c] * loadu(k + c * kLanes);
          s[t] = rows.k_mult ? rows.k_mult[t] * hsum(dot) : hsum(dot);
          block_max = std::max(block_max, s[t]);
        }
        const float new_max = std::max(m[r], block_max);
        const float correction = std::exp(m[r] - new_max);  // exp(-inf) = 0 on the first block
        vf sum = {};
        for (int64_t t = 0; t < n; t += kLanes) {
          vf e = exp_nonpositive(loadu(s + t) - new_max);
          for (int64_t i = n - t; i < kLanes; ++i) e[i] = 0.f;  // lanes past the block
          storeu(s + t, e);
          sum += e;
        }
        l[r] = l[r] * correction + hsum(sum);
        m[r] = new_max;
        vf a[C];
        for (int c = 0; c < C; ++c) a[c] = loadu(acc + r * D + c * kLanes) * correction;
        for (int64_t t = 0; t < n; ++t) {
          const float* v = rows.v + t * rows.stride;
          const float pt = rows.v_mult ? s[t] * rows.v_mult[t] : s[t];
          for (int c = 0; c < C; ++c) a[c] += pt * loadu(v + c * kLanes);
        }
        for (int c = 0; c < C; ++c) storeu(acc + r * D + c * kLanes, a[c]);
      }
    }
  }
}

template <typename Reader>
using ItemFn = void (*)(const Problem&, const Reader&, Scratch&, const float*, int64_t, int64_t, float*, float*,
                        float*);

template <typename Reader>
ItemFn<Reader> item_for_head_dim(int64_t d) {
  switch (d) {
    case 64: return &decode_item<64, Reader>;
    case 128: return &decode_item<128, Reader>;
    case 256: return &decode_item<256, Reader>;
    default: TORCH_CHECK(false, "head_dim must be 64, 128 or 256, got ", d);
  }
}

template <typename Reader, typename QT>
void run_decode(const Problem& p, const Reader& reader, const QT* query, QT* out) {
  const int64_t h = p.num_heads, d = p.d;
  const int64_t num_items = p.num_seqs * p.num_splits;
  const ItemFn<Reader> item_fn = item_for_head_dim<Reader>(d);
  std::vector<float> q(p.num_seqs * h * d);  // the query in fp32, pre-scaled: [B, H, D]
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(query[i]) * p.scale;
  std::vector<float> acc(num_items * h * d), m(num_items * h), l(num_items * h);
  at::parallel_for(0, num_items, 1, [&](int64_t first, int64_t last) {
    Scratch sc(p.block_size, d);
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / p.num_splits, split = item % p.num_splits;
      item_fn(p, reader, sc, q.data() + b * h * d, b, split, acc.data() + item * h * d, m.data() + item * h,
              l.data() + item * h);
    }
  });
  // merge the splits of each (sequence, head): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
  std::vector<float> o(d);
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    for (int64_t r = 0; r < h; ++r) {
      const int64_t first = b * p.num_splits * h + r;  // row r of item (b, 0); items are h rows apart
      float big = kNegInf;
      for (int64_t sp = 0; sp < p.num_splits; ++sp) big = std::max(big, m[first + sp * h]);
      std::fill(o.begin(), o.end(), 0.f);
      float denom = 0.f;
      for (int64_t sp = 0; sp < p.num_splits; ++sp) {
        const int64_t at = first + sp * h;
        if (m[at] == kNegInf) continue;  // an empty split (a shorter sequence of the batch)
        const float w = std::exp(m[at] - big);
        denom += w * l[at];
        const float* a = acc.data() + at * d;
        for (int64_t i = 0; i < d; ++i) o[i] += w * a[i];
      }
      QT* dst = out + (b * h + r) * d;
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<QT>(o[i] / denom);
    }
  }
}

Problem make_problem(const at::Tensor& query, int64_t h_kv, int64_t block_size, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be contiguous [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "block_tables must be contiguous int32 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int32 [num_seqs]");
  Problem p{};
  p.num_seqs = query.size(0);
  p.num_heads = query.size(1);
  p.d = query.size(2);
  p.h_kv = h_kv;
  p.block_size = block_size;
  TORCH_CHECK(p.num_heads % h_kv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(p.d == 64 || p.d == 128 || p.d == 256, "head_dim must be 64, 128 or 256, got ", p.d);
  TORCH_CHECK(block_tables.size(0) == p.num_seqs && seq_lens.size(0) == p.num_seqs,
              "block_tables and seq_lens need one row per query row");
  p.max_blocks = block_tables.size(1);
  p.scale = static_cast<float>(scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    TORCH_CHECK(p.seq_lens[b] >= 1 && p.seq_lens[b] <= p.max_blocks * block_size,
                "seq_lens[", b, "] = ", p.seq_lens[b], " is outside [1, max_blocks * block_size]");
    max_len = std::max<int64_t>(max_len, p.seq_lens[b]);
  }
  // With several threads, enough items for each (4 per thread), never splits below 16 blocks.
  const int64_t threads = at::get_num_threads();
  const int64_t max_blocks_used = (max_len + block_size - 1) / block_size;
  int64_t splits = threads > 1 ? (4 * threads + p.num_seqs - 1) / p.num_seqs : 1;
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, max_blocks_used / 16));
  const int64_t blocks_per_split = (max_blocks_used + splits - 1) / splits;
  p.tokens_per_split = blocks_per_split * block_size;
  p.num_splits = (max_blocks_used + blocks_per_split - 1) / blocks_per_split;
  return p;
}

void check_pool(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), name, " must be a contiguous ", dim, "-d tensor");
}

template <typename Reader>
at::Tensor dispatch_query(const Problem& p, const Reader& reader, const at::Tensor& query) {
  auto out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_cpu", [&] {
    run_decode(p, reader, query.data_ptr<scalar_t>(), out.data_ptr<scalar_t>());
  });
  return out;
}

at::Tensor paged_decode_dense(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_pool(k_cache, "k_cache", k_cache.scalar_type(), 4);
  check_pool(v_cache, "v_cache", k_cache.scalar_type(), 4);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim of query and pool differ");
  const Problem p = make_problem(query, k_cache.size(2), k_cache.size(1), block_tables, seq_lens, scale);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_dense", [&] {
    DenseReader<scalar_t> reader{k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), p.block_size, p.h_kv,
                                 p.d};
    out = dispatch_query(p, reader, query);
  });
  return out;
}

at::Tensor paged_decode_fp8(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& v_codes,
                            const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale) {
  check_pool(k_codes, "k_codes", at::kByte, 4);
  check_pool(v_codes, "v_codes", at::kByte, 4);
  check_pool(k_scale, "k_scale", at::kFloat, 3);
  check_pool(v_scale, "v_scale", at::kFloat, 3);
  TORCH_CHECK(k_codes.sizes() == v_codes.sizes() && k_codes.size(3) == query.size(2), "fp8 code shapes differ");
  TORCH_CHECK(k_scale.sizes() == k_codes.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
              "fp8 scales must be [num_blocks, block_size, num_kv_heads]");
  const Problem p = make_problem(query, k_codes.size(2), k_codes.size(1), block_tables, seq_lens, scale);
  Fp8Reader reader{k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(), k_scale.data_ptr<float>(),
                   v_scale.data_ptr<float>(), p.block_size, p.h_kv, p.d};
  return dispatch_query(p, reader, query);
}

at::Tensor paged_decode_int8(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
                             const at::Tensor& k_zero, const at::Tensor& shadow, const at::Tensor& slot_of_block,
                             const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  check_pool(k_codes, "k_codes", at::kByte, 4);
  check_pool(v_codes, "v_codes", at::kByte, 4);
  check_pool(k_scale, "k_scale", at::kHalf, 3);
  check_pool(k_zero, "k_zero", at::kHalf, 3);
  check_pool(v_scale, "v_scale", at::kHalf, 4);
  check_pool(v_zero, "v_zero", at::kHalf, 4);
  check_pool(shadow, "shadow", shadow.scalar_type(), 4);
  check_pool(slot_of_block, "slot_of_block", at::kInt, 1);
  const int64_t num_blocks = k_codes.size(0), d = k_codes.size(3);
  TORCH_CHECK(k_codes.sizes() == v_codes.sizes() && d == query.size(2), "int8 code shapes differ");
  TORCH_CHECK(k_scale.size(0) == num_blocks && k_scale.size(2) == d && k_zero.sizes() == k_scale.sizes(),
              "int8 K scale / zero must be [num_blocks, num_kv_heads, head_dim]");
  TORCH_CHECK(slot_of_block.size(0) == num_blocks, "slot_of_block must have one entry per block");
  TORCH_CHECK(v_scale.sizes() == v_zero.sizes() && v_scale.size(3) >= 1 && d % v_scale.size(3) == 0,
              "int8 V scale / zero must be [num_blocks, block_size, num_kv_heads, groups]");
  TORCH_CHECK(shadow.size(0) == 0 || shadow.sizes().slice(1) == k_codes.sizes().slice(1),
              "the open-block shadow must be [capacity, block_size, num_kv_heads, head_dim]");
  const Problem p = make_problem(query, k_codes.size(2), k_codes.size(1), block_tables, seq_lens, scale);
  const int32_t* slots = slot_of_block.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_blocks; ++i) {
    TORCH_CHECK(slots[i] < shadow.size(0), "slot_of_block[", i, "] = ", slots[i], " is past the shadow pool");
  }
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, shadow.scalar_type(), "paged_decode_int8", [&] {
    Int8KiviReader<scalar_t> reader{k_codes.data_ptr<uint8_t>(), k_scale.data_ptr<at::Half>(),
                                    k_zero.data_ptr<at::Half>(), shadow.data_ptr<scalar_t>(), slots,
                                    v_codes.data_ptr<uint8_t>(), v_scale.data_ptr<at::Half>(),
                                    v_zero.data_ptr<at::Half>(), p.block_size, p.h_kv, d, d / v_scale.size(3)};
    out = dispatch_query(p, reader, query);
  });
  return out;
}

}  // namespace

// csrc/cpu/linear_cpu.cpp
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_dense", &paged_decode_dense, "decode over a dense paged pool");
  m.def("paged_decode_fp8", &paged_decode_fp8, "decode over an fp8_e4m3 paged pool, read in place");
  m.def("paged_decode_int8", &paged_decode_int8, "decode over an int8 KIVI paged pool, read in place");
  m.def("small_batch_linear", &small_batch_linear, "x W^T (+ b) for 1 to 16 fp32 rows, W streamed once");
}
