// Torch bindings of the kvserve CUDA kernels: argument checks, the current stream, launch checks.
// Only built by the JIT loader (kvserve/kernels/cuda_ext.py); the kernels in attention/*.cu do not
// include torch and compile standalone.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attention/paged_attention.h"

namespace {

// Numbers and shapes go into TORCH_CHECK messages as text (num, dims: std::to_string), never as
// integers streamed into the message's ostream. On the GPU machine (H200, torch 2.11+cu130, the
// extension built by torch's JIT loader) a check that streamed an int64 crashed the process inside
// this library's own instance of std::ostream::_M_insert<long> (gdb backtrace in docs/gpu.md), while
// messages made of text only raised as they should.
std::string num(int64_t v) { return std::to_string(v); }

std::string dims(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

void check_tensor(const torch::Tensor& t, const char* name, int dim, const torch::Device& device) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK(t.dim() == dim, name, " must have ", num(dim).c_str(), " dims, got ", dims(t.sizes()).c_str());
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dim");
}

void check_aligned(const torch::Tensor& t, const char* name) {
  // the kernels read K/V rows with 16-byte loads and Q/out pairs with 4-byte loads
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
  for (int d = 0; d < t.dim() - 1; ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0, name, " stride ", num(d).c_str(), " must be a multiple of 8 elements, got ",
                num(t.stride(d)).c_str());
  }
}

const torch::Tensor& need(const std::optional<torch::Tensor>& t, const char* name, const char* format) {
  TORCH_CHECK(t.has_value() && t->defined(), name, " is required for kv_format ", format);
  return *t;
}

