// Causal paged attention on CPU for any rows: prefill, chunked prefill, decode and rows at explicit
// positions, reading the block table in place (no gathered copy of the history).
//
// Rows: query [T, H, D]; sequence b owns rows [row_start[b], row_start[b + 1]) and KV positions
// [0, seq_lens[b]) through block_tables[b]; a row at position p attends to KV positions [0, p]
// (p = seq_len - q_len + j for the j-th of q_len rows unless positions are given), or with window > 0
// (a sliding-window layer) KV positions (p - window, p]: steps wholly before every row's window are
// skipped, and a step's positions before a row's window are masked like those after it.
//
// Batch invariance: a row's output is a pure function of its query, its position and the KV it
// attends to. Every (row, head) runs the same sequence of operations whatever else is in the call,
// how the rows are tiled, how many threads run, and whether the row came as prefill or decode:
//   - KV is cut into splits at fixed absolute positions [s * split_tokens, (s + 1) * split_tokens),
//     and a split into online-softmax steps of step_tokens (also absolute: 64 tokens, or a block if
//     blocks are larger). Each step: scores, step max, exp, sum, P V (attention_math.h); the last step
//     stops at the row's own position, and masked tokens never enter a sum. The splits of a row are
//     then folded in split order (`fold`), and the result divided by its sum.
//   - a score is q . k summed over d = 0..D-1 by one fused multiply-add chain (K is transposed per
//     step so that vector lanes are tokens); P V is one FMA chain per output element over the tokens
//     in order. bf16 queries over a bf16 pool take the bf16 arithmetic instead (attention_math.h,
//     Bf16Math): the same chains two products at a time (vdpbf16ps where the CPU has AVX-512 BF16),
//     over channel pairs for Q . K and token pairs for P V, with the probabilities rounded to bf16 and
//     fp32 sums; the pool is read as it lies, without converting it to fp32.
// Work items are (sequence, tile of its rows, split or all splits); a block is read and converted
// once per item for all the rows of the tile and all query heads of a KV head's GQA group. Items
// with one split store a partial result that a final pass folds in order, so that a long sequence
// with a single row (decode) spreads over threads; other items fold as they go. A split that several
// decoding sequences hold in the same blocks (a shared cached prefix) is one item for all their rows:
// read, and K transposed, once instead of once per sequence. Items run on torch's
// threads, costliest first, each taken by the next free thread (parallel.h).
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "paged_attention.h"

namespace {

using namespace kvserve_cpu;

Problem make_problem(const at::Tensor& query, int64_t h_kv, int64_t block_size, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& row_start, const at::Tensor& positions,
                     double scale, int64_t window) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && query.is_contiguous(),
              "query must be a contiguous CPU tensor [num_rows, num_heads, head_dim]");
  auto int_vector = [](const at::Tensor& t, const char* name, int64_t dim) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == dim && t.is_contiguous(), name,
                " must be a contiguous int32 CPU tensor with ", dim, " dimension(s)");
  };
  int_vector(block_tables, "block_tables", 2);
  int_vector(seq_lens, "seq_lens", 1);
  int_vector(row_start, "query_start_loc", 1);
  int_vector(positions, "positions", 1);
  Problem p{};
  p.num_rows = query.size(0);
  p.num_heads = query.size(1);
  p.d = query.size(2);
  p.h_kv = h_kv;
  p.block_size = block_size;
  TORCH_CHECK(block_size >= 1 && (block_size & (block_size - 1)) == 0, "block_size must be a power of two");
  p.step_tokens = std::max(kStepTokens, block_size);
  p.split_tokens = std::max(kSplitTokens, p.step_tokens);
  p.num_seqs = seq_lens.size(0);
  TORCH_CHECK(h_kv >= 1 && p.num_heads % h_kv == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.size(0) == p.num_seqs && row_start.size(0) == p.num_seqs + 1,
              "block_tables, seq_lens and query_start_loc need one row per sequence (query_start_loc one more)");
  p.max_blocks = block_tables.size(1);
  TORCH_CHECK(scale > 0, "scale must be positive (the AMX softmax takes the max before scaling), got ", scale);
  p.scale = static_cast<float>(scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.row_start = row_start.data_ptr<int32_t>();
  TORCH_CHECK(p.row_start[0] == 0 && p.row_start[p.num_seqs] == p.num_rows,
              "query_start_loc must run from 0 to the number of query rows");
  const bool explicit_positions = positions.numel() > 0;
  TORCH_CHECK(!explicit_positions || positions.size(0) == p.num_rows, "positions need one entry per query row");
  const int32_t* given = explicit_positions ? positions.data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  p.window = window;
  p.pos.resize(p.num_rows);
  p.lo.assign(p.num_rows, 0);
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t r0 = p.row_start[b], r1 = p.row_start[b + 1], len = p.seq_lens[b];
    TORCH_CHECK(r0 <= r1, "query_start_loc must not decrease");
    TORCH_CHECK(len >= r1 - r0 && len <= p.max_blocks * block_size, "seq_lens[", b, "] = ", len,
                " is outside [query rows, max_blocks * block_size]");
    for (int64_t r = r0; r < r1; ++r) {
      p.pos[r] = given ? given[r] : static_cast<int32_t>(len - (r1 - r));
      TORCH_CHECK(p.pos[r] >= 0 && p.pos[r] < len, "position ", p.pos[r], " of row ", r, " is outside [0, seq_lens[",
                  b, "])");
      if (window > 0) p.lo[r] = static_cast<int32_t>(std::max<int64_t>(0, p.pos[r] - window + 1));
    }
    const int64_t blocks_used = (len + block_size - 1) / block_size;
    for (int64_t i = 0; i < blocks_used; ++i) {
      TORCH_CHECK(p.block_tables[b * p.max_blocks + i] >= 0, "block_tables[", b, ", ", i, "] is negative");
    }
  }
  return p;
}

