// Merges split-KV partials: out[token, head] = sum_s w_s o_s / sum_s w_s, w_s = exp2(lse_s - max lse).
// Grid (num_tokens, num_heads), one thread per head_dim element. Split 0 of every row is non-empty
// (each query row sees KV position 0), so the max is finite; empty splits carry lse = -inf, w = 0.
#include <math.h>

#include "mma.cuh"
#include "paged_attention.h"

namespace kvserve {
namespace {

template <typename T>
__global__ void merge_splits_kernel(const PagedAttentionParams p) {
  const int64_t token = blockIdx.x, head = blockIdx.y;
  const int64_t base = (token * p.num_heads + head) * p.num_splits;
  float lse_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) lse_max = fmaxf(lse_max, p.lse_part[base + s]);
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float num = 0.f, den = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = exp2f(p.lse_part[base + s] - lse_max);
      num += w * p.o_part[(base + s) * p.head_dim + d];
      den += w;
    }
    T* out = static_cast<T*>(p.out) + token * p.o_stride_token + head * p.o_stride_head;
    out[d] = TypeTraits<T>::from_float(num / den);
  }
}

}  // namespace

cudaError_t launch_merge_splits(const PagedAttentionParams& p, int num_tokens, DType dtype,
                                cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const dim3 grid(num_tokens, p.num_heads);
  if (dtype == DType::kFloat16) {
    merge_splits_kernel<__half><<<grid, p.head_dim, 0, stream>>>(p);
  } else {
    merge_splits_kernel<__nv_bfloat16><<<grid, p.head_dim, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace kvserve