// Checks the operands of an 8-bit pool (see KvFormat in attention/paged_attention.h) and fills
// their fields of `p`. k_cache / v_cache (uint8 codes) are checked by the caller.
void set_quantized_operands(kvserve::PagedAttentionParams& p, kvserve::KvFormat format,
                            const torch::Tensor& query, const torch::Tensor& k_cache,
                            const std::optional<torch::Tensor>& k_scale_opt,
                            const std::optional<torch::Tensor>& k_zero_opt,
                            const std::optional<torch::Tensor>& v_scale_opt,
                            const std::optional<torch::Tensor>& v_zero_opt,
                            const std::optional<torch::Tensor>& k_open_opt,
                            const std::optional<torch::Tensor>& k_open_slot_opt) {
  const auto device = query.device();
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2),
                head_dim = k_cache.size(3);
  const bool fp8 = format == kvserve::KvFormat::kFp8E4m3;
  const char* name = fp8 ? "fp8_e4m3" : "int8";
  const auto& k_scale = need(k_scale_opt, "k_scale", name);
  const auto& v_scale = need(v_scale_opt, "v_scale", name);
  if (fp8) {
    for (const auto& [t, n] : {std::pair{&k_scale, "k_scale"}, std::pair{&v_scale, "v_scale"}}) {
      check_tensor(*t, n, 3, device);
      TORCH_CHECK(t->scalar_type() == at::kFloat, n, " must be float32 for fp8_e4m3, got ", t->scalar_type());
      TORCH_CHECK(t->sizes() == k_cache.sizes().slice(0, 3), n, " must be [num_blocks, block_size, num_kv_heads] = ",
                  dims(k_cache.sizes().slice(0, 3)).c_str(), ", got ", dims(t->sizes()).c_str());
    }
    p.k_scale = k_scale.data_ptr();
    p.v_scale = v_scale.data_ptr();
    p.ks_stride_block = k_scale.stride(0);
    p.ks_stride_slot = k_scale.stride(1);
    p.ks_stride_head = k_scale.stride(2);
    p.vs_stride_block = v_scale.stride(0);
    p.vs_stride_slot = v_scale.stride(1);
    p.vs_stride_head = v_scale.stride(2);
    return;
  }
  const auto& k_zero = need(k_zero_opt, "k_zero", name);
  const auto& v_zero = need(v_zero_opt, "v_zero", name);
  const auto& k_open = need(k_open_opt, "k_open", name);
  const auto& k_open_slot = need(k_open_slot_opt, "k_open_slot", name);
  TORCH_CHECK(head_dim % kvserve::kKiviVGroup == 0, "int8 pools need head_dim a multiple of ",
              num(kvserve::kKiviVGroup).c_str(), ", got ", num(head_dim).c_str());
  const std::vector<int64_t> k_shape{num_blocks, num_kv_heads, head_dim};
  const std::vector<int64_t> v_shape{num_blocks, block_size, num_kv_heads, head_dim / kvserve::kKiviVGroup};
  for (const auto& [t, n] : {std::pair{&k_scale, "k_scale"}, std::pair{&k_zero, "k_zero"}}) {
    check_tensor(*t, n, 3, device);
    TORCH_CHECK(t->scalar_type() == at::kHalf, n, " must be float16 for int8, got ", t->scalar_type());
    TORCH_CHECK(t->sizes() == c10::IntArrayRef(k_shape), n, " must be [num_blocks, num_kv_heads, head_dim] = ",
                dims(k_shape).c_str(), ", got ", dims(t->sizes()).c_str());
    check_aligned(*t, n);  // 16-byte loads of 8 channels
  }
  for (const auto& [t, n] : {std::pair{&v_scale, "v_scale"}, std::pair{&v_zero, "v_zero"}}) {
    check_tensor(*t, n, 4, device);
    TORCH_CHECK(t->scalar_type() == at::kHalf, n, " must be float16 for int8, got ", t->scalar_type());
    TORCH_CHECK(t->sizes() == c10::IntArrayRef(v_shape), n,
                " must be [num_blocks, block_size, num_kv_heads, head_dim / ", num(kvserve::kKiviVGroup).c_str(),
                "] = ", dims(v_shape).c_str(), ", got ", dims(t->sizes()).c_str());
  }
  TORCH_CHECK(k_scale.strides() == k_zero.strides(), "k_scale and k_zero strides differ");
  TORCH_CHECK(v_scale.strides() == v_zero.strides(), "v_scale and v_zero strides differ");
  check_tensor(k_open, "k_open", 4, device);
  TORCH_CHECK(k_open.scalar_type() == query.scalar_type(), "k_open must have the query dtype ", query.scalar_type(),
              ", got ", k_open.scalar_type());
  TORCH_CHECK(k_open.size(1) == block_size && k_open.size(2) == num_kv_heads && k_open.size(3) == head_dim,
              "k_open must be [capacity, block_size, num_kv_heads, head_dim] with those of k_cache, got ",
              dims(k_open.sizes()).c_str());
  check_aligned(k_open, "k_open");
  check_tensor(k_open_slot, "k_open_slot", 1, device);
  TORCH_CHECK(k_open_slot.scalar_type() == at::kInt && k_open_slot.is_contiguous() && k_open_slot.size(0) == num_blocks,
              "k_open_slot must be contiguous int32 [num_blocks = ", num(num_blocks).c_str(), "], got ",
              k_open_slot.scalar_type(), " ", dims(k_open_slot.sizes()).c_str());
  p.k_scale = k_scale.data_ptr();
  p.k_zero = k_zero.data_ptr();
  p.v_scale = v_scale.data_ptr();
  p.v_zero = v_zero.data_ptr();
  p.ks_stride_block = k_scale.stride(0);
  p.ks_stride_slot = 0;  // one scale / zero per channel for the whole block
  p.ks_stride_head = k_scale.stride(1);
  p.vs_stride_block = v_scale.stride(0);
  p.vs_stride_slot = v_scale.stride(1);
  p.vs_stride_head = v_scale.stride(2);
  p.k_open = k_open.data_ptr();
  p.k_open_slot = k_open_slot.data_ptr<int32_t>();
  p.ko_stride_block = k_open.stride(0);
  p.ko_stride_slot = k_open.stride(1);
  p.ko_stride_head = k_open.stride(2);
}

}  // namespace