void check_pool(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.is_contiguous(), name, " must be a contiguous ", dim, "-d tensor");
}

void check_block_ids(const Problem& p, int64_t num_blocks) {
  for (int64_t b = 0; b < p.num_seqs; ++b) {
    const int64_t blocks_used = (p.seq_lens[b] + p.block_size - 1) / p.block_size;
    for (int64_t i = 0; i < blocks_used; ++i) {
      TORCH_CHECK(p.block_tables[b * p.max_blocks + i] < num_blocks, "block_tables[", b, ", ", i,
                  "] is past the pool");
    }
  }
}

// The kernel in arithmetic M; out in the query's dtype. Fp32Math takes q in fp32, pre-scaled (one rounding
// per element, any dtype); Bf16Math takes bf16 q as it is (the scale is applied to the fp32 scores).
template <typename M = Fp32Math, typename Reader>
at::Tensor run(const Problem& p, const Reader& reader, const at::Tensor& query) {
  const RunFn<Reader, M> fn = run_for_head_dim<Reader, M>(p.d);
  const at::Tensor q =
      std::is_same_v<M, Bf16Math> ? query.contiguous() : query.to(at::kFloat).mul(p.scale).contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  fn(p, reader, static_cast<const typename M::Q*>(q.data_ptr()), out.data_ptr<float>());
  return out.to(query.scalar_type());
}

template <typename T>
at::Tensor run_dense(const Problem& p, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& query) {
  DenseReader<T> reader{k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), p.block_size, p.h_kv, p.d};
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    // bf16 queries over a bf16 pool: the bf16 arithmetic, where D / 2 is a whole number of vector tiles
    if (query.scalar_type() == at::kBFloat16 && p.d / 2 % kLanes == 0) return run<Bf16Math>(p, reader, query);
  }
  return run(p, reader, query);
}

at::Tensor paged_attention_dense(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 const at::Tensor& query_start_loc, const at::Tensor& positions, double scale,
                                 int64_t window) {
  check_pool(k_cache, "k_cache", k_cache.scalar_type(), 4);
  check_pool(v_cache, "v_cache", k_cache.scalar_type(), 4);
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  TORCH_CHECK(k_cache.size(3) == query.size(2), "head_dim of query and pool differ");
  const Problem p = make_problem(query, k_cache.size(2), k_cache.size(1), block_tables, seq_lens, query_start_loc,
                                 positions, scale, window);
  check_block_ids(p, k_cache.size(0));
  switch (k_cache.scalar_type()) {
    case at::kFloat: return run_dense<float>(p, k_cache, v_cache, query);
    case at::kBFloat16: return run_dense<at::BFloat16>(p, k_cache, v_cache, query);
    case at::kHalf: return run_dense<at::Half>(p, k_cache, v_cache, query);
    default: TORCH_CHECK(false, "k_cache must be float32, bfloat16 or float16, got ", k_cache.scalar_type());
  }
}

