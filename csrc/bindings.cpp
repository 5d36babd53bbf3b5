// Torch bindings of the kvserve CUDA kernels: argument checks, the current stream, launch checks.
// Only built by the JIT loader (kvserve/kernels/cuda_ext.py); the kernels in attention/*.cu do not
// include torch and compile standalone.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "attention/paged_attention.h"

namespace {

void check_tensor(const torch::Tensor& t, const char* name, int dim, const torch::Device& device) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dim");
}

void check_aligned(const torch::Tensor& t, const char* name) {
  // the kernels read K/V rows with 16-byte loads and Q/out pairs with 4-byte loads
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
  for (int d = 0; d < t.dim() - 1; ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0, name, " stride ", d, " must be a multiple of 8 elements, got ", t.stride(d));
  }
}

}  // namespace

// query [T, H, D]; k_cache, v_cache [num_blocks, block_size, H_kv, D]; block_tables [S, max_blocks],
// query_start_loc [S + 1], seq_lens [S] int32. Returns out [T, H, D].
torch::Tensor paged_attention(const torch::Tensor& query, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                              const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                              int64_t max_query_len, double scale, int64_t num_splits,
                              int64_t tokens_per_split, bool decode_config) {
  TORCH_CHECK(query.is_cuda(), "query must be a CUDA tensor");
  const auto device = query.device();
  check_tensor(query, "query", 3, device);
  check_tensor(k_cache, "k_cache", 4, device);
  check_tensor(v_cache, "v_cache", 4, device);
  check_tensor(block_tables, "block_tables", 2, device);
  check_tensor(query_start_loc, "query_start_loc", 1, device);
  check_tensor(seq_lens, "seq_lens", 1, device);
  TORCH_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16,
              "query must be float16 or bfloat16, got ", query.scalar_type());
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query, k_cache, v_cache must share a dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  for (const auto* t : {&block_tables, &query_start_loc, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "block metadata must be contiguous int32");
  }
  const int64_t head_dim = query.size(2), num_seqs = seq_lens.size(0);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", head_dim);
  TORCH_CHECK(k_cache.size(3) == head_dim, "cache head_dim ", k_cache.size(3), " != query head_dim ", head_dim);
  TORCH_CHECK(query.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start_loc must be [num_seqs + 1] and block_tables [num_seqs, max_blocks]");
  TORCH_CHECK(num_splits >= 1 && tokens_per_split % kvserve::kKvTile == 0,
              "tokens_per_split must be a multiple of ", kvserve::kKvTile);
  check_aligned(query, "query");
  check_aligned(k_cache, "k_cache");
  check_aligned(v_cache, "v_cache");

  const c10::cuda::CUDAGuard guard(device);
  auto out = torch::empty_like(query);
  torch::Tensor o_part, lse_part;
  kvserve::PagedAttentionParams p{};
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
  m.def("paged_attention", &paged_attention, "FlashAttention-2 forward over a paged KV pool (packed varlen)");
}