// query [T, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; block_tables [S, max_blocks],
// query_start_loc [S + 1], seq_lens [S] int32. Returns out [T, H, D].
// kv_format (kvserve::KvFormat): 0 dense (caches in the query dtype; the optional operands unused),
// 1 fp8_e4m3 (uint8 codes, k_scale / v_scale), 2 int8 KIVI (uint8 codes, k/v scale and zero,
// k_open / k_open_slot); shapes and dtypes in attention/paged_attention.h.
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                              int64_t max_query_len, double scale, int64_t num_splits,
                              int64_t tokens_per_split, bool decode_config, int64_t kv_format,
                              const std::optional<torch::Tensor>& k_scale,
                              const std::optional<torch::Tensor>& k_zero,
                              const std::optional<torch::Tensor>& v_scale,
                              const std::optional<torch::Tensor>& v_zero,
                              const std::optional<torch::Tensor>& k_open,
                              const std::optional<torch::Tensor>& k_open_slot) {
  TORCH_CHECK(query.is_cuda(), "query must be a CUDA tensor");
  TORCH_CHECK(kv_format >= 0 && kv_format <= 2, "kv_format must be 0 (dense), 1 (fp8_e4m3) or 2 (int8), got ",
              num(kv_format).c_str());
  const auto format = static_cast<kvserve::KvFormat>(kv_format);
  const bool dense = format == kvserve::KvFormat::kDense;
  const auto device = query.device();
  check_tensor(query, "query", 3, device);
  check_tensor(k_cache, "k_cache", 4, device);
  check_tensor(v_cache, "v_cache", 4, device);
  check_tensor(block_tables, "block_tables", 2, device);
  check_tensor(query_start_loc, "query_start_loc", 1, device);
  check_tensor(seq_lens, "seq_lens", 1, device);
  TORCH_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16,
              "query must be float16 or bfloat16, got ", query.scalar_type());
  const auto cache_dtype = dense ? query.scalar_type() : at::kByte;
  TORCH_CHECK(k_cache.scalar_type() == cache_dtype && v_cache.scalar_type() == cache_dtype,
              dense ? "query, k_cache, v_cache must share a dtype" : "8-bit k_cache and v_cache must be uint8 codes",
              ", got ", k_cache.scalar_type(), " and ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  for (const auto* t : {&block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "block metadata must be contiguous int32");
  }
  const int64_t head_dim = query.size(2), num_seqs = seq_lens.size(0);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", num(head_dim).c_str());
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim ", num(k_cache.size(3)).c_str(), " != query head_dim ",
              num(head_dim).c_str());
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start_loc must be [num_seqs + 1] and block_tables [num_seqs, max_blocks]");
  TORCH_CHECK(num_splits >= 1 && tokens_per_split % kvserve::kKvTile == 0,
              "tokens_per_split must be a multiple of ", num(kvserve::kKvTile).c_str());
  check_aligned(query, "query");
  check_aligned(k_cache, "k_cache");
  check_aligned(v_cache, "v_cache");

  kvserve::PagedAttentionParams p{};
  p.kv_format = format;
  if (!dense) {
    set_quantized_operands(p, format, query, k_cache, k_scale, k_zero, v_scale, v_zero, k_open, k_open_slot);
  }

  const c10::cuda::CUDAGuard guard(device);
  auto out = torch::empty_like(query);
  torch::Tensor o_part, lse_part;
  if (num_splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    o_part = torch::empty({query.size(0), query.size(1), num_splits, head_dim}, f32);
    lse_part = torch::empty({query.size(0), query.size(1), num_splits}, f32);
    p.o_part = o_part.data_ptr<float>();
    p.lse_part = lse_part.data_ptr<float>();
  }
  p.q = query.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.q_stride_token = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.o_stride_token = out.stride(0);
  p.o_stride_head = out.stride(1);
  p.k_stride_block = k_cache.stride(0);
  p.k_stride_slot = k_cache.stride(1);
  p.k_stride_head = k_cache.stride(2);
  p.v_stride_block = v_cache.stride(0);
  p.v_stride_slot = v_cache.stride(1);
  p.v_stride_head = v_cache.stride(2);
  p.block_table_stride = block_tables.stride(0);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(k_cache.size(2));
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(k_cache.size(1));
  p.max_query_len = static_cast<int>(max_query_len);
  p.num_splits = static_cast<int>(num_splits);
  p.tokens_per_split = static_cast<int>(tokens_per_split);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  const auto dtype = query.scalar_type() == at::kHalf ? kvserve::DType::kFloat16 : kvserve::DType::kBFloat16;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaError_t err = kvserve::launch_paged_attention(p, dtype, decode_config, stream);
  TORCH_CHECK(err == cudaSuccess, "kvserve paged_attention launch failed: ", cudaGetErrorString(err));
  if (num_splits > 1) {
    err = kvserve::launch_merge_splits(p, static_cast<int>(query.size(0)), dtype, stream);
    TORCH_CHECK(err == cudaSuccess, "kvserve merge_splits launch failed: ", cudaGetErrorString(err));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "FlashAttention-2 forward over a paged KV pool (packed varlen; dense, fp8_e4m3 or int8 KIVI pools)");
}