at::Tensor paged_attention_fp8(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& v_codes,
                               const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                               const at::Tensor& positions, double scale, int64_t window) {
  check_pool(k_codes, "k_codes", at::kByte, 4);
  check_pool(v_codes, "v_codes", at::kByte, 4);
  check_pool(k_scale, "k_scale", at::kFloat, 3);
  check_pool(v_scale, "v_scale", at::kFloat, 3);
  TORCH_CHECK(k_codes.sizes() == v_codes.sizes() && k_codes.size(3) == query.size(2), "fp8 code shapes differ");
  TORCH_CHECK(k_scale.sizes() == k_codes.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
              "fp8 scales must be [num_blocks, block_size, num_kv_heads]");
  const Problem p = make_problem(query, k_codes.size(2), k_codes.size(1), block_tables, seq_lens, query_start_loc,
                                 positions, scale, window);
  check_block_ids(p, k_codes.size(0));
  Fp8Reader reader{k_codes.data_ptr<uint8_t>(), v_codes.data_ptr<uint8_t>(), k_scale.data_ptr<float>(),
                   v_scale.data_ptr<float>(), p.block_size, p.h_kv, p.d};
  return run(p, reader, query);
}

template <typename S>
at::Tensor run_int8(const Problem& p, const at::Tensor& k_codes, const at::Tensor& k_scale, const at::Tensor& k_zero,
                    const at::Tensor& shadow, const int32_t* slots, const at::Tensor& v_codes,
                    const at::Tensor& v_scale, const at::Tensor& v_zero, const at::Tensor& query) {
  Int8KiviReader<S> reader{k_codes.data_ptr<uint8_t>(), k_scale.data_ptr<at::Half>(), k_zero.data_ptr<at::Half>(),
                           shadow.data_ptr<S>(), slots, v_codes.data_ptr<uint8_t>(), v_scale.data_ptr<at::Half>(),
                           v_zero.data_ptr<at::Half>(), p.block_size, p.h_kv, p.d, p.d / v_scale.size(3)};
  return run(p, reader, query);
}

at::Tensor paged_attention_int8(const at::Tensor& query, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                const at::Tensor& k_zero, const at::Tensor& shadow, const at::Tensor& slot_of_block,
                                const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& v_zero,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                const at::Tensor& query_start_loc, const at::Tensor& positions, double scale,
                                int64_t window) {
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
  const Problem p = make_problem(query, k_codes.size(2), k_codes.size(1), block_tables, seq_lens, query_start_loc,
                                 positions, scale, window);
  check_block_ids(p, num_blocks);
  const int32_t* slots = slot_of_block.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_blocks; ++i) {
    TORCH_CHECK(slots[i] < shadow.size(0), "slot_of_block[", i, "] = ", slots[i], " is past the shadow pool");
  }
  switch (shadow.scalar_type()) {
    case at::kFloat: return run_int8<float>(p, k_codes, k_scale, k_zero, shadow, slots, v_codes, v_scale, v_zero, query);
    case at::kBFloat16:
      return run_int8<at::BFloat16>(p, k_codes, k_scale, k_zero, shadow, slots, v_codes, v_scale, v_zero, query);
    case at::kHalf: return run_int8<at::Half>(p, k_codes, k_scale, k_zero, shadow, slots, v_codes, v_scale, v_zero, query);
    default: TORCH_CHECK(false, "shadow must be float32, bfloat16 or float16, got ", shadow.scalar_type());
  }
}

}  // namespace

bool attention_amx(int64_t head_dim) {
#ifdef KVSERVE_HAVE_AMX
  return amx::attention_on(head_dim);
#else
  (void)head_dim;
  return false;
#endif
}

// csrc/cpu/linear_cpu.cpp
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor row_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t out_features);
at::Tensor pack_linear_weight_bf16(const at::Tensor& weight);
at::Tensor row_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t out_features);
at::Tensor row_linear_glu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                          int64_t inter);
bool linear_amx(int64_t in_features);
bool set_amx(bool enabled);

// csrc/cpu/nested_linear.cpp
at::Tensor pack_nested_weight(const at::Tensor& hi, const at::Tensor& lo);
at::Tensor unpack_nested_weight(const at::Tensor& packed, const at::Tensor& scale, int64_t out_features, bool fp16);
at::Tensor nested_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const c10::optional<at::Tensor>& bias, int64_t out_features, bool fp16);

// csrc/cpu/linear_codes.cpp
at::Tensor pack_linear_codes(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset);
at::Tensor unpack_linear_codes(const at::Tensor& packed, int64_t in_features);
at::Tensor row_linear_codes(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t out_features);

// csrc/cpu/layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim);
at::Tensor rotate_keys(const at::Tensor& key, const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim);
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor row_linear_bf16_argmax(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                                  int64_t out_features, int64_t limit);
void kv_write_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& key,
               const at::Tensor& value);

// csrc/cpu/linear_qcodes.cpp, linear_qcodes_pack.cpp
at::Tensor pack_linear_qcodes(const at::Tensor& codes, int64_t bits, int64_t zero, int64_t group, int64_t kind,
                              int64_t super_groups, const at::Tensor& a, const c10::optional<at::Tensor>& o,
                              const c10::optional<at::Tensor>& a_sub, const c10::optional<at::Tensor>& o_sub);
at::Tensor unpack_linear_qcodes(const at::Tensor& packed, int64_t in_features);
double qcodes_bytes_per_weight(const at::Tensor& packed, int64_t in_features);
at::Tensor row_linear_qcodes(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                             int64_t out_features);
at::Tensor row_linear_glu_qcodes(const at::Tensor& x, const at::Tensor& packed,
                                 const c10::optional<at::Tensor>& bias, int64_t inter);
int64_t linear_lanes();

// csrc/cpu/parallel.h
bool set_pool(bool enabled) { return pool::enabled.exchange(enabled); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_dense", &paged_attention_dense, "causal attention of any rows over a dense paged pool");
  m.def("paged_attention_fp8", &paged_attention_fp8, "the same over an fp8_e4m3 paged pool, read in place");
  m.def("paged_attention_int8", &paged_attention_int8, "the same over an int8 KIVI paged pool, read in place");
  m.def("pack_linear_weight", &pack_linear_weight, "W [out, in] -> the panels row_linear reads");
  m.def("row_linear", &row_linear, "x W^T (+ b) in fp32 over packed W, each row independent of the others");
  m.def("pack_linear_weight_bf16", &pack_linear_weight_bf16, "bf16 W [out, in] -> the panels row_linear_bf16 reads");
  m.def("row_linear_bf16", &row_linear_bf16, "x W^T (+ b) for bf16 x and W, fp32 sums, each row independent");
  m.def("row_linear_glu", &row_linear_glu, "silu(x G^T + bg) * (x U^T + bu) over gate's and up's packed weights, each row independent");
  m.def("linear_amx", &linear_amx, "whether row_linear_bf16 runs on AMX tiles for this in_features here");
  m.def("set_amx", &set_amx, "AMX tiles for the bf16 linear and attention on (default where available) or off; returns the old");
  m.def("set_pool", &set_pool, "the kernels' own worker threads (default) or at::parallel_for (off); returns the old");
  m.def("attention_amx", &attention_amx, "whether bf16 attention over a bf16 pool runs on AMX tiles for this head_dim here");
  m.def("pack_nested_weight", &pack_nested_weight, "NestedFP hi, lo [out, in] -> the planes nested_linear reads");
  m.def("unpack_nested_weight", &unpack_nested_weight, "NestedFP planes -> row_linear's packed fp32 weight (scaled)");
  m.def("nested_linear", &nested_linear, "(x W^T) * scale (+ b) over NestedFP planes: FP8 mode reads hi, FP16 both");
  m.def("pack_linear_codes", &pack_linear_codes, "GGUF codes int8 [out, in], scale and offset fp32 [out, groups] -> the panels row_linear_codes reads");
  m.def("unpack_linear_codes", &unpack_linear_codes, "packed codes -> row_linear's packed fp32 weight (bitwise the dequantized weight)");
  m.def("row_linear_codes", &row_linear_codes, "x W^T (+ b) in fp32 over packed GGUF codes: bitwise row_linear over the dequantized W");
  m.def("pack_linear_qcodes", &pack_linear_qcodes, "GGUF codes int8 [out, in] at 4-8 bits with compact factors -> the rows row_linear_qcodes reads");
  m.def("unpack_linear_qcodes", &unpack_linear_qcodes, "packed qcodes -> row_linear's packed fp32 weight (bitwise the dequantized weight)");
  m.def("qcodes_bytes_per_weight", &qcodes_bytes_per_weight, "bytes of packed qcodes per weight");
  m.def("row_linear_qcodes", &row_linear_qcodes, "x W^T (+ b) in fp32 over packed qcodes: bitwise row_linear over the dequantized W");
  m.def("row_linear_glu_qcodes", &row_linear_glu_qcodes, "row_linear_glu over the gate's and up's packed qcodes");
  m.def("linear_lanes", &linear_lanes, "output features per panel of the packed linear weights (fp32 lanes)");
  m.def("rms_norm", &rms_norm, "Llama RMSNorm of each row (fp32 sums; the modeling code's bf16 roundings)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place, then rms_norm(residual)");
  m.def("kv_write_", &kv_write_, "rows of key and value into a dense pool's slots in place (slot < 0: skipped)");
  m.def("rope_", &rope_, "rotary embedding of the first heads * head_dim columns of each row, in place");
  m.def("rotate_keys", &rotate_keys, "post-RoPE keys moved to new positions (RopeRotator.apply), a new tensor");
  m.def("row_linear_bf16_argmax", &row_linear_bf16_argmax, "argmax_rows(row_linear_bf16(x, ...)[:, :limit]) without the logits (AMX)");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(x, dim=-1) of float32 or bf16 rows, vectorized: the same indices");
}
